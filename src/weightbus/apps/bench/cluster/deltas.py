"""Case 3, deltas on a slow link: the demo's RL trainer (fp32 Adam; a Llama of `TRAINER_MODEL`'s
shape, pushed as bf16) on one host, one engine (TP 1) on another, over `nixl` at the delta
link's rate. Per training run (`bench delta`'s lr 1e-6, and lr 1e-6 with the input embeddings
frozen), after every RL step: a delta push (`delta="auto"`: the bits that changed since the
version the engine serves) and a whole push of the same weights (`delta="never"`), each checked
against the engine's own fingerprint."""

import statistics
from pathlib import Path

from weightbus.apps.bench.cluster.common import (
    Row,
    during,
    engine_labels,
    predict,
    read_checkpoint,
    served,
)
from weightbus.apps.bench.delta import RL_LR
from weightbus.apps.capacity.sharding import EngineLayout
from weightbus.apps.cluster.hosts import Cluster
from weightbus.apps.cluster.ranks import TrainerRanks

CASE = "deltas"
TARGET_SPEEDUP = 5.0  # lr 1e-6, whole push time over delta push time
RUNS = (("lr 1e-6", RL_LR, False), ("lr 1e-6, frozen embeddings", RL_LR, True))
# about 53 M parameters (106 MB as bf16): link time, not the push's fixed cost, dominates
TRAINER_MODEL = {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
}


def hosts_needed(args) -> int:
    return 2


# `--delta-model tiny`: the demo's own tiny Llama (3 M parameters), for quick runs and the tests
MODELS = {"bench": TRAINER_MODEL, "tiny": {}}


def run(cluster: Cluster, workdir: Path, link_bits_per_s: float, args) -> list[Row]:
    trainer_host, engine_host = cluster.hosts[:2]
    model_dir = workdir / "delta-trainer"
    rows: list[Row] = []
    url = None
    for name, lr, frozen in RUNS:
        spec = {
            "trainer": MODELS[args.delta_model],
            "lr": lr,
            "frozen_embeddings": frozen,
            "threads": 2,
        }
        if url is None:  # every run starts from the same weights (seed 0): one engine
            spec["save"] = str(model_dir)
        with TrainerRanks(cluster, [trainer_host], spec) as ranks:
            if url is None:
                url = cluster.start_engine(engine_host, str(model_dir), 1, ("--dtype", "bfloat16"))[
                    1
                ]
            rows += _run(
                cluster,
                ranks,
                url=url,
                name=name,
                link_bits_per_s=link_bits_per_s,
                args=args,
                model_dir=model_dir,
            )
    return rows


def _open(cluster: Cluster, ranks: TrainerRanks, url: str, args) -> None:
    common = {
        "token": cluster.token,
        "timeout_s": args.timeout,
        "bucket_bytes": args.bucket_bytes,
        "transport": "nixl",
        "transport_options": {"host": ranks.hosts[0].address, "ucx_tls": "tcp"},
    }
    for key, delta in (("whole", "never"), ("delta", "auto")):
        ranks.command(
            "open", key=key, kind="plain", engines=[url], options={**common, "delta": delta}
        )


def _run(
    cluster: Cluster,
    ranks: TrainerRanks,
    *,
    url: str,
    name: str,
    link_bits_per_s: float,
    args,
    model_dir: Path,
) -> list[Row]:
    _open(cluster, ranks, url, args)
    start = f"{name}-0"
    pushed = ranks.command("push", key="whole", version=start, options={})[0]
    ranks.command("base", key="delta", version=start)
    model_bytes = pushed["nbytes"]
    label = f"{cluster.link_bits_per_s / 1e6:.0f} Mbit/s, {name}"
    rows = {
        path: Row(
            CASE, f"{label}: {path}", 1, 1, model_bytes, model_bytes, link_bits_per_s / 8 / 1e9
        )
        for path in ("delta", "whole")
    }
    labels = {"trainer0": ranks.hosts[0], **engine_labels(cluster, [url])}
    for step in range(1, args.delta_steps + 1):
        ranks.command("step")
        for path in ("delta", "whole"):
            row, version = rows[path], f"{name}-{step}-{path}"
            answers, row.host_bytes = during(
                labels,
                lambda p=path, v=version: ranks.command("push", key=p, version=v, options={}),
            )
            answer = answers[0]
            row.seconds.append(answer["seconds"])
            row.sent_bytes.append(answer["sent_bytes"])
            if answer["delta"] != (path == "delta"):
                row.failures.append(f"step {step}: went as a delta: {answer['delta']}")
            if served([url], cluster.token) != [answer["fingerprint"]]:
                row.failures.append(
                    f"step {step}: the engine does not serve {answer['fingerprint']}"
                )
        ranks.command("base", key="delta", version=f"{name}-{step}-whole")
    checkpoint = read_checkpoint(model_dir)
    for path, row in rows.items():
        delta_bytes = int(statistics.median(row.sent_bytes)) if path == "delta" else None
        predict(
            row,
            checkpoint,
            link_bits_per_s,
            engine=EngineLayout(1),
            transport="nixl",
            bucket_bytes=args.bucket_bytes,
            delta_bytes=delta_bytes,
        )
    return list(rows.values())
