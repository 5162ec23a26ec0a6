"""`weightbus bench serving`: what pushes cost the tokens an engine generates.

One engine (`--engine`: the reference engine, `weightbus serve`, or a vLLM server; a
Llama-shaped bf16 model of `--size` at `--tp`; `serving_engines`) serves `--streams` concurrent
streamed completions in GRPO-like groups (`serving_load`) for `--duration-s`; meanwhile a
trainer process (`serving_trainer`) pushes the model every `--push-every-s` as a new version
over `--transport`. One run without pushes (the baseline), then one per pause mode
(`--modes`), on the same engine. Figures (`serving_report`, `serving_pushes`): per push the
stall, where it lies against the push's phases, the time to the first token of the new
version; per run goodput against the baseline, requests aborted, spanning versions, lost,
tokens of a wrong version. Verdicts against the targets (`serving_output`): `in_place` goodput
>= 90% and stall <= 2 decode steps + the commit; `drain` goodput >= 75%. `--plot` draws
tokens/s over time with the pushes marked. Last, on the reference engine, a prefix-cache row
(`serving_prefix`): a GRPO group with a long prompt on this engine against one started with
`--no-enable-prefix-caching` (target: >= 2x).
"""

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import torch

from weightbus.apps.bench.dist import write_model
from weightbus.apps.bench.llama_weights import llama_shape, llama_weights
from weightbus.apps.bench.serving_engines import ENGINES, ServingEngine, start_serving_engine
from weightbus.apps.bench.serving_load import LoadShape, run_load
from weightbus.apps.bench.serving_output import report
from weightbus.apps.bench.serving_prefix import group_seconds
from weightbus.apps.bench.serving_pushes import push_figures
from weightbus.apps.bench.serving_report import figures
from weightbus.apps.bench.serving_trainer import TrainerConfig, TrainerProcess
from weightbus.apps.progress import StepsProgress
from weightbus.core.units import parse_bytes

MODES = ("drain", "in_place", "abort")
BASELINE = "no pushes"
_TRAINER_START_TIMEOUT_S = 120.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=ENGINES, default="reference")
    parser.add_argument("--size", type=parse_bytes, default=parse_bytes("256MiB"))
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--transport", default="shm")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--running-kv", choices=("keep", "recompute"), default="keep")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--group", type=int, default=8, help="streams sharing one prompt")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--push-every-s", type=float, default=2.0)
    parser.add_argument("--duration-s", type=float, default=12.0, help="per run")
    parser.add_argument(
        "--prefix-rounds",
        type=int,
        default=3,
        help="prefix-cache row (reference engine): groups timed (0: none)",
    )
    parser.add_argument(
        "--prefix-prompt-tokens",
        type=int,
        default=224,
        help="prefix-cache row's prompt (with --prefix-max-tokens, within the bench model's "
        "256 positions)",
    )
    parser.add_argument("--prefix-max-tokens", type=int, default=16)
    parser.add_argument("--warmup-s", type=float, default=3.0, help="untimed load first")
    parser.add_argument("--json", help="write every run's figures and logs here")
    parser.add_argument("--plot", help="write tokens/s over time, pushes marked, as a PNG")


def run(args: argparse.Namespace) -> int:
    weights = llama_weights(args.size, torch.bfloat16)
    shape = LoadShape(
        args.streams,
        args.group,
        args.prompt_tokens,
        args.max_tokens,
        llama_shape(args.size).vocab_size,
    )
    with tempfile.TemporaryDirectory(prefix="weightbus-bench-serving-") as tmp:
        model_dir = write_model(weights, args.size, Path(tmp))
        del weights
        engines = [start_serving_engine(args.engine, model_dir, args.tp)]
        # every trainer starts (imports, loads its weights) now, side by side and outside the
        # measured windows; each waits for its run's `go`
        trainers: dict[str, TrainerProcess] = {}
        try:
            trainers |= {mode: _trainer(mode, engines[0], model_dir, args) for mode in args.modes}
            steps = 2 + len(args.modes) + _with_prefix_row(args)
            with StepsProgress(steps, label="bench serving") as progress:
                # untimed: the engine's first steps touch its KV cache and warm its kernels
                progress.step("warm-up")
                asyncio.run(run_load(engines[0].url, shape, args.warmup_s, engines[0].api))
                for trainer in trainers.values():
                    trainer.wait_ready(_TRAINER_START_TIMEOUT_S)
                runs = []
                for mode in (BASELINE, *args.modes):
                    progress.step(mode)
                    runs.append(_run(mode, engines[0], shape, args, trainers.get(mode)))
                prefix = None
                if _with_prefix_row(args):
                    progress.step("prefix cache on / off")
                    prefix = _prefix_row(engines, model_dir, args)
        finally:
            for trainer in trainers.values():
                trainer.kill()
            for engine in engines:
                engine.stop()
    return report(runs, args, prefix)


def _with_prefix_row(args: argparse.Namespace) -> bool:
    return args.prefix_rounds > 0 and args.engine == "reference"


def _prefix_row(engines: list[ServingEngine], model_dir: Path, args: argparse.Namespace) -> dict:
    """A GRPO group of `--group` with a `--prefix-prompt-tokens` prompt on this engine (prefix
    cache on) and on one started without it, rounds interleaved."""
    engines.append(
        start_serving_engine("reference", model_dir, args.tp, ["--no-enable-prefix-caching"])
    )
    seconds = group_seconds(
        {"cache on": engines[0].url, "cache off": engines[-1].url},
        group=args.group,
        prompt_tokens=args.prefix_prompt_tokens,
        max_tokens=args.prefix_max_tokens,
        vocab_size=llama_shape(args.size).vocab_size,
        rounds=args.prefix_rounds,
    )
    return {**seconds, "speedup": seconds["cache off"] / seconds["cache on"]}


def _run(
    mode: str,
    engine: ServingEngine,
    shape: LoadShape,
    args: argparse.Namespace,
    trainer: TrainerProcess | None,
) -> dict:
    """One run: the load for `--duration-s`, with `trainer` (ready) pushing unless it is
    None. Returns its figures, pushes and request logs."""
    initial = engine.served_version()
    if trainer is not None:
        trainer.go()
    start_s = time.time()
    logs = asyncio.run(run_load(engine.url, shape, args.duration_s, engine.api))
    end_s = time.time()
    pushes = [] if trainer is None else trainer.pushes()
    run_figures = figures(mode, logs, pushes, initial=initial, window_s=(start_s, end_s))
    return {
        "figures": run_figures,
        "pushes": pushes,
        "per_push": push_figures(logs, pushes, start_s),
        "logs": logs,
        "window": (start_s, end_s),
    }


def _trainer(
    mode: str, engine: ServingEngine, model_dir: Path, args: argparse.Namespace
) -> TrainerProcess:
    return TrainerProcess(
        TrainerConfig(
            url=engine.url,
            engine=engine.kind,
            model_dir=str(model_dir),
            transport=args.transport,
            pause_mode=mode,
            running_kv=args.running_kv,
            push_every_s=args.push_every_s,
            duration_s=args.duration_s,
            version_prefix=f"{mode}-{time.time_ns()}",
        )
    )
