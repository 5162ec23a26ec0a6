"""`weightbus bench cluster`: a cluster on this machine (`weightbus.apps.cluster`: one network
namespace per host, each link rate-limited both ways), and the figures only links show, same
run: senders scaling with their links (`senders`), one push to R replicas (`replicas`), deltas on
a slow link (`deltas`), an MoE's experts each to its rank (`experts`), each beside `weightbus
plan`'s prediction (profile `cpu-cluster` at the link's measured payload rate). Exits 1 when a
push fails or an engine does not serve the pushed fingerprint; 2 when this process may not make
namespaces (one line says why)."""

import argparse
import logging
import sys
import tempfile
from pathlib import Path

from weightbus.apps.bench.cluster import deltas, experts, replicas, senders
from weightbus.apps.bench.cluster.common import Row, write_checkpoint, write_moe_checkpoint
from weightbus.apps.bench.cluster.report import plot, print_experts, print_rows, verdicts
from weightbus.apps.bench.timing import write_json
from weightbus.apps.cluster import start_cluster, unavailable
from weightbus.apps.cluster.hosts import bit_rate_arg
from weightbus.apps.cluster.linkrate import measure
from weightbus.apps.progress import StepsProgress
from weightbus.core.units import byte_size_arg, format_bytes

CASES = {"senders": senders, "replicas": replicas, "deltas": deltas, "experts": experts}
_PROBE_S = 1.0  # the link probe sends about this long at the link's rate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument(
        "--link",
        type=bit_rate_arg,
        default="200mbit",
        help="link rate, senders and replicas (e.g. 200mbit, 1gbit)",
    )
    parser.add_argument(
        "--delta-links",
        type=bit_rate_arg,
        nargs="+",
        default=[1_000_000_000, 200_000_000],
        help="link rates of the deltas case (each its own cluster)",
    )
    parser.add_argument(
        "--size",
        type=byte_size_arg,
        default="64MiB",
        help="model size (bf16), senders and replicas",
    )
    parser.add_argument("--trainer-hosts", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--engine-hosts",
        type=int,
        nargs="+",
        default=[2, 4],
        help="engine replicas (TP 1) of the senders case",
    )
    parser.add_argument(
        "--transports", nargs="+", default=["nixl", "dist"], choices=["nixl", "dist"]
    )
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--delta-model",
        default="bench",
        choices=["bench", "tiny"],
        help="the deltas case's trainer: a 53 M-parameter Llama (bench) or the demo's tiny one",
    )
    parser.add_argument("--delta-steps", type=int, default=3, help="RL steps per training run")
    parser.add_argument(
        "--moe-size",
        type=byte_size_arg,
        default="256MiB",
        help="the experts case's Qwen3-MoE, at least this (bf16; whole layers: 297 MiB)",
    )
    parser.add_argument(
        "--moe-experts", type=int, default=16, help="the experts case's routed experts per layer"
    )
    parser.add_argument(
        "--expert-paths",
        nargs="+",
        default=list(experts.PATHS),
        choices=list(experts.PATHS),
        help="the experts case's paths (`dist parts, TP`: into the engine at TP 2 without EP)",
    )
    parser.add_argument("--bucket-bytes", type=byte_size_arg, default="16MiB")
    parser.add_argument(
        "--repeat", type=int, default=2, help="timed pushes per row (median), after the warm-ups"
    )
    parser.add_argument(
        "--warmups",
        type=int,
        default=1,
        help="untimed pushes per row before the timed ones (senders, replicas)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="bound of one push, seconds")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--plot", default=None, help="also draw throughput against T and R (PNG)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 3 when a target is NOT met (without it, only a failed push fails the run)",
    )


def _case(name: str, rate: int, args, workdir: Path, source) -> tuple[list[Row], float]:
    module = CASES[name]
    with start_cluster(module.hosts_needed(args), rate) as made:
        probe_bytes = max(4 << 20, int(rate / 8 * _PROBE_S))
        link = measure(made, made.hosts[0], made.hosts[1], probe_bytes)
        print(
            f"{name}: {len(made.hosts)} hosts, links {rate / 1e6:.0f} Mbit/s, "
            f"measured payload {link / 1e6:.0f} Mbit/s",
            file=sys.stderr,
        )
        return module.run(made, source, link, args), link


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if reason := unavailable():
        print(f"weightbus bench cluster: {reason}")
        return 2
    results: dict[str, dict] = {}
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="wb-bench-cluster-", dir="/dev/shm") as tmp:
        runs = [(name, args.link) for name in args.cases if name != "deltas"]
        runs += [("deltas", rate) for rate in args.delta_links if "deltas" in args.cases]
        written: dict = {}
        with StepsProgress(len(runs), label="bench cluster") as progress:
            for name, rate in runs:
                progress.step(f"{name} at {rate / 1e6:.0f} Mbit/s")
                source = _source(name, Path(tmp), args, written)
                case_rows, link = _case(name, rate, args, Path(tmp), source)
                result = results.setdefault(name, {"link_bits_per_s": [], "rows": []})
                result["link_bits_per_s"].append(link)
                result["rows"] += [r.as_dict() for r in case_rows]
                rows += case_rows
                _print_case(name, link, case_rows)
    lines = verdicts(rows)
    print("\n" + "\n".join(lines))
    failures = [f"{r.case} {r.path}: {f}" for r in rows for f in r.failures]
    for failure in failures:
        print(f"FAILED: {failure}")
    if args.json:
        write_json(
            args.json,
            {"suite": "cluster", "args": _settings(args), "cases": results, "verdicts": lines},
        )
    if args.plot:
        plot(rows, args.plot)
    return exit_code(failures, lines, check=args.check)


def _print_case(name: str, link: float, case_rows: list[Row]) -> None:
    size = format_bytes(case_rows[0].model_bytes)
    print_rows(f"{name}: links {link / 1e6:.0f} Mbit/s payload, model {size}", case_rows)
    if name == "experts":
        print_experts(case_rows)


def exit_code(failures: list[str], verdict_lines: list[str], *, check: bool) -> int:
    """1: a push failed; 3: with `check`, a target is not met (each named); else 0."""
    if failures:
        return 1
    missed = [line for line in verdict_lines if line.endswith(": NOT met)")]
    for line in missed if check else ():
        print(f"TARGET NOT MET: {line}")
    return 3 if check and missed else 0


def _source(name: str, workdir: Path, args: argparse.Namespace, written: dict):
    """What case `name` pushes: the deltas case's trainer saves its own model in `workdir`, the
    experts case pushes a Qwen3-MoE, the others a Llama of `--size` (each written once, into
    `written`)."""
    if name == "deltas":
        return workdir
    kind = "moe" if name == "experts" else "model"
    if kind not in written:
        write = write_moe_checkpoint if kind == "moe" else write_checkpoint
        size = (args.moe_size, args.moe_experts) if kind == "moe" else (args.size,)
        written[kind] = write(workdir / kind, *size)
    return written[kind]


def _settings(args: argparse.Namespace) -> dict:
    """The run's flags (JSON-ready: the CLI's handler left out)."""
    return {k: v for k, v in vars(args).items() if isinstance(v, int | float | str | list)}
