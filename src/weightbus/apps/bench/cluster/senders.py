"""Case 1, senders scale with links: an FSDP2-sharded trainer on T hosts (one rank per host,
each its own NIC) pushes into E engine replicas (TP 1) on other hosts, over `nixl` and `dist`,
every rank sending its own shard to every replica. The links allow min(T, E) x link: the
trainers' NICs bound it while T < E, the engines' from T = E on."""

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

CASE = "senders"
_ENGINE_ARGS = ("--dtype", "bfloat16")


def hosts_needed(args) -> int:
    return max(args.trainer_hosts) + max(args.engine_hosts)


def run(cluster: Cluster, checkpoint: Checkpoint, link_bits_per_s: float, args) -> list[Row]:
    most = max(args.trainer_hosts)
    trainer_hosts, engine_hosts = cluster.hosts[:most], cluster.hosts[most:]
    urls = start_engines(cluster, engine_hosts, str(checkpoint.directory), 1, _ENGINE_ARGS)
    rows = []
    for trainers in args.trainer_hosts:
        with TrainerRanks(
            cluster, trainer_hosts[:trainers], {"checkpoint": str(checkpoint.directory)}
        ) as ranks:
            for engines in args.engine_hosts:
                for transport in args.transports:
                    row = Row(
                        CASE,
                        transport,
                        trainers,
                        engines,
                        checkpoint.nbytes,
                        engines * checkpoint.nbytes,
                        min(trainers, engines) * link_bits_per_s / 8 / 1e9,
                    )
                    _measure(cluster, ranks, urls[:engines], row, args)
                    predict(
                        row,
                        checkpoint,
                        link_bits_per_s,
                        engine=EngineLayout(1),
                        transport=transport,  # dist: broadcast from one rank, else parts
                        replicas=engines,
                        trainer_ranks=trainers,
                        trainer_layout="fsdp",
                        bucket_bytes=args.bucket_bytes,
                        cross_node=True,
                    )
                    check_served(row, urls[:engines], cluster.token, checkpoint.fingerprint)
                    rows.append(row)
    return rows


def _measure(cluster: Cluster, ranks: TrainerRanks, urls: list[str], row: Row, args) -> None:
    key = f"{row.path}-{row.engine_hosts}"
    leader = ranks.hosts[0].address
    options = {
        "transport": row.path,
        "control_host": leader,
        "token": cluster.token,
        "timeout_s": args.timeout,
        "bucket_bytes": args.bucket_bytes,
        "transport_options": (
            {"host": leader, "ucx_tls": "tcp"}
            if row.path == "nixl"
            else {"master_addr": leader, "group_name": f"bench-{row.trainer_hosts}-{key}"}
        ),
    }
    ranks.command("open", key=key, kind="sharded", engines=urls, options=options)
    labels = {f"trainer{i}": host for i, host in enumerate(ranks.hosts)}
    answers = measure_pushes(ranks, key, labels | engine_labels(cluster, urls), row, args)
    row.sent_bytes = [answer["sent_bytes"] for answer in answers]
