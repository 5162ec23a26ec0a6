"""`weightbus doctor`: what this host can do, and the line that enables each missing piece.

Exit status 0: the report is a report, whatever is missing. With `--model-bytes`, 1 when the
default push of that size (atomic, `shm` direct into one engine on this host) does not fit in
/dev/shm's free bytes: a question was asked and the answer is no.
"""

import argparse
import json

from weightbus.core.units import byte_size_arg


def add_parser(commands: argparse._SubParsersAction) -> None:
    doctor = commands.add_parser(
        "doctor",
        help="what this host can do: torch, vLLM, NIXL, Ray, TRL, /dev/shm, transports",
        description="The torch build and its devices; vLLM (and its backend `weightbus`), NIXL "
        "and its UCX transports, Ray, TRL, peft; /dev/shm against --model-bytes; privileges "
        "for the cluster bench; the transports and engines that work here. Each missing piece "
        "comes with the line that installs or enables it (docs/doctor.md).",
    )
    doctor.add_argument(
        "--model-bytes",
        type=byte_size_arg,
        default=None,
        help="a model size (e.g. 16GiB): does a push of it fit in /dev/shm? (exit 1 if not)",
    )
    doctor.add_argument("--json", action="store_true", help="print JSON instead of text")
    doctor.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from weightbus.apps.doctor.report import diagnose
    from weightbus.apps.doctor.text import report_text

    report = diagnose(args.model_bytes)
    print(json.dumps(report, indent=2) if args.json else report_text(report))
    return 1 if report["shm"]["fits"] is False else 0
