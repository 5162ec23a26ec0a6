"""How long a push takes: a small model of its schedule, from link and copy bandwidths.

A push is three stages that every bucket goes through, each timed on its busiest agent over the
whole push:

- `stage`: the trainer rank readies its bytes (host-to-device copy when they wait in host
  memory; the pack into send buffers or slots where the transport packs) and hashes them (the
  fingerprint; per-rank checks where the transport makes them);
- `wire`: bytes over the links. Sharded patterns: the busier of the busiest trainer rank's
  egress and the busiest engine rank's ingress; broadcast: the model's bytes at the group's
  broadcast (algorithm) bandwidth; slots: nothing crosses a link;
- `apply`: the engine rank copies its share into its parameters (not for direct writes, which
  land in place), pays a fixed cost per tensor it applies (`load_weights` dispatch), and hashes
  what it verifies.

With buckets pipelined (two or more in flight) the stages overlap: the push takes the slowest
stage, plus one bucket of each other stage to fill and drain the pipeline, plus a latency per
bucket and a fixed cost per push (hand-shake, verdicts, commit). On a host whose cores run the
trainer and the ranks alike (`shared_cpu`, e.g. this CPU machine over loopback), the stages
compete for the same cores and add up instead.
"""

from dataclasses import asdict, dataclass, field

from weightbus.apps.capacity.traffic import Traffic

GB = 1e9


@dataclass(frozen=True, slots=True, kw_only=True)
class Hardware:
    """Bandwidths (GB/s = 1e9 bytes/s, one direction, per rank) and fixed costs of a cluster."""

    name: str
    nic_gb_per_s: float  # between nodes, per NIC (one per rank unless ranks share one)
    local_gb_per_s: float  # between ranks of one node (NVLink; on a CPU host: a memcpy)
    broadcast_gb_per_s: float | None = None  # a broadcast's algorithm bandwidth; None: derived
    # "pipelined" (NCCL: the model crosses each link about once, at `broadcast_gb_per_s`) or
    # "binomial" (gloo: whole buffers down a binomial tree; the busiest NIC carries
    # `Traffic.broadcast_nic_copies` copies at the NIC's bandwidth)
    broadcast_algorithm: str = "pipelined"
    stage_gb_per_s: float | None = None  # host-to-device staging; None: bytes already in place
    copy_gb_per_s: float  # the receiver's copy into its parameters
    hash_gb_per_s: float | None = None  # the trainer's fingerprint pass; None: no hashing
    tensor_s: float = 0.0  # per tensor a rank applies
    bucket_s: float = 0.0  # per bucket
    push_s: float = 0.0  # per push
    shared_cpu: bool = False
    sources: dict[str, str] = field(default_factory=dict)  # figure -> where it comes from

    def link_gb_per_s(self, cross_node: bool) -> float:
        return self.nic_gb_per_s if cross_node else self.local_gb_per_s

    def broadcast_bandwidth(self, cross_node: bool) -> float:
        if self.broadcast_gb_per_s is not None:
            return self.broadcast_gb_per_s
        return self.link_gb_per_s(cross_node)


@dataclass(frozen=True, slots=True)
class Timing:
    """Predicted seconds of one push and of each stage."""

    seconds: float
    stage_s: float
    wire_s: float
    apply_s: float
    fill_s: float  # pipeline fill and drain
    buckets_s: float  # latency of the buckets one stream sends in turn
    push_s: float
    bottleneck: str  # the slowest stage
    overlapped: bool  # stages overlap (pipelined buckets) rather than add up

    def as_dict(self) -> dict:
        return asdict(self)


def predict(
    traffic: Traffic,
    hardware: Hardware,
    *,
    cross_node: bool,
    staged_from_host: bool = False,
    stage_overlaps: bool = True,
) -> Timing:
    """Predicted time of a push with this traffic on this hardware.

    Args:
        cross_node: the bytes cross nodes (NICs), else they stay on one node (local links).
        staged_from_host: the trainer's bytes wait in host memory and are copied to the device
            first (`hardware.stage_gb_per_s`).
        stage_overlaps: the trainer readies bucket k+1 while bucket k is on the wire; when
            False (checkpoint-engine's host-to-device round), staging runs before the rest.
    """
    stages = {
        "stage": _stage_s(traffic, hardware, staged_from_host),
        "wire": _wire_s(traffic, hardware, cross_node),
        "apply": _apply_s(traffic, hardware),
    }
    buckets = traffic.sequential_buckets
    bottleneck = max(stages, key=stages.get)
    serial = hardware.shared_cpu or buckets == 1
    if serial:
        stream_s, fill_s = sum(stages.values()), 0.0
    else:
        overlapped = {k: v for k, v in stages.items() if stage_overlaps or k != "stage"}
        slowest = max(overlapped.values())
        stream_s = slowest + sum(v for k, v in stages.items() if k not in overlapped)
        fill_s = (sum(overlapped.values()) - slowest) / buckets
    buckets_s = buckets * hardware.bucket_s
    return Timing(
        seconds=stream_s + fill_s + buckets_s + hardware.push_s,
        stage_s=stages["stage"],
        wire_s=stages["wire"],
        apply_s=stages["apply"],
        fill_s=fill_s,
        buckets_s=buckets_s,
        push_s=hardware.push_s,
        bottleneck=bottleneck,
        overlapped=not serial,
    )


def _stage_s(traffic: Traffic, hardware: Hardware, staged_from_host: bool) -> float:
    seconds = 0.0
    if hardware.hash_gb_per_s:
        seconds += traffic.trainer_hash_bytes / (hardware.hash_gb_per_s * GB)
    seconds += traffic.pack_bytes / (hardware.copy_gb_per_s * GB)
    if staged_from_host and hardware.stage_gb_per_s:
        seconds += max(traffic.trainer_own_bytes) / (hardware.stage_gb_per_s * GB)
    return seconds


def _wire_s(traffic: Traffic, hardware: Hardware, cross_node: bool) -> float:
    if traffic.pattern == "slots":
        return 0.0
    link = hardware.link_gb_per_s(cross_node) * GB
    if traffic.pattern == "broadcast":
        if hardware.broadcast_algorithm == "binomial" and cross_node:
            return traffic.broadcast_nic_copies * traffic.broadcast_bytes / link
        return traffic.broadcast_bytes / (hardware.broadcast_bandwidth(cross_node) * GB)
    busiest_engine = traffic.nic_receive_bytes if cross_node else max(traffic.receive_bytes)
    trainers = [
        sent + exchanged
        for sent, exchanged in zip(
            traffic.trainer_send_bytes, traffic.trainer_exchange_bytes, strict=True
        )
    ]
    return max(*trainers, busiest_engine) / link


def _apply_s(traffic: Traffic, hardware: Hardware) -> float:
    per_rank = []
    hash_rate = (hardware.hash_gb_per_s or 0.0) * GB
    ranks = zip(traffic.rank_copy_bytes, traffic.rank_tensors, traffic.rank_hash_bytes, strict=True)
    for copied, tensors, hashed in ranks:
        seconds = hashed / hash_rate if hash_rate else 0.0
        if copied:  # direct writes land in the parameters: nothing to copy or dispatch
            seconds += copied / (hardware.copy_gb_per_s * GB) + tensors * hardware.tensor_s
        per_rank.append(seconds)
    return max(per_rank)
