"""`weightbus plan`: bytes per rank and the predicted time of a push, before buying a cluster."""

import argparse
import json

from weightbus.core.units import byte_size_arg

_EXAMPLE = (
    "example: weightbus plan --model kimi-k2 --engine-tp 16 --replicas 8 "
    "--trainer-ranks 256 --transport nixl --hardware h100"
)


def add_parser(commands: argparse._SubParsersAction) -> None:
    from weightbus.apps.capacity.profiles import PROFILES
    from weightbus.apps.capacity.traffic import TRANSPORTS

    plan = commands.add_parser(
        "plan",
        help="predict a push's bytes per rank and time for a model on a cluster",
        description="From a Hugging Face config alone (no weights): the tensors a push "
        "carries, bytes each engine rank receives and each trainer rank sends, staging memory, "
        "buckets and a predicted time (docs/scale.md).",
        epilog=_EXAMPLE,
    )
    plan.add_argument("--model", help="config.json, a directory holding one, or a preset")
    plan.add_argument("--dtype", default=None, help="bfloat16, float16, float32 or fp8-block")
    plan.add_argument("--engine-tp", type=int, default=1, help="TP ranks per engine replica")
    plan.add_argument("--engine-ep", type=int, default=1, help="expert-parallel groups per replica")
    plan.add_argument(
        "--expert-placement",
        default="linear",
        choices=("linear", "round_robin"),
        help="how experts are spread over the expert-parallel groups (as `weightbus serve`)",
    )
    plan.add_argument(
        "--redundant-experts",
        type=int,
        default=0,
        help="extra expert slots holding second copies of experts (vLLM's EPLB; needs ep >= 2)",
    )
    plan.add_argument("--replicas", type=int, default=1, help="engine replicas")
    plan.add_argument("--trainer-ranks", type=int, default=1, help="ranks sending in parallel")
    plan.add_argument(
        "--trainer-layout",
        default="owners",
        choices=("owners", "fsdp", "ep"),
        help="owners: each trainer rank holds whole tensors (replicas, pipeline stages); fsdp: "
        "every tensor's rows over the ranks (FSDP2, a Publisher on every rank; docs/sharded.md); "
        "ep: the experts over the ranks, the rest as fsdp (docs/moe.md)",
    )
    plan.add_argument("--transport", default="nixl", choices=TRANSPORTS)
    plan.add_argument("--hardware", default="h100", choices=sorted(PROFILES))
    plan.add_argument(
        "--link",
        action="append",
        default=[],
        metavar="NAME=GB/s",
        help="replace a bandwidth: nic, local, broadcast, stage, copy, hash",
    )
    plan.add_argument(
        "--cost",
        action="append",
        default=[],
        metavar="NAME=SECONDS",
        help="replace a fixed cost: tensor, bucket, push",
    )
    plan.add_argument(
        "--engine-ranks-per-nic",
        type=int,
        default=1,
        help="engine ranks of a replica sharing one NIC (a host of 2 ranks and one link: 2)",
    )
    plan.add_argument(
        "--delta-bytes",
        type=byte_size_arg,
        default=None,
        help="a delta push: the bytes its encoding carries (e.g. measured by a first push)",
    )
    plan.add_argument("--bucket-bytes", type=byte_size_arg, default="256MiB")
    plan.add_argument("--same-node", action="store_true", help="no byte crosses a node")
    plan.add_argument(
        "--staged-from-host",
        action="store_true",
        help="trainer bytes wait in host memory (copied to the device first)",
    )
    plan.add_argument(
        "--verify",
        default="full",
        choices=("full", "none"),
        help="engines re-check digests (full, the default) or not (none)",
    )
    plan.add_argument(
        "--serial-staging",
        action="store_true",
        help="staging is not overlapped with the wire (checkpoint-engine's rounds)",
    )
    plan.add_argument(
        "--published",
        action="store_true",
        help="the published cases: predicted against published (docs/scale.md)",
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.set_defaults(handler=run)


def _pairs(items: list[str], what: str) -> dict[str, float]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            pairs[key] = float(value)
        except ValueError:
            raise SystemExit(f"weightbus plan: --{what} {item!r}: expected NAME=NUMBER") from None
        if not sep:
            raise SystemExit(f"weightbus plan: --{what} {item!r}: expected NAME=NUMBER")
    return pairs


def run(args: argparse.Namespace) -> int:
    from weightbus.apps.capacity.forecast import Scenario, forecast
    from weightbus.apps.capacity.profiles import hardware
    from weightbus.apps.capacity.published import print_published
    from weightbus.apps.capacity.report import print_forecast
    from weightbus.apps.capacity.sharding import EngineLayout

    if args.published:
        return print_published(as_json=args.json)
    if not args.model:
        raise SystemExit("weightbus plan: --model is required (or --published)")
    try:
        scenario = Scenario(
            engine=EngineLayout(
                args.engine_tp, args.engine_ep, args.expert_placement, args.redundant_experts
            ),
            transport=args.transport,
            hardware=hardware(args.hardware, _pairs(args.link, "link"), _pairs(args.cost, "cost")),
            replicas=args.replicas,
            trainer_ranks=args.trainer_ranks,
            trainer_layout=args.trainer_layout,
            bucket_bytes=args.bucket_bytes,
            cross_node=False if args.same_node else None,
            staged_from_host=args.staged_from_host,
            stage_overlaps=not args.serial_staging,
            verify=args.verify == "full",
            engine_ranks_per_nic=args.engine_ranks_per_nic,
            delta_bytes=args.delta_bytes,
        )
        result = forecast(args.model, scenario, args.dtype)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"weightbus plan: {exc}") from None
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print_forecast(result)
    return 0
