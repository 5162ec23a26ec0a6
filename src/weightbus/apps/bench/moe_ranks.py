"""`weightbus bench moe --trainer-ranks N ...`: an expert-parallel trainer's push against
gathering the experts first, same run.

The trainer is the checkpoint's Qwen3-MoE on N processes, held as FSDP2 holds it (`Shard(0)`
DTensors on a gloo CPU mesh, the fused expert tensors cut by expert: `moe_rank_worker.py`), the
engine one `weightbus serve` at TP `--tp` with `--expert-parallel`. For each N, interleaved: a
floor (every rank copies what it holds into shared memory at once), the gather alone, and per
transport the ranks each pushing what they hold (`EP ranks`) against `full_tensor()` on every
tensor then one push from rank 0 (the baseline users run without a group). Each row: rank 0's
median seconds, each rank's sent bytes beside `weightbus plan --trainer-layout ep`'s, and each
rank's peak private memory above the push's start against its transport buffers (its shard it
holds anyway).
"""

import json
from dataclasses import dataclass
from pathlib import Path

from weightbus.apps.capacity.shapes import model_tensors
from weightbus.apps.capacity.sharding import EngineLayout
from weightbus.apps.capacity.traffic import traffic
from weightbus.apps.launch import run_rank_processes
from weightbus.apps.tables import print_table
from weightbus.core.units import format_bytes

# the planner's path of each transport the rows push over
PLANNED_PATHS = {"shm": "shm", "dist": "dist-parts"}


@dataclass(frozen=True, slots=True)
class RankRun:
    """What N trainer ranks push, and into which engine.

    Attributes:
        model_dir: a Qwen3-MoE checkpoint (`config.json`, one `model.safetensors` with
            per-expert names) that the engine at `url` serves at EP = TP = `tp`.
        transports: `shm` (direct), `dist` (parts): the rows' transports.
        repeat: timed rounds (after one untimed round).
        bucket_bytes: the pushes' buckets (a `dist` rank packs two at a time, a payload per
            engine rank: with the default's 256 MiB, up to 1 GiB per weights group).
        timeout_s: bound of the trainer ranks' run.
    """

    model_dir: str
    url: str
    tp: int
    transports: tuple[str, ...] = ("shm", "dist")
    repeat: int = 3
    bucket_bytes: int = 64 * 2**20
    timeout_s: float = 1800.0


def run_ranks(run: RankRun, world_size: int, out: Path) -> list[dict]:
    """Every row on `world_size` trainer processes (one gloo group); each rank's record.

    Raises:
        RuntimeError: a rank exited with an error (the others are stopped).
        subprocess.TimeoutExpired: the ranks ran past `run.timeout_s` (all are stopped).
    """
    out.mkdir(parents=True, exist_ok=True)
    argument = json.dumps({
        "model_dir": run.model_dir, "url": run.url, "transports": list(run.transports),
        "repeat": run.repeat, "bucket_bytes": run.bucket_bytes, "out": str(out),
    })  # fmt: skip
    codes = run_rank_processes(
        "weightbus.apps.bench.moe_rank_worker", argument, world_size, run.timeout_s
    )
    if any(codes):
        raise RuntimeError(f"trainer ranks exited with {codes}")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def planned_sends(run: RankRun, transport: str, world_size: int) -> list[int]:
    """Each trainer rank's bytes, as `weightbus plan --model <dir> --engine-tp T --engine-ep T
    --trainer-ranks N --trainer-layout ep` plans them."""
    plan = traffic(
        model_tensors(run.model_dir), EngineLayout(run.tp, run.tp), PLANNED_PATHS[transport],
        trainer_ranks=world_size, trainer_layout="ep", bucket_bytes=run.bucket_bytes,
    )  # fmt: skip
    return list(plan.trainer_send_bytes)


def buffer_bytes(transport: str, bucket_bytes: int, engine_ranks: int) -> int:
    """The most a rank's transport allocates for a push: `shm` direct copies straight into
    the engine's shared memory (none); `dist` packs each engine rank's parts of a bucket into
    a payload of its own while the last bucket's are sent (two buckets per engine rank: a
    bucket of one rank's experts all goes to one engine rank)."""
    return 0 if transport == "shm" else 2 * bucket_bytes * engine_ranks


def check(results: dict[int, list[dict]], fingerprint: str) -> list[str]:
    """What went wrong: a push whose fingerprint is not the checkpoint's (every row of every
    rank pushes the same weights)."""
    problems = []
    for world_size, ranks in results.items():
        for rank in ranks:
            for row, measured in rank["rows"].items():
                got = measured["fingerprint"]
                if got is not None and got != fingerprint:
                    problems.append(
                        f"{world_size} ranks, rank {rank['rank']}, {row}: fingerprint {got}, "
                        f"the checkpoint's is {fingerprint}"
                    )
    return problems


def table(run: RankRun, results: dict[int, list[dict]]) -> list[list[str]]:
    """One line per (ranks, row): seconds, x floor, the gather's cost over the EP push, each
    rank's sent and planned bytes, shard, peak above the push's start, and buffers."""
    lines = []
    for world_size, ranks in results.items():
        rows = ranks[0]["rows"]
        floor = rows["floor"]["seconds"]
        for name, row in rows.items():
            transport = name.split(":")[0]
            per_rank = [rank["rows"][name] for rank in ranks]
            speedup = ""
            if name.endswith("EP ranks") and f"{transport}: full_tensor + rank 0" in rows:
                gathered = rows[f"{transport}: full_tensor + rank 0"]["seconds"]
                speedup = f"{gathered / row['seconds']:.2f}x"
            pushed = row["sent_bytes"] is not None
            planned = ""
            if name.endswith("EP ranks"):
                planned = _bytes(planned_sends(run, transport, world_size))
            elif pushed:
                planned = _bytes(planned_sends(run, transport, 1) + [0] * (world_size - 1))
            lines.append([
                str(world_size), name, f"{row['seconds']:.3f}", f"{row['seconds'] / floor:.2f}",
                speedup,
                _bytes([r["sent_bytes"] for r in per_rank]) if pushed else "",
                planned,
                _bytes([rank["shard_bytes"] for rank in ranks]),
                _bytes([r["peak_extra_bytes"] for r in per_rank]),
                format_bytes(buffer_bytes(transport, run.bucket_bytes, run.tp)) if pushed else "",
            ])  # fmt: skip
    return lines


HEADERS = [
    "ranks", "row", "s", "x floor", "gather / EP", "sent per rank", "planned per rank",
    "shard per rank", "peak above start", "buffers",
]  # fmt: skip


def print_results(run: RankRun, results: dict[int, list[dict]]) -> None:
    print_table(HEADERS, table(run, results))


def _bytes(values: list[int]) -> str:
    return " / ".join(format_bytes(value) for value in values)
