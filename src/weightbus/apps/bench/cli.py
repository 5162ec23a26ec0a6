"""`weightbus bench [SUITE]`: benchmark suites, each a module with `add_arguments` and `run`.

Without a suite, `weightbus bench` runs the full comparison (`weightbus.apps.bench.compare`): every
transport against the floor and the baselines, same run, same weights.
"""

import argparse
import importlib

from weightbus.apps.progress import add_quiet_flag

# suite name -> (module, one-line help); modules are imported only when their suite runs.
SUITES = {
    "buckets": ("weightbus.apps.bench.buckets", "flat-bucket packing vs a memcpy floor, same run"),
    "cluster": (
        "weightbus.apps.bench.cluster.cli",
        "hosts behind rate-limited links: senders, replicas, deltas beside weightbus plan",
    ),
    "delta": (
        "weightbus.apps.bench.delta",
        "bits changed between RL steps; full vs tensor-skip vs sparse delta pushes, same run",
    ),
    "dist": (
        "weightbus.apps.bench.dist",
        "dist pushes (broadcast, parts) vs raw gloo broadcasts, same run",
    ),
    "fp8": (
        "weightbus.apps.bench.fp8",
        "bf16 push vs block-FP8 quantized in the push: bytes, time, quantize vs memcpy floor",
    ),
    "lora": (
        "weightbus.apps.bench.lora",
        "LoRA adapter push vs merge + whole push: bytes, time, floors; merging's logit error",
    ),
    "pushcost": (
        "weightbus.apps.bench.push_cost",
        "a small push's fixed cost phase by phase: a LoRA adapter and a 12 MiB model",
    ),
    "fleet": (
        "weightbus.apps.bench.fleet",
        "two-phase vs one-phase fleet pushes, rollback, commit skew, same run",
    ),
    "plan": (
        "weightbus.apps.bench.plan",
        "weightbus plan's predicted push times against measured shm and dist pushes",
    ),
    "moe": (
        "weightbus.apps.bench.moe",
        "an MoE at EP 2: each expert to its ranks vs every byte to every rank, vs weightbus plan",
    ),
    "nixl": (
        "weightbus.apps.bench.nixl",
        "nixl pushes vs raw NIXL WRITEs and dist, one host and netns",
    ),
    "serving": (
        "weightbus.apps.bench.serving",
        "streamed completions while a trainer pushes: stall, goodput, aborts per pause mode",
    ),
    "engine": (
        "weightbus.apps.bench.engine",
        "reference engine tokens/s at batch 1 and 16, TP 1 and 2",
    ),
    "sharded": (
        "weightbus.apps.bench.sharded",
        "FSDP2 trainer ranks pushing their own shards vs full_tensor() + one push, same run",
    ),
    "status": (
        "weightbus.apps.bench.status",
        "decode step cost of the live-update machinery at rest",
    ),
    "update": ("weightbus.apps.bench.update", "push into real engines: floor, shm, disk, same run"),
    "vllm": (
        "weightbus.apps.bench.vllm",
        "push into a live vLLM server vs save + vLLM reload vs the floor, same run",
    ),
}


DEFAULT_SUITE = "weightbus.apps.bench.compare"


def add_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser(
        "bench",
        help="compare every way to move weights into an engine (or run one SUITE)",
        description="Without SUITE: the full comparison (floor, safetensors reload, per-tensor "
        "broadcast, pickling, every weightbus transport), same run, same weights.",
    )
    importlib.import_module(DEFAULT_SUITE).add_arguments(bench)
    add_quiet_flag(bench)
    bench.set_defaults(handler=_runner(DEFAULT_SUITE))
    # a suite's own arguments and handler replace the comparison's when one is named
    suites = bench.add_subparsers(dest="suite", required=False, metavar="SUITE")
    for name, (module_name, help_text) in SUITES.items():
        module = importlib.import_module(module_name)
        suite = suites.add_parser(name, help=help_text)
        suite.set_defaults(handler=_runner(module_name))
        module.add_arguments(suite)
        add_quiet_flag(suite)


def _runner(module_name: str):
    def run(args: argparse.Namespace) -> int:
        return importlib.import_module(module_name).run(args)

    return run
