"""Bytes per rank of one push: what each engine rank holds and receives, what each trainer rank
sends, and the memory both ends set aside — under a transport's data pattern.

Patterns:
- `sharded` (`shm` direct, `nixl`, `dist` parts): each engine rank receives only its share,
  sent to it point to point; a replicated tensor reaches every rank that holds it.
- `broadcast` (`dist` broadcast): every engine rank receives every byte; a trainer rank sends
  each of its bytes once into the collective.
- `slots` (`shm` slots): the trainer packs each byte once into shared memory; every rank maps
  every bucket and copies its share out.
"""

import bisect
import dataclasses
import functools
import heapq
from collections import Counter
from dataclasses import dataclass

from weightbus.apps.capacity.shapes import ModelTensors
from weightbus.apps.capacity.sharding import (
    EngineLayout,
    check_block_alignment,
    check_layout,
    expert_index,
    num_experts,
    rank_shares,
    unmatched_modules,
)
from weightbus.core.digest import leaf_rows
from weightbus.core.plan.planner import plan_buckets

TRANSPORTS = ("shm", "shm-slots", "nixl", "dist", "dist-broadcast", "dist-parts")
# Bucket buffers a dist rank receives into: its prefetch depth (1) + 3 (dist/source.py).
DIST_RANK_BUFFERS = 4
SLOTS = 2  # shm slot-mode slots (the sink's default)
NIXL_INFLIGHT = 2  # nixl send buffers in flight (the sink's default)


def resolve_transport(transport: str, layout: EngineLayout, trainer_ranks: int = 1) -> str:
    """The concrete path: `dist` sends in parts when the trainer has several ranks or the
    engines' ranks are TP groups, else broadcasts (its `auto`)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
    if transport == "dist":
        return "dist-parts" if layout.tp > 1 or trainer_ranks > 1 else "dist-broadcast"
    return transport


def pattern_of(transport: str) -> str:
    """The data pattern of a concrete transport path."""
    if transport == "dist-broadcast":
        return "broadcast"
    return "slots" if transport == "shm-slots" else "sharded"


@dataclass(frozen=True, slots=True)
class Traffic:
    """Per-rank bytes of one push into `replicas` engines of one layout."""

    transport: str  # the concrete path (`dist` resolved to broadcast or parts)
    pattern: str
    total_bytes: int
    num_tensors: int
    num_buckets: int  # buckets of the plan
    sequential_buckets: int  # buckets sent one after another (per trainer rank when in parallel)
    share_bytes: tuple[int, ...]  # by engine TP rank: bytes of the parameters it holds
    receive_bytes: tuple[int, ...]  # by engine TP rank: bytes the transport delivers to it
    nic_receive_bytes: int  # the busiest engine NIC: bytes into it (its ranks' receive_bytes)
    broadcast_nic_copies: int  # broadcast by binomial tree: most model copies one NIC carries
    rank_tensors: tuple[int, ...]  # by engine TP rank: tensors it applies
    rank_copy_bytes: tuple[int, ...]  # by engine TP rank: bytes it copies to apply them
    trainer_own_bytes: tuple[int, ...]  # by trainer rank: bytes of the tensors it sends
    trainer_send_bytes: tuple[int, ...]  # by trainer rank: bytes it hands to the transport
    # by trainer rank: bytes it sends to other trainer ranks so that digest blocks cut by a
    # shard boundary are hashed whole (`core.trainer.digests`; fsdp layouts)
    trainer_exchange_bytes: tuple[int, ...]
    pack_bytes: int  # per trainer rank: bytes it copies into send buffers or slots first
    trainer_hash_bytes: int  # per trainer rank: bytes it hashes (fingerprint, transport checks)
    rank_hash_bytes: tuple[int, ...]  # by engine TP rank: bytes it hashes (verify, checks)
    staging_bytes: tuple[int, ...]  # by engine TP rank, atomic pushes: staging copy + buffers
    trainer_buffer_bytes: int  # per trainer rank: transport buffers it allocates
    replicated_by_default: tuple[str, ...]  # decoder modules no rule names (see sharding)
    delta_bytes: int | None = None  # a delta push (`as_delta`): what its encoding carries

    @property
    def broadcast_bytes(self) -> int:
        """What one broadcast of the push carries: the model, or a delta's encoding."""
        return self.total_bytes if self.delta_bytes is None else self.delta_bytes


def traffic(
    model: ModelTensors,
    layout: EngineLayout,
    transport: str,
    *,
    replicas: int = 1,
    trainer_ranks: int = 1,
    trainer_layout: str = "owners",
    bucket_bytes: int,
    verify: bool = True,
    engine_ranks_per_nic: int = 1,
) -> Traffic:
    """Bytes per rank of one push of `model` into `replicas` engines of `layout`; `verify`:
    the engines re-check digests (`verify="full"`, the Publisher's default);
    `engine_ranks_per_nic`: engine ranks of a replica that share one NIC (a host of several
    ranks with one link); the trainer ranks have a NIC each.

    `trainer_layout`: `owners` (each trainer rank holds and sends whole tensors, the least
    loaded first: replicas splitting the sending, pipeline stages) or `fsdp` (every tensor
    `Shard(0)` over the ranks, FSDP2's uneven chunks: each rank sends its rows of every
    tensor, as a Publisher on every rank does) or `ep` (expert parallel: the experts cut over
    the ranks as FSDP2 cuts transformers 5's fused expert tensors, each expert's tensors sent
    whole by the rank holding it; the other tensors as `fsdp`).

    Raises:
        ValueError: an unknown transport, counts < 1, or a layout the model does not allow
            (`sharding.check_layout`).
    """
    if replicas < 1 or trainer_ranks < 1 or engine_ranks_per_nic < 1:
        raise ValueError(
            "replicas, trainer ranks and engine ranks per NIC must be >= 1, got "
            f"{replicas}, {trainer_ranks}, {engine_ranks_per_nic}"
        )
    check_layout(model.config, layout)
    check_block_alignment(model.metas, model.config, layout)
    transport = resolve_transport(transport, layout, trainer_ranks)
    pattern = pattern_of(transport)
    shares = [rank_shares(meta, model.config, layout) for meta in model.metas]
    share_bytes = tuple(sum(row[r] for row in shares) for r in range(layout.tp))
    total = model.total_bytes
    if pattern == "sharded":
        receive = share_bytes
        costs = [sum(row) * replicas for row in shares]
        tensors = tuple(sum(1 for row in shares if row[r]) for r in range(layout.tp))
    else:
        receive = (total,) * layout.tp
        costs = [meta.nbytes for meta in model.metas]
        tensors = (len(model.metas),) * layout.tp
    buckets = plan_buckets(model.metas, bucket_bytes).num_buckets
    sizes = [meta.nbytes for meta in model.metas]
    if trainer_layout == "fsdp":
        rows = [meta.shape[0] if meta.shape else 1 for meta in model.metas]
        own, senders = (
            _row_chunks(rows, sizes, trainer_ranks),
            _row_chunks(rows, costs, trainer_ranks),
        )
    elif trainer_layout == "ep":
        own, senders = _expert_chunks(model, sizes, costs, trainer_ranks)
    elif trainer_layout == "owners":
        own, senders = _spread(sizes, costs, trainer_ranks)
    else:
        raise ValueError(f"unknown trainer layout {trainer_layout!r}; choose owners, fsdp or ep")
    # sharded: trainer ranks send their own buckets at the same time; else they take turns
    in_turn = buckets if pattern != "sharded" else -(-max(own) // bucket_bytes)
    return Traffic(
        transport=transport,
        pattern=pattern,
        total_bytes=total,
        num_tensors=len(model.metas),
        num_buckets=buckets,
        sequential_buckets=max(1, in_turn),
        share_bytes=share_bytes,
        receive_bytes=receive,
        nic_receive_bytes=max(
            sum(receive[first : first + engine_ranks_per_nic])
            for first in range(0, layout.tp, engine_ranks_per_nic)
        ),
        broadcast_nic_copies=binomial_nic_copies(replicas, layout.tp, engine_ranks_per_nic),
        rank_tensors=tensors,
        rank_copy_bytes=tuple(_copies(transport) * share for share in share_bytes),
        trainer_own_bytes=own,
        trainer_send_bytes=senders,
        trainer_exchange_bytes=_exchange(model, trainer_layout, trainer_ranks),
        pack_bytes=_packed(transport, own, senders),
        trainer_hash_bytes=max(own) + _checked(transport, max(senders), verify),
        rank_hash_bytes=_rank_hashes(transport, share_bytes, receive, verify),
        staging_bytes=tuple(s + _rank_buffers(transport, bucket_bytes) for s in share_bytes),
        trainer_buffer_bytes=_trainer_buffers(transport, bucket_bytes),
        replicated_by_default=tuple(unmatched_modules(model.metas)),
    )


# A delta's encode (compare with the base, gather the changed elements) costs about this many
# memcpys of the model (`weightbus bench delta`: 6.35x and 6.97x at 1 GiB, docs/bench.md).
DELTA_ENCODE_COPIES = 6.5


def as_delta(moved: Traffic, delta_bytes: int) -> Traffic:
    """`moved` as a delta push whose encoding carries `delta_bytes` instead of the model: every
    byte on a wire scales by their ratio; the trainer first encodes the whole version against
    its base (`DELTA_ENCODE_COPIES` memcpys of the model, before the stream: see
    `forecast`)."""
    scale = delta_bytes / moved.total_bytes

    def scaled(values: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(round(value * scale) for value in values)

    return dataclasses.replace(
        moved,
        receive_bytes=scaled(moved.receive_bytes),
        nic_receive_bytes=round(moved.nic_receive_bytes * scale),
        trainer_send_bytes=scaled(moved.trainer_send_bytes),
        rank_copy_bytes=scaled(moved.rank_copy_bytes),
        rank_hash_bytes=scaled(moved.rank_hash_bytes),
        pack_bytes=round(DELTA_ENCODE_COPIES * moved.total_bytes),
        sequential_buckets=max(1, round(moved.sequential_buckets * scale)),
        delta_bytes=delta_bytes,
    )


def binomial_nic_copies(replicas: int, tp: int, engine_ranks_per_nic: int) -> int:
    """How many copies of the model the busiest NIC carries (in or out) when one trainer rank
    broadcasts to every engine rank by a binomial tree, as gloo does: in round i, group ranks
    0 .. 2**i - 1 each send the whole buffer to rank + 2**i. Group rank 0 is the trainer (its
    own NIC); engine ranks follow replica by replica, `engine_ranks_per_nic` to a NIC. A copy
    between two ranks of one NIC crosses no link."""
    size = 1 + replicas * tp
    nic = [0] + [
        1
        + (rank - 1) // tp * -(-tp // engine_ranks_per_nic)
        + (rank - 1) % tp // engine_ranks_per_nic
        for rank in range(1, size)
    ]
    out: dict[int, int] = {}
    into: dict[int, int] = {}
    step = 1
    while step < size:
        for sender in range(min(step, size - step)):
            receiver = sender + step
            if nic[sender] != nic[receiver]:
                out[nic[sender]] = out.get(nic[sender], 0) + 1
                into[nic[receiver]] = into.get(nic[receiver], 0) + 1
        step *= 2
    return max([*out.values(), *into.values(), 0])


def _exchange(model: ModelTensors, trainer_layout: str, ranks: int) -> tuple[int, ...]:
    """Per trainer rank, the digest exchange of the tensors whose rows are cut over the ranks
    (`fsdp`: all; `ep`: all but the experts, held whole)."""
    if trainer_layout == "fsdp":
        return _digest_exchange(model.metas, ranks)
    if trainer_layout == "ep":
        return _digest_exchange([m for m in model.metas if expert_index(m.name) is None], ranks)
    return (0,) * ranks


def _digest_exchange(metas, ranks: int) -> tuple[int, ...]:
    """Per trainer rank, the bytes it sends so that every leaf of a digest tree cut by an FSDP2
    row boundary is hashed whole: at each boundary inside a leaf, the rank holding the smaller
    side sends it to the other (`DigestPlan` gives a cut leaf to the rank holding most). Even
    splits fall on the tree's halvings: nothing travels but 16-byte digests."""
    sent = [0] * ranks
    shapes = Counter(
        (
            meta.shape[0] if meta.shape else 1,
            meta.nbytes // max(meta.shape[0] if meta.shape else 1, 1),
        )
        for meta in metas
    )
    for (rows, row_bytes), count in shapes.items():
        for rank, nbytes in enumerate(_cut_leaves(rows, row_bytes, ranks)):
            sent[rank] += count * nbytes
    return tuple(sent)


@functools.lru_cache(maxsize=1024)
def _cut_leaves(rows: int, row_bytes: int, ranks: int) -> tuple[int, ...]:
    """What each rank sends of the leaves FSDP's row chunks cut, for one tensor."""
    sent = [0] * ranks
    ends = [stop for _, stop in leaf_rows(rows, row_bytes)]
    step = -(-rows // ranks)
    for rank in range(1, ranks):
        boundary = min(rank * step, rows)
        if boundary in (0, rows):
            continue
        index = bisect.bisect_right(ends, boundary)
        first = ends[index - 1] if index else 0
        if first == boundary:  # on a leaf's edge
            continue
        left, right = boundary - first, ends[index] - boundary
        sent[rank - 1 if left < right else rank] += min(left, right) * row_bytes
    return tuple(sent)


def _spread(
    sizes: list[int], costs: list[int], senders: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each tensor sent by one trainer rank, costliest first to the least loaded (how
    checkpoint-engine and Perplexity's transfer spread owners): per trainer rank, the bytes of
    its tensors and the bytes it sends (`costs`: a tensor's bytes over every destination)."""
    loads = [(0, rank) for rank in range(senders)]
    own = [0] * senders
    for cost, size in sorted(zip(costs, sizes, strict=True), reverse=True):
        load, rank = heapq.heappop(loads)
        own[rank] += size
        heapq.heappush(loads, (load + cost, rank))
    sent = {rank: load for load, rank in loads}
    return tuple(own), tuple(sent[rank] for rank in range(senders))


def _expert_chunks(
    model: ModelTensors, sizes: list[int], costs: list[int], ranks: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per trainer rank, the bytes it holds and sends when the experts are cut over the ranks
    (expert e on rank `e // ceil(E / ranks)`, `torch.chunk`'s rule) and every other tensor's
    rows as `fsdp`."""
    experts = max(num_experts(model.config), 1)
    step = -(-experts // ranks)
    own, sent = [0] * ranks, [0] * ranks
    dense: list[tuple[int, int, int]] = []
    for meta, size, cost in zip(model.metas, sizes, costs, strict=True):
        expert = expert_index(meta.name)
        if expert is None:
            dense.append((meta.shape[0] if meta.shape else 1, size, cost))
            continue
        own[expert // step] += size
        sent[expert // step] += cost
    rows = [count for count, _, _ in dense]
    dense_own = _row_chunks(rows, [size for _, size, _ in dense], ranks)
    dense_sent = _row_chunks(rows, [cost for _, _, cost in dense], ranks)
    return (
        tuple(a + b for a, b in zip(own, dense_own, strict=True)),
        tuple(a + b for a, b in zip(sent, dense_sent, strict=True)),
    )


def _row_chunks(rows: list[int], amounts: list[int], ranks: int) -> tuple[int, ...]:
    """Per trainer rank, its share of each tensor's `amounts` when the tensor's rows are cut as
    FSDP2 cuts them (`torch.chunk`: ceil-sized chunks, the last ones short or empty). Exact:
    every row of a tensor costs the same (it goes to the same number of engine ranks)."""
    shares = [0] * ranks
    for count, amount in zip(rows, amounts, strict=True):
        step = -(-count // ranks)
        for rank in range(ranks):
            mine = max(0, min((rank + 1) * step, count) - min(rank * step, count))
            shares[rank] += amount * mine // count
    return tuple(shares)


def _packed(transport: str, own: tuple[int, ...], senders: tuple[int, ...]) -> int:
    """Bytes a trainer rank packs first: shm slots its tensors, nixl and dist parts each
    rank's slices into a send buffer; shm direct's copy is its wire, dist broadcast sends from
    the trainer's tensors."""
    if transport == "shm-slots":
        return max(own)
    return max(senders) if transport in ("nixl", "dist-parts") else 0


def _copies(transport: str) -> int:
    """Copies of its share a rank makes: none for direct writes (they land in the parameters),
    two for `dist` parts (unpack its packed regions into the bucket, then load), else one."""
    if transport in ("shm", "nixl"):
        return 0
    return 2 if transport == "dist-parts" else 1


def _checked(transport: str, sent: int, verify: bool) -> int:
    """Bytes the trainer hashes besides the fingerprint: per-rank checks of what it sends
    (`dist` parts always, `nixl` as it packs, `shm` direct for verifying ranks)."""
    if transport in ("dist-parts", "nixl") or (transport == "shm" and verify):
        return sent
    return 0


def _rank_hashes(
    transport: str, shares: tuple[int, ...], received: tuple[int, ...], verify: bool
) -> tuple[int, ...]:
    """Bytes each engine rank hashes: `dist` parts checks what it received (its engines run
    without verification); verifying ranks re-hash their regions (direct writes) or their part
    of the tensors (every rank receives all of them; each tensor is checked by one rank)."""
    if transport == "dist-parts":
        return received
    if not verify:
        return (0,) * len(shares)
    if transport in ("shm", "nixl"):
        return shares
    return tuple(nbytes // len(received) for nbytes in received)


def _rank_buffers(transport: str, bucket_bytes: int) -> int:
    if transport.startswith("dist"):
        return DIST_RANK_BUFFERS * bucket_bytes
    return 0  # direct writes land in the staging copy; slots are the trainer's


def _trainer_buffers(transport: str, bucket_bytes: int) -> int:
    if transport == "shm-slots":
        return SLOTS * bucket_bytes
    if transport == "nixl":
        return NIXL_INFLIGHT * bucket_bytes
    return 0  # shm direct and dist broadcast send from the trainer's tensors
