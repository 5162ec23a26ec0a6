"""`weightbus bench pushcost`: a small push's fixed cost, phase by phase.

Two real engines (`weightbus serve --dtype bfloat16`): one started with `--lora-rank R` on a
Llama-shaped bf16 model of `--model-size` at TP `--lora-tp` receives a float32 LoRA adapter
(rank `--rank` on all seven projections, as `weightbus bench lora` pushes it); the other, on a
model of `--size` at TP `--tp`, receives that whole model. Both over `shm`, atomic, verify
full. Rows, round-robin for `--repeat` rounds after an untimed warm-up round
(`measure_interleaved`): each push's memcpy floor (its bytes copied into a preallocated
buffer), then the push.

For each push the report gives the median of every phase of `PushResult.phases`
(`weightbus.core.publisher.phases`: plan, prepare, order, pause, stream, verify, commit,
resume, acks), so the milliseconds of a push that moves few bytes can be told apart: the
control round trips, the engine's step boundaries, the bytes and their checks.
"""

import argparse
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from weightbus.apps.bench.dist import write_model
from weightbus.apps.bench.llama_weights import llama_shape, llama_weights
from weightbus.apps.bench.lora import lora_config, random_adapter
from weightbus.apps.bench.timing import Measurement, measure_interleaved, write_json
from weightbus.apps.launch import start_engine, stop_engines
from weightbus.apps.tables import print_table
from weightbus.core.publisher import Publisher, PushResult
from weightbus.core.publisher.phases import PHASES
from weightbus.core.units import format_bytes, parse_bytes

_MS = 1e3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-size", type=parse_bytes, default=parse_bytes("256MiB"),
        help="the model the adapter applies to (the adapter is ~1/26 of it at rank 16)",
    )  # fmt: skip
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (all seven projections)")
    parser.add_argument("--lora-tp", type=int, default=1, help="TP ranks of the LoRA engine")
    parser.add_argument(
        "--size", type=parse_bytes, default=parse_bytes("12MiB"),
        help="the model pushed whole (12 MiB: the demo's)",
    )  # fmt: skip
    parser.add_argument("--tp", type=int, default=2, help="TP ranks of the whole-model engine")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", default=None, help="write every sample and phase here")


class _Pushes:
    """Each call pushes the same tensors as a new version; keeps every result."""

    def __init__(self, push: Callable[[str], PushResult]) -> None:
        self.push, self.results = push, []

    def __call__(self) -> None:
        result = self.push(f"cost-{len(self.results)}")
        if [e.fingerprint for e in result.engines] != [result.fingerprint]:
            raise RuntimeError(f"the engine does not serve {result.fingerprint}")
        self.results.append(result)


def _floor(nbytes: int) -> Callable[[], object]:
    source = torch.ones(nbytes, dtype=torch.uint8)
    target = torch.empty_like(source)
    return lambda: target.copy_(source)


def run(args: argparse.Namespace) -> int:
    base = llama_weights(args.model_size, torch.bfloat16)
    adapter = random_adapter(llama_shape(args.model_size), args.rank, torch.float32)
    whole = llama_weights(args.size, torch.bfloat16)
    with tempfile.TemporaryDirectory(prefix="weightbus-bench-pushcost-") as tmp:
        lora_dir = write_model(base, args.model_size, Path(tmp), "lora")
        whole_dir = write_model(whole, args.size, Path(tmp), "whole")
        lora_flags = ["--dtype", "bfloat16", "--lora-rank", str(args.rank)]
        lora_proc, lora_url = start_engine(str(lora_dir), args.lora_tp, extra=lora_flags)
        procs = [lora_proc]
        try:
            whole_proc, whole_url = start_engine(
                str(whole_dir), args.tp, extra=["--dtype", "bfloat16"]
            )
            procs.append(whole_proc)
            with (
                Publisher([lora_url], transport="shm") as lora_pub,
                Publisher([whole_url], transport="shm") as whole_pub,
            ):
                fingerprint = lora_pub.fingerprint(base)
                config = lora_config(args.rank)
                pushes = {
                    "adapter push": _Pushes(
                        lambda v: lora_pub.push(
                            adapter, version=v, adapter=config, base_fingerprint=fingerprint
                        )
                    ),
                    "whole push": _Pushes(lambda v: whole_pub.push(whole, version=v)),
                }
                rows = _measure(adapter, whole, pushes, args.repeat)
        finally:
            stop_engines(procs)
    _report(rows, pushes, args)
    return 0


def _measure(
    adapter: dict[str, torch.Tensor],
    whole: list[tuple[str, torch.Tensor]],
    pushes: dict[str, _Pushes],
    repeat: int,
) -> list[Measurement]:
    adapter_bytes = sum(t.nbytes for t in adapter.values())
    whole_bytes = sum(t.nbytes for _, t in whole)
    return measure_interleaved(
        [
            ("memcpy floor, adapter", adapter_bytes, _floor(adapter_bytes)),
            ("adapter push", adapter_bytes, pushes["adapter push"]),
            ("memcpy floor, whole", whole_bytes, _floor(whole_bytes)),
            ("whole push", whole_bytes, pushes["whole push"]),
        ],
        repeat,
    )


def median_phases(results: list[PushResult]) -> dict[str, float]:
    """The median of every phase over `results` (the warm-up's first push left out)."""
    timed = results[1:] or results
    return {phase: statistics.median(r.phases.get(phase, 0.0) for r in timed) for phase in PHASES}


def _report(rows: list[Measurement], pushes: dict[str, _Pushes], args: argparse.Namespace) -> None:
    by_name = {m.name: m for m in rows}
    floors = {"adapter push": "memcpy floor, adapter", "whole push": "memcpy floor, whole"}
    print(
        f"LoRA rank {args.rank} adapter on a {format_bytes(args.model_size)} model (TP "
        f"{args.lora_tp}); a {format_bytes(args.size)} model pushed whole (TP {args.tp}); shm, "
        f"atomic, verify full; median of {args.repeat}\n"
    )
    print_table(
        ["push", "bytes", "median ms", "x floor"],
        [
            [name, format_bytes(by_name[name].nbytes), f"{by_name[name].median_s * _MS:.1f}",
             f"{by_name[name].median_s / by_name[floor].median_s:.0f}"]
            for name, floor in floors.items()
        ],
    )  # fmt: skip
    phases = {name: median_phases(p.results) for name, p in pushes.items()}
    print("\nwhere the time goes, median ms per phase (PushResult.phases)")
    print_table(
        ["phase", *phases],
        [[phase, *(f"{phases[n][phase] * _MS:.2f}" for n in phases)] for phase in PHASES],
    )
    if args.json:
        write_json(args.json, {"rows": rows, "phases_s": phases})
