"""Case 4, each expert only to the ranks that hold it, where a link is the bound: one trainer
process on its own host pushes a Qwen3-MoE (bf16, per-expert tensors) into one engine at
`--tp 2 --expert-parallel` (EP 2: two ranks behind one NIC), three ways:

- `dist parts`: each rank receives its experts and its dense share, over gloo;
- `dist broadcast`: every byte to every rank (what an engine does for a layout the sender does
  not know): gloo's binomial tree sends the model into the engine's NIC twice, once per rank;
- `nixl`: each rank's experts and dense share written one-sided.

and, as a baseline, `dist parts` into the same model served at `--tp 2` without expert
parallelism (every rank a slice of every expert), on a host of its own.

The engines start from other weights of the same shape (another seed), so that the pushed
fingerprint they serve afterwards is the push's doing, not the checkpoint's.
"""

from concurrent.futures import ThreadPoolExecutor

from weightbus.apps.bench.cluster.common import (
    Checkpoint,
    Row,
    check_served,
    engine_labels,
    measure_pushes,
    predict,
    served,
    write_moe_checkpoint,
)
from weightbus.apps.capacity.sharding import EngineLayout
from weightbus.apps.cluster.hosts import Cluster
from weightbus.apps.cluster.ranks import TrainerRanks

CASE = "experts"
TP = 2
EP_LAYOUT = EngineLayout(TP, TP)  # --expert-parallel: EP = TP, placed linear, no redundancy
TP_LAYOUT = EngineLayout(TP)
# path -> (the engine's layout, the planner's transport)
PATHS = {
    "dist parts": (EP_LAYOUT, "dist-parts"),
    "dist broadcast": (EP_LAYOUT, "dist-broadcast"),
    "nixl": (EP_LAYOUT, "nixl"),
    "dist parts, TP": (TP_LAYOUT, "dist-parts"),
}
# each routed path against the one that sends every byte to every rank
SPEEDUPS = (("dist parts", "dist broadcast"), ("nixl", "dist broadcast"))
_ENGINE_ARGS = {
    EP_LAYOUT: ("--dtype", "bfloat16", "--expert-parallel"),
    TP_LAYOUT: ("--dtype", "bfloat16"),
}


def hosts_needed(args) -> int:
    return 1 + len(_layouts(args))


def _layouts(args) -> list[EngineLayout]:
    """The engines the chosen paths need, one host each."""
    return list(dict.fromkeys(PATHS[path][0] for path in args.expert_paths))


def run(cluster: Cluster, checkpoint: Checkpoint, link_bits_per_s: float, args) -> list[Row]:
    trainer, *engine_hosts = cluster.hosts
    folder = checkpoint.directory
    start = folder.with_name(f"{folder.name}-start")
    start = write_moe_checkpoint(start, args.moe_size, args.moe_experts, seed=1)
    layouts = _layouts(args)
    with ThreadPoolExecutor(max_workers=len(layouts)) as pool:
        started = {
            layout: pool.submit(
                cluster.start_engine, host, str(start.directory), TP, _ENGINE_ARGS[layout]
            )
            for layout, host in zip(layouts, engine_hosts, strict=True)
        }
    urls = {layout: future.result()[1] for layout, future in started.items()}
    # the engines' own fingerprint of what they loaded is the one computed here
    prints = served(list(urls.values()), cluster.token)
    unlike = (
        []
        if set(prints) == {start.fingerprint}
        else [f"engines started serving {prints}, expected {start.fingerprint}"]
    )
    rows = []
    with TrainerRanks(cluster, [trainer], {"tensors": str(checkpoint.directory)}) as ranks:
        for path in args.expert_paths:
            layout, transport = PATHS[path]
            row = Row(
                CASE,
                path,
                1,
                1,
                checkpoint.nbytes,
                checkpoint.nbytes,
                link_bits_per_s / 8 / 1e9,  # the engine's one NIC (and the trainer's)
                failures=list(unlike),
            )
            _measure(cluster, ranks, urls[layout], row, args)
            predict(
                row,
                checkpoint,
                link_bits_per_s,
                engine=layout,
                transport=transport,
                bucket_bytes=args.bucket_bytes,
                engine_ranks_per_nic=TP,
            )
            check_served(row, [urls[layout]], cluster.token, checkpoint.fingerprint)
            rows.append(row)
    return rows


def _measure(cluster: Cluster, ranks: TrainerRanks, url: str, row: Row, args) -> None:
    key = row.path
    address = ranks.hosts[0].address
    common = {"token": cluster.token, "timeout_s": args.timeout, "bucket_bytes": args.bucket_bytes}
    if row.path == "nixl":
        options = {"transport": "nixl", "transport_options": {"host": address, "ucx_tls": "tcp"}}
        opened = {"options": {**common, **options}}
    else:
        mode = row.path.split(",")[0].removeprefix("dist ")
        name = "-".join(key.replace(",", "").split())
        group = {"mode": mode, "group_name": f"bench-experts-{name}"}
        options = {"transport": "dist", "transport_options": group}
        opened = {"options": {**common, **options}, "weights_group": address}
    ranks.command("open", key=key, kind="plain", engines=[url], **opened)
    labels = {"trainer0": ranks.hosts[0], **engine_labels(cluster, [url])}
    row.sent_bytes = [measure_pushes(ranks, key, labels, row, args)[0]["sent_bytes"]]


def speedups(rows: list[Row]) -> list[tuple[str, str, float]]:
    """(routed path, whole path, how many times faster the routed one pushed) for each pair of
    `SPEEDUPS` both measured."""
    by_path = {row.path: row for row in rows if row.case == CASE}
    return [
        (routed, whole, by_path[whole].median_s / by_path[routed].median_s)
        for routed, whole in SPEEDUPS
        if routed in by_path and whole in by_path
    ]
