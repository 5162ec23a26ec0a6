"""Case 2, one push to R replicas: one trainer process on its own host pushes the whole model
into R replicas (TP 2, each on its own host: two ranks behind one NIC) three ways:

- `dist broadcast`: one gloo broadcast per bucket to every engine rank (a binomial tree: the
  trainer's NIC sends the model ceil(log2(1 + 2R)) times);
- `nixl`: one-sided WRITEs of each rank's TP slice (the trainer's NIC sends the model R times);
- `routed`: one replica on the trainer's own host over `shm`, the other R - 1 over `nixl`, in
  one push (`Publisher(transport={url: name})`): R - 1 copies cross the trainer's NIC.
"""

from weightbus.apps.bench.cluster.common import (
    Checkpoint,
    Row,
    check_served,
    engine_labels,
    measure_pushes,
    predict,
    start_engines,
)
from weightbus.apps.capacity.sharding import EngineLayout
from weightbus.apps.cluster.hosts import Cluster
from weightbus.apps.cluster.ranks import TrainerRanks

CASE = "replicas"
TP = 2
PATHS = ("dist broadcast", "nixl", "routed")
_ENGINE_ARGS = ("--dtype", "bfloat16")


def hosts_needed(args) -> int:
    return 1 + max(args.replicas)


def run(cluster: Cluster, checkpoint: Checkpoint, link_bits_per_s: float, args) -> list[Row]:
    trainer, replica_hosts = cluster.hosts[0], cluster.hosts[1 : 1 + max(args.replicas)]
    model = str(checkpoint.directory)
    *remote, local = start_engines(cluster, [*replica_hosts, trainer], model, TP, _ENGINE_ARGS)
    rows = []
    with TrainerRanks(cluster, [trainer], {"checkpoint": model}) as ranks:
        for replicas in args.replicas:
            for path in PATHS:
                urls = [local, *remote[: replicas - 1]] if path == "routed" else remote[:replicas]
                row = Row(
                    CASE,
                    path,
                    1,
                    replicas,
                    checkpoint.nbytes,
                    replicas * checkpoint.nbytes,
                    link_bits_per_s / 8 / 1e9,  # the trainer's one NIC
                )
                _measure(cluster, ranks, urls, row, args)
                _predict(row, checkpoint, link_bits_per_s, args)
                check_served(row, urls, cluster.token, checkpoint.fingerprint)
                rows.append(row)
    return rows


def _publisher(cluster: Cluster, urls: list[str], row: Row, address: str, args) -> dict:
    nixl = {"host": address, "ucx_tls": "tcp"}
    common = {"token": cluster.token, "timeout_s": args.timeout, "bucket_bytes": args.bucket_bytes}
    if row.path == "dist broadcast":
        group = {"mode": "broadcast", "group_name": f"bench-broadcast-{row.engine_hosts}"}
        return {
            "options": {**common, "transport": "dist", "transport_options": group},
            "weights_group": address,
        }
    if row.path == "nixl":
        return {"options": {**common, "transport": "nixl", "transport_options": nixl}}
    routes = {url: ("shm" if index == 0 else "nixl") for index, url in enumerate(urls)}
    return {"options": {**common, "transport": routes, "transport_options": {"nixl": nixl}}}


def _measure(cluster: Cluster, ranks: TrainerRanks, urls: list[str], row: Row, args) -> None:
    key = f"{row.path}-{row.engine_hosts}"
    address = ranks.hosts[0].address
    opened = _publisher(cluster, urls, row, address, args)
    ranks.command("open", key=key, kind="plain", engines=urls, **opened)
    labels = {"trainer0": ranks.hosts[0], **engine_labels(cluster, urls)}
    row.sent_bytes = [measure_pushes(ranks, key, labels, row, args)[0]["sent_bytes"]]


def _predict(row: Row, checkpoint: Checkpoint, link_bits_per_s: float, args) -> None:
    """The planner's time: for `routed`, its slower half (the `shm` replica or the R - 1 over
    `nixl`; they stream at the same time); none for R = 1 routed (one local replica)."""
    common = {
        "engine": EngineLayout(TP),
        "bucket_bytes": args.bucket_bytes,
        "engine_ranks_per_nic": TP,
    }
    if row.path == "dist broadcast":
        predict(
            row,
            checkpoint,
            link_bits_per_s,
            transport="dist-broadcast",
            replicas=row.engine_hosts,
            **common,
        )
        return
    remote = row.engine_hosts - (row.path == "routed")
    if remote:
        predict(row, checkpoint, link_bits_per_s, transport="nixl", replicas=remote, **common)
    if row.path == "routed":
        local = Row(CASE, "shm", 1, 1, row.model_bytes, row.model_bytes, 0.0)
        predict(local, checkpoint, link_bits_per_s, transport="shm", **common)
        if local.predicted_s > row.predicted_s:
            row.predicted_s, row.predicted_bottleneck = local.predicted_s, "shm replica"
