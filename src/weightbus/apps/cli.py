"""The `weightbus` command line: each command module adds its parser and handler."""

import argparse
from collections.abc import Sequence

from weightbus import __version__
from weightbus.apps.progress import add_quiet_flag, set_quiet
from weightbus.core.log import setup_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightbus",
        description="Move RL policy weights from trainers into live inference engines.",
    )
    parser.add_argument("--version", action="version", version=f"weightbus {__version__}")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING or ERROR")
    add_quiet_flag(parser, command=False)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # Command modules are imported here, not at module top, so `weightbus --help` stays fast
    # and a command's heavy dependencies load only when it runs.
    from weightbus.apps import push as push_cli
    from weightbus.apps.bench import cli as bench_cli
    from weightbus.apps.capacity import cli as plan_cli
    from weightbus.apps.demo import cli as demo_cli
    from weightbus.apps.doctor import cli as doctor_cli
    from weightbus.engines.reference.server import cli as serve_cli

    demo_cli.add_parser(commands)
    bench_cli.add_parser(commands)
    serve_cli.add_parser(commands)
    push_cli.add_parser(commands)
    plan_cli.add_parser(commands)
    doctor_cli.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `weightbus` console script; returns the process exit code."""
    args = build_parser().parse_args(argv)
    setup_logging(level=args.log_level)
    set_quiet(args.quiet)
    return args.handler(args)
