"""The output of `weightbus bench serving`: the table with its verdicts, the per-push table,
the prefix-cache row, the JSON and the plot; the exit code."""

import argparse
import statistics

from weightbus.apps.bench.serving_load import RequestLog
from weightbus.apps.bench.serving_pushes import as_dicts, print_pushes
from weightbus.apps.bench.serving_report import RunFigures
from weightbus.apps.bench.timing import write_json
from weightbus.apps.tables import print_table
from weightbus.core.units import format_bytes

TARGET_GOODPUT = {"in_place": 0.90, "drain": 0.75}
STALL_STEPS = 2  # in place: a stall of at most this many decode steps + the commit
TARGET_PREFIX_SPEEDUP = 2.0


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


def report(runs: list[dict], args: argparse.Namespace, prefix: dict | None) -> int:
    """Print the tables, write `--json` and `--plot`; return the exit code: 1 when a request
    was lost, a token had a wrong version, a push failed or drain/abort spanned versions."""
    all_figures = [r["figures"] for r in runs]
    baseline = all_figures[0]
    print(
        f"weightbus bench serving: {args.engine} engine, {format_bytes(args.size)} bf16 model "
        f"at TP {args.tp}, "
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
