"""`weightbus bench buckets`: packing flat buckets vs one memcpy of the same bytes.

The floor is a single `copy_` of the model's bytes into a preallocated buffer on all cores,
measured in the same run on the same machine; the target is packing at >= 0.8x its bandwidth.
"""

import argparse
import os

import torch

from weightbus.apps.bench.llama_weights import llama_weights
from weightbus.apps.bench.timing import Measurement, measure_interleaved, write_json
from weightbus.apps.tables import print_table
from weightbus.core.digest import fingerprint
from weightbus.core.meta import metas_of
from weightbus.core.plan import FlatBucket, plan_buckets
from weightbus.core.plan.bucket import layout_entries, pack_entries
from weightbus.core.units import byte_size_arg, format_bytes

TARGET_RATIO = 0.8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--size", type=byte_size_arg, default="1GiB", help="model bytes (default 1GiB)"
    )
    parser.add_argument(
        "--bucket-bytes",
        type=byte_size_arg,
        default="256MiB",
        help="bucket size of the planned path",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per row (median)")
    parser.add_argument("--json", default=None, help="also write the results to this file")


def _planned_packer(weights: list[tuple[str, torch.Tensor]], bucket_bytes: int):
    """Pack bucket after bucket into one reused buffer: the persistent-buffer path."""
    plan = plan_buckets(metas_of(weights), bucket_bytes)
    tensors = dict(weights)
    buffer = torch.empty(bucket_bytes, dtype=torch.uint8)

    def pack_all() -> None:
        for bucket in plan.buckets:
            pack_entries(buffer, bucket.entries, tensors)

    return pack_all, plan.num_buckets


def _measure_all(
    weights: list[tuple[str, torch.Tensor]], bucket_bytes: int, repeat: int
) -> tuple[list[Measurement], int]:
    model_bytes = sum(t.nbytes for _, t in weights)
    source = torch.empty(model_bytes, dtype=torch.uint8).fill_(1)
    floor_buffer = torch.empty(model_bytes, dtype=torch.uint8)
    _, bucket_nbytes = layout_entries(metas_of(weights))
    one_bucket = torch.empty(bucket_nbytes, dtype=torch.uint8)
    pack_planned, num_buckets = _planned_packer(weights, bucket_bytes)
    operations = [
        ("floor: memcpy into preallocated", lambda: floor_buffer.copy_(source)),
        ("pack into preallocated (1 bucket)", lambda: FlatBucket.pack(weights, one_bucket)),
        (f"pack planned ({num_buckets} x reused buffer)", pack_planned),
        ("pack into fresh allocation", lambda: FlatBucket.pack(weights)),
        (
            "torch.cat of byte views (fresh)",
            lambda: torch.cat([t.reshape(-1).view(torch.uint8) for _, t in weights]),
        ),
        ("xxh3-128 fingerprint", lambda: fingerprint(weights)),
    ]
    rows = measure_interleaved([(name, model_bytes, fn) for name, fn in operations], repeat)
    return rows, model_bytes


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(os.cpu_count() or 1)
    dtype = getattr(torch, args.dtype)
    weights = llama_weights(args.size, dtype)
    rows, model_bytes = _measure_all(weights, args.bucket_bytes, args.repeat)
    floor = rows[0]
    print(
        f"{len(weights)} Llama-shaped {args.dtype} tensors, {format_bytes(model_bytes)}, "
        f"{torch.get_num_threads()} threads, median of {args.repeat}"
    )
    print_table(
        ["operation", "median s", "GB/s", "x memcpy bw"],
        [
            [m.name, f"{m.median_s:.4f}", f"{m.gb_per_s:.2f}", f"{m.gb_per_s / floor.gb_per_s:.2f}"]
            for m in rows
        ],
    )
    ratio = rows[1].gb_per_s / floor.gb_per_s
    verdict = "meets" if ratio >= TARGET_RATIO else "MISSES"
    print(
        f"packing into a preallocated buffer: {ratio:.2f}x memcpy bandwidth "
        f"({verdict} target {TARGET_RATIO}x)"
    )
    if args.json:
        write_json(
            args.json,
            {"suite": "buckets", "model_bytes": model_bytes, "rows": rows, "pack_ratio": ratio},
        )
    return 0
