"""Runs the sharded trainer (sharded_trainer.py) on N ranks, each a real process on one gloo
group, and reads what each rank did."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from weightbus.engines.vllm.launch import free_port

TRAINER = Path(__file__).with_name("sharded_trainer.py")


def run_ranks(world_size: int, script: Path, args: dict, out: Path) -> list[dict]:
    """Run `script` on `world_size` ranks of one gloo group (its JSON argument: `args` and
    `out`); each rank's record, `<out>/rank<r>.json` ({} when it wrote none)."""
    out.mkdir(parents=True, exist_ok=True)
    procs = _start(world_size, script, json.dumps({**args, "out": str(out)}))
    for proc in procs:
        proc.wait(timeout=600)
    paths = [out / f"rank{rank}.json" for rank in range(world_size)]
    return [json.loads(path.read_text()) if path.exists() else {} for path in paths]


def _start(world_size: int, script: Path, argument: str) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(subprocess.Popen([sys.executable, str(script), argument], env=env))
    return procs


def run_trainers(
    world_size: int,
    model: str,
    engines: list[str],
    actions: list[dict],
    out: Path,
    timeout_s: float = 30,
    vllm: bool = False,
) -> list[list[dict]]:
    """Run the sharded trainer on `world_size` ranks; each rank's records."""
    out.mkdir(parents=True, exist_ok=True)
    args = json.dumps(
        {
            "model": model,
            "engines": engines,
            "actions": actions,
            "out": str(out),
            "timeout_s": timeout_s,
            "vllm": vllm,
        }
    )
    procs = _start(world_size, TRAINER, args)
    for proc in procs:
        proc.wait(timeout=600)
    records = []
    for rank in range(world_size):
        path = out / f"rank{rank}.jsonl"
        records.append(
            [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        )
    return records


def gathered(out: Path, version: str) -> dict[str, torch.Tensor]:
    """The weights rank 0 gathered after pushing `version` (for the test's checks)."""
    return torch.load(out / f"{version}.pt")
