"""`weightbus bench cluster`: a cluster on this machine (`weightbus.apps.cluster`: one network
namespace per host, each link rate-limited both ways), and the figures only links show, same
run: senders scaling with their links (`senders`), one push to R replicas (`replicas`), deltas on
a slow link (`deltas`), each beside `weightbus plan`'s prediction (profile `cpu-cluster` at the
link's measured payload rate). Exits 1 when a push fails or an engine does not serve the pushed
fingerprint; 2 when this process may not make namespaces (one line says why)."""

import argparse
import logging
import sys
import tempfile
from pathlib import Path

from weightbus.apps.bench.cluster import deltas, replicas, senders
from weightbus.apps.bench.cluster.common import Row, write_checkpoint
from weightbus.apps.bench.cluster.report import plot, print_rows, verdicts
from weightbus.apps.bench.timing import write_json
from weightbus.apps.cluster import start_cluster, unavailable
from weightbus.apps.cluster.hosts import bit_rate_arg
from weightbus.apps.cluster.linkrate import measure
from weightbus.core.units import byte_size_arg, format_bytes

CASES = {"senders": senders, "replicas": replicas, "deltas": deltas}
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


def _case(name: str, rate: int, args, workdir: Path, checkpoint) -> tuple[list[Row], float]:
    module = CASES[name]
    with start_cluster(module.hosts_needed(args), rate) as made:
        probe_bytes = max(4 << 20, int(rate / 8 * _PROBE_S))
        link = measure(made, made.hosts[0], made.hosts[1], probe_bytes)
        print(
            f"{name}: {len(made.hosts)} hosts, links {rate / 1e6:.0f} Mbit/s, "
            f"measured payload {link / 1e6:.0f} Mbit/s",
            file=sys.stderr,
        )
        source = workdir if name == "deltas" else checkpoint
        return module.run(made, source, link, args), link


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if reason := unavailable():
        print(f"weightbus bench cluster: {reason}")
        return 2
    results: dict[str, dict] = {}
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="wb-bench-cluster-", dir="/dev/shm") as tmp:
        checkpoint = write_checkpoint(Path(tmp) / "model", args.size)
        runs = [(name, args.link) for name in args.cases if name != "deltas"]
        runs += [("deltas", rate) for rate in args.delta_links if "deltas" in args.cases]
        for name, rate in runs:
            case_rows, link = _case(name, rate, args, Path(tmp), checkpoint)
            result = results.setdefault(name, {"link_bits_per_s": [], "rows": []})
            result["link_bits_per_s"].append(link)
            result["rows"] += [r.as_dict() for r in case_rows]
            rows += case_rows
            size = format_bytes(case_rows[0].model_bytes)
            print_rows(f"{name}: links {link / 1e6:.0f} Mbit/s payload, model {size}", case_rows)
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
    return 1 if failures else 0


def _settings(args: argparse.Namespace) -> dict:
    """The run's flags (JSON-ready: the CLI's handler left out)."""
    return {k: v for k, v in vars(args).items() if isinstance(v, int | float | str | list)}
