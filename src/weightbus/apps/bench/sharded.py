"""`weightbus bench sharded`: a sharded trainer's push against today's path, same run.

An FSDP2-sharded Llama (bf16, `--size`) on N = 1, 2 trainer processes (gloo CPU mesh) pushes
into one TP-2 reference engine over `shm` (straight into the engine's parameters, and through
the slots), over `nixl` (one-sided WRITEs) and over `dist` (every trainer rank a member of the
weights group), each way as a `Publisher` on the trainer's group (every rank sends the bytes it
holds) and as users do it without one (every parameter `full_tensor()`ed, then one
`Publisher` push from rank 0, as vLLM's `ModuleSource` does). Reports per row: the median push
seconds (the gather included), the bytes each trainer rank sent, each rank's shard and the peak
private memory the push took on a rank (sampled `RssAnon`: the gather materialises the whole
model on every rank).
"""

import argparse
import json
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from weightbus.apps.bench.llama_weights import hf_config, llama_shape, llama_weights
from weightbus.apps.bench.timing import write_json
from weightbus.apps.launch import run_rank_processes, start_engine, stop_engine
from weightbus.apps.progress import StepsProgress
from weightbus.apps.tables import print_table
from weightbus.core.units import byte_size_arg, format_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=byte_size_arg, default="1GiB", help="model size (bf16)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="trainer ranks")
    parser.add_argument(
        "--transports",
        nargs="+",
        default=["shm", "nixl", "dist"],
        choices=["shm", "nixl", "dist"],
        help="shm: straight into the parameters and through the slots; nixl: one-sided WRITEs; "
        "dist: the weights group (gloo)",
    )
    parser.add_argument("--bucket-bytes", type=byte_size_arg, default="256MiB")
    parser.add_argument("--repeat", type=int, default=3, help="timed pushes per row (median)")
    parser.add_argument("--json", default=None, help="also write the results to this file")


def _checkpoint(directory: Path, size: int) -> int:
    weights = dict(llama_weights(size))
    save_file(weights, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(hf_config(llama_shape(size))))
    return sum(tensor.nbytes for tensor in weights.values())


def _run_ranks(world_size: int, args: dict, out: Path) -> list[dict]:
    out.mkdir()
    argument = json.dumps({**args, "out": str(out)})
    codes = run_rank_processes("weightbus.apps.bench.sharded_worker", argument, world_size, 3600)
    if any(codes):
        raise RuntimeError(f"trainer ranks exited with {codes}")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="wb-bench-sharded-", dir="/dev/shm") as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        nbytes = _checkpoint(model_dir, args.size)
        engine, url = start_engine(str(model_dir), 2, extra=("--dtype", "bfloat16"))
        try:
            worker_args = {
                "model_dir": str(model_dir),
                "url": url,
                "repeat": args.repeat,
                "bucket_bytes": args.bucket_bytes,
                "transports": args.transports,
            }
            results = {}
            with StepsProgress(len(args.ranks), label="bench sharded") as progress:
                for n in args.ranks:
                    progress.step(f"{n} trainer rank(s)")
                    results[n] = _run_ranks(n, worker_args, Path(tmp) / f"ranks{n}")
        finally:
            stop_engine(engine)
    rows = []
    for world_size, ranks in results.items():
        for name, row in ranks[0]["rows"].items():
            per_rank = [rank["rows"][name] for rank in ranks]
            rows.append(
                [
                    world_size,
                    name,
                    f"{row['seconds']:.3f}",
                    f"{nbytes / row['seconds'] / 1e9:.2f}",
                    " / ".join(format_bytes(r["sent_bytes"]) for r in per_rank),
                    " / ".join(format_bytes(rank["shard_bytes"]) for rank in ranks),
                    format_bytes(max(r["peak_bytes"] for r in per_rank)),
                ]
            )
    print(f"model {format_bytes(nbytes)} bf16 into one TP-2 engine (atomic, verify full)")
    headers = ["ranks", "path", "push s", "GB/s", "sent per rank", "shard per rank", "peak extra"]
    print_table(headers, rows)
    if args.json:
        write_json(args.json, {"model_bytes": nbytes, "results": results})
    return 0
