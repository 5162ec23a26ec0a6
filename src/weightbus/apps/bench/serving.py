"""`weightbus bench serving`: what pushes cost the tokens an engine generates.

One reference engine (`weightbus serve`, a Llama-shaped bf16 model of `--size` at `--tp`)
serves `--streams` concurrent streamed completions in GRPO-like groups (`serving_load`) for
`--duration-s`; meanwhile a trainer process (`serving_trainer`) pushes the model every
`--push-every-s` as a new version over `--transport`. One run without pushes (the baseline),
then one per pause mode (`--modes`), on the same engine. Figures (`serving_report`): per push
the stall, the time to the first token of the new version, the commit; per run goodput
against the baseline, requests aborted, spanning versions, lost, tokens of a wrong version.
Verdicts against the targets: `in_place` goodput >= 90% and stall <= 2 decode steps + the
commit; `drain` goodput >= 75%. `--plot` draws tokens/s over time with the pushes marked.
Last, a prefix-cache row (`serving_prefix`): a GRPO group with a long prompt on this engine
against one started with `--no-enable-prefix-caching` (target: >= 2x).
"""

import argparse
import asyncio
import json
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import msgspec
import torch

from weightbus.apps.bench.dist import write_model
from weightbus.apps.bench.llama_weights import llama_shape, llama_weights
from weightbus.apps.bench.serving_load import LoadShape, RequestLog, run_load
from weightbus.apps.bench.serving_prefix import group_seconds
from weightbus.apps.bench.serving_pushes import as_dicts, print_pushes, push_figures
from weightbus.apps.bench.serving_report import RunFigures, figures
from weightbus.apps.bench.serving_trainer import READY, PushRecord, TrainerConfig
from weightbus.apps.bench.timing import write_json
from weightbus.apps.launch import start_engine, stop_engines
from weightbus.apps.tables import print_table
from weightbus.core.units import format_bytes, parse_bytes

MODES = ("drain", "in_place", "abort")
BASELINE = "no pushes"
TARGET_GOODPUT = {"in_place": 0.90, "drain": 0.75}
STALL_STEPS = 2  # in place: a stall of at most this many decode steps + the commit
TARGET_PREFIX_SPEEDUP = 2.0
_TRAINER_START_TIMEOUT_S = 120.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
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
        "--prefix-rounds", type=int, default=3, help="prefix-cache row: groups timed (0: none)"
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
        proc, url = start_engine(str(model_dir), args.tp, extra=["--dtype", "bfloat16"])
        procs = [proc]
        # every trainer starts (imports, loads its weights) now, side by side and outside the
        # measured windows; each waits for its run's `go`
        trainers = {mode: _start_trainer(mode, url, model_dir, args) for mode in args.modes}
        try:
            # untimed: the engine's first steps touch its KV cache and warm its kernels
            asyncio.run(run_load(url, shape, args.warmup_s))
            for trainer in trainers.values():
                _wait_ready(trainer)
            runs = [_run(BASELINE, url, shape, args, None)]
            runs += [_run(mode, url, shape, args, trainers[mode]) for mode in args.modes]
            prefix = _prefix_row(url, model_dir, args, procs) if args.prefix_rounds else None
        finally:
            for trainer in trainers.values():
                if trainer.poll() is None:
                    trainer.kill()
                    trainer.wait(timeout=30)
            stop_engines(procs)
    return _report(runs, args, prefix)


def _prefix_row(url: str, model_dir: Path, args: argparse.Namespace, procs: list) -> dict:
    """A GRPO group of `--group` with a `--prefix-prompt-tokens` prompt on this engine (prefix
    cache on) and on one started without it, rounds interleaved."""
    proc, off_url = start_engine(
        str(model_dir), args.tp, extra=["--dtype", "bfloat16", "--no-enable-prefix-caching"]
    )
    procs.append(proc)
    seconds = group_seconds(
        {"cache on": url, "cache off": off_url},
        group=args.group,
        prompt_tokens=args.prefix_prompt_tokens,
        max_tokens=args.prefix_max_tokens,
        vocab_size=llama_shape(args.size).vocab_size,
        rounds=args.prefix_rounds,
    )
    return {**seconds, "speedup": seconds["cache off"] / seconds["cache on"]}


def _run(
    mode: str,
    url: str,
    shape: LoadShape,
    args: argparse.Namespace,
    trainer: subprocess.Popen | None,
) -> dict:
    """One run: the load for `--duration-s`, with `trainer` (ready) pushing unless it is
    None. Returns its figures, pushes and request logs."""
    initial = httpx.get(f"{url}/v1/weights", timeout=30).json()["version"]
    if trainer is not None:
        _go(trainer)
    start_s = time.time()
    logs = asyncio.run(run_load(url, shape, args.duration_s))
    end_s = time.time()
    pushes = [] if trainer is None else _trainer_pushes(trainer, args)
    run_figures = figures(mode, logs, pushes, initial=initial, window_s=(start_s, end_s))
    return {
        "figures": run_figures,
        "pushes": pushes,
        "per_push": push_figures(logs, pushes, start_s),
        "logs": logs,
        "window": (start_s, end_s),
    }


def _start_trainer(
    mode: str, url: str, model_dir: Path, args: argparse.Namespace
) -> subprocess.Popen:
    config = TrainerConfig(
        url=url,
        model_dir=str(model_dir),
        transport=args.transport,
        pause_mode=mode,
        running_kv=args.running_kv,
        push_every_s=args.push_every_s,
        duration_s=args.duration_s,
        version_prefix=f"{mode}-{time.time_ns()}",
    )
    return subprocess.Popen(  # noqa: S603 - this interpreter and our own module
        [sys.executable, "-m", "weightbus.apps.bench.serving_trainer", json_of(config)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _wait_ready(trainer: subprocess.Popen) -> None:
    """Wait (bounded) for the trainer's `ready`."""
    assert trainer.stdout is not None
    if not select.select([trainer.stdout], [], [], _TRAINER_START_TIMEOUT_S)[0]:
        raise RuntimeError(f"the trainer process was not ready in {_TRAINER_START_TIMEOUT_S} s")
    line = trainer.stdout.readline().strip()
    if line != READY:
        raise RuntimeError(f"the trainer process failed to start (said {line!r})")


def _go(trainer: subprocess.Popen) -> None:
    """Start the ready trainer's push schedule."""
    assert trainer.stdin is not None
    trainer.stdin.write("go\n")
    trainer.stdin.flush()


def json_of(config: TrainerConfig) -> str:
    return msgspec.json.encode(config).decode()


def _trainer_pushes(trainer: subprocess.Popen, args: argparse.Namespace) -> list[PushRecord]:
    """The trainer's push records once it exited (bounded: its last push's timeout)."""
    try:
        out, _ = trainer.communicate(timeout=args.push_every_s + 180)
    except subprocess.TimeoutExpired:
        trainer.kill()
        raise RuntimeError("the trainer process did not exit after its last push") from None
    if trainer.returncode != 0:
        raise RuntimeError(f"the trainer process exited with code {trainer.returncode}")
    return [PushRecord(**json.loads(line)) for line in out.splitlines() if line.strip()]


def _verdict(f: RunFigures, baseline: RunFigures) -> str:
    goodput = f.tokens_per_s / baseline.tokens_per_s
    notes = []
    if f.mode in TARGET_GOODPUT:
        target = TARGET_GOODPUT[f.mode]
        notes.append(f"goodput {'met' if goodput >= target else 'NOT met'} (>= {target:.0%})")
    if f.mode == "in_place" and f.stalls_s:
        budget = STALL_STEPS * baseline.step_s + max(f.commit_s)
        met = statistics.median(f.stalls_s) <= budget
        within = sum(
            stall <= STALL_STEPS * baseline.step_s + commit
            for stall, commit in zip(f.stalls_s, f.commit_s, strict=True)
        )
        notes.append(
            f"stall {'met' if met else 'NOT met'} (median <= {budget * 1e3:.0f} ms; "
            f"{within}/{len(f.stalls_s)} pushes within their own)"
        )
    if f.mode == "abort" and f.pushes:
        notes.append(f"{f.aborted / f.pushes:.1f} aborted per push")
    return "; ".join(notes)


def _ms(values: list[float], pick) -> str:
    return f"{pick(values) * 1e3:.0f}" if values else "-"


def _report(runs: list[dict], args: argparse.Namespace, prefix: dict | None) -> int:
    all_figures = [r["figures"] for r in runs]
    baseline = all_figures[0]
    print(
        f"weightbus bench serving: {format_bytes(args.size)} bf16 model at TP {args.tp}, "
        f"{args.streams} streams in groups of {args.group} ({args.prompt_tokens} prompt + "
        f"{args.max_tokens} tokens), a push every {args.push_every_s:g} s over "
        f"{args.transport}, {args.duration_s:g} s per run; decode step (median token gap "
        f"without pushes) {baseline.step_s * 1e3:.0f} ms"
    )
    rows = [
        [
            f.mode,
            f.pushes,
            f"{f.tokens_per_s:.0f}",
            f"{f.tokens_per_s / baseline.tokens_per_s:.0%}",
            _ms(f.stalls_s, statistics.median),
            _ms(f.stalls_s, max),
            _ms(f.first_new_token_s, statistics.median),
            f.aborted,
            f.spanning,
            f.lost,
            f.wrong_version_tokens,
            _verdict(f, baseline) if f is not baseline else "",
        ]
        for f in all_figures
    ]
    headers = [
        "run", "pushes", "tokens/s", "goodput", "stall med ms", "stall max ms",
        "first new token ms", "aborted", "spanning", "lost", "wrong version", "verdict",
    ]  # fmt: skip
    print_table(headers, rows)
    if any(r["per_push"] for r in runs):
        print("per push (gap: the stall's two tokens; phases: the push result's):")
        per_push = {r["figures"].mode: r["per_push"] for r in runs}
        print_pushes(per_push, baseline.step_s, STALL_STEPS)
    if prefix is not None:
        met = "met" if prefix["speedup"] >= TARGET_PREFIX_SPEEDUP else "NOT met"
        print(
            f"prefix cache: a group of {args.group} with a {args.prefix_prompt_tokens}-token "
            f"prompt ({args.prefix_max_tokens} tokens each, median of {args.prefix_rounds}): "
            f"{prefix['cache on']:.3f} s with the cache, {prefix['cache off']:.3f} s without: "
            f"{prefix['speedup']:.1f}x ({met}: >= {TARGET_PREFIX_SPEEDUP:g}x)"
        )
    if args.json:
        args_json = {k: v for k, v in vars(args).items() if not callable(v)}
        write_json(
            args.json,
            {"args": args_json, "runs": [_as_json(r) for r in runs], "prefix_cache": prefix},
        )
    if args.plot:
        from weightbus.apps.bench.serving_plot import plot_serving

        plot_serving(runs, args.plot)
    # drain and abort end or finish every request before the swap: none may span versions
    failed = sum(
        f.lost + f.wrong_version_tokens + f.failed_pushes + f.spanning * (f.mode != "in_place")
        for f in all_figures
    )
    return 1 if failed else 0


def _as_json(run_: dict) -> dict:
    logs: list[RequestLog] = run_["logs"]
    return {
        "figures": run_["figures"].as_dict(),
        "window": run_["window"],
        "pushes": [p.__dict__ for p in run_["pushes"]],
        "per_push": as_dicts(run_["per_push"]),
        "requests": [log.__dict__ for log in logs],
    }
