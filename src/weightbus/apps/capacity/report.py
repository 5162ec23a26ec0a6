"""`weightbus plan`'s table: a forecast as people read it."""

from weightbus.apps.capacity.forecast import Forecast
from weightbus.apps.tables import print_table
from weightbus.core.units import format_bytes


def _span(values: tuple[int, ...]) -> str:
    low, high = min(values), max(values)
    return format_bytes(high) if low == high else f"{format_bytes(low)} .. {format_bytes(high)}"


def print_forecast(result: Forecast) -> None:
    """Print the model, the layout, bytes per rank and the predicted time."""
    model, scenario, moved, timing = result.model, result.scenario, result.traffic, result.timing
    engine = scenario.engine
    dtypes = ", ".join(sorted({str(m.dtype).removeprefix("torch.") for m in model.metas}))
    print(
        f"model {model.name}: {model.num_params / 1e9:.2f} B params, {len(model.metas):,} tensors, "
        f"{format_bytes(model.total_bytes)} ({dtypes})"
    )
    where = "across nodes" if scenario.crosses_nodes else "within a node"
    fsdp = " (FSDP shards)" if scenario.trainer_layout == "fsdp" else ""
    experts = ""
    if engine.ep > 1:
        experts = f", {engine.placement}, {engine.redundant_experts} redundant"
    print(
        f"engines: {scenario.replicas} x TP {engine.tp} (EP {engine.ep}{experts}) = "
        f"{scenario.replicas * engine.tp} ranks; {scenario.trainer_ranks} trainer rank(s){fsdp}; "
        f"{scenario.transport} ({moved.pattern}) {where}; hardware {scenario.hardware.name}"
    )
    print(f"buckets: {moved.num_buckets:,} of {format_bytes(scenario.bucket_bytes)}\n")
    rows = [
        ["engine rank receives", _span(moved.receive_bytes)],
        ["engine rank holds (its share)", _span(moved.share_bytes)],
        ["engine rank staging, atomic", _span(moved.staging_bytes)],
        [
            "engine rank tensors",
            ", ".join(sorted({f"{n:,}" for n in moved.rank_tensors})),
        ],
        ["trainer rank sends", _span(moved.trainer_send_bytes)],
        ["trainer rank buffers", format_bytes(moved.trainer_buffer_bytes)],
    ]
    if any(moved.trainer_exchange_bytes):
        rows.append(["trainer rank sends its peers", _span(moved.trainer_exchange_bytes)])
    if scenario.engine_ranks_per_nic > 1:
        rows.append(["engine NIC receives (busiest)", format_bytes(moved.nic_receive_bytes)])
    if scenario.hardware.broadcast_algorithm == "binomial" and moved.pattern == "broadcast":
        rows.append(["model copies on the busiest NIC", str(moved.broadcast_nic_copies)])
    print_table(["per rank", "bytes"], rows)
    if moved.replicated_by_default:
        print(
            f"\nnote: no TP rule for {', '.join(moved.replicated_by_default)}: planned as "
            "replicated on every rank"
        )
    print(f"\npredicted push: {timing.seconds:.3f} s, bottleneck: {timing.bottleneck}")
    stages = f"stage {timing.stage_s:.3f}, wire {timing.wire_s:.3f}, apply {timing.apply_s:.3f}"
    if timing.overlapped:
        print(f"  = the slowest stage + fill {timing.fill_s:.3f} (stages overlap: {stages})")
    else:
        print(f"  = {stages}, added (shared cores, or one bucket)")
    print(f"  + buckets {timing.buckets_s:.3f} + push {timing.push_s:.3f}")
