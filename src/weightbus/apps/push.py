"""`weightbus push`: push a Hugging Face checkpoint directory, or a peft adapter directory,
into running engines."""

import argparse
import json
import os
import sys
from pathlib import Path

from weightbus.apps.progress import PUSH_PROGRESS_MIN_BYTES, add_quiet_flag, bars_on
from weightbus.core.units import byte_size_arg


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("push", help="push a Hugging Face directory into engines")
    parser.add_argument(
        "--engine", action="append", required=True, help="engine URL (repeat for several)"
    )
    parser.add_argument(
        "--from",
        dest="model_dir",
        required=True,
        help="HF checkpoint directory, or a peft adapter directory (adapter_config.json: the "
        "adapter alone is pushed, onto --base-fingerprint)",
    )
    parser.add_argument(
        "--base-fingerprint",
        default=None,
        help="with an adapter directory: the fingerprint of the base model it was trained on "
        "(engines serving another base refuse it)",
    )
    parser.add_argument("--version", required=True, help="name of the new version")
    parser.add_argument("--step", type=int, default=None, help="optional increasing step")
    parser.add_argument("--transport", default="disk")
    parser.add_argument("--pause-mode", default="drain", choices=["drain", "in_place", "abort"])
    parser.add_argument("--no-atomic", dest="atomic", action="store_false")
    parser.add_argument("--verify", default="full", choices=["full", "none"])
    parser.add_argument("--force", action="store_true", help="re-push the current version")
    parser.add_argument("--dtype", default=None, help="convert tensors to this dtype first")
    parser.add_argument("--bucket-bytes", type=byte_size_arg, default="256MiB")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument(
        "--token", default=os.environ.get("WEIGHTBUS_API_TOKEN"), help="engines' admin token"
    )
    parser.add_argument(
        "--progress-min-bytes",
        type=byte_size_arg,
        default=PUSH_PROGRESS_MIN_BYTES,
        help="draw a progress bar on stderr for pushes of at least this size (on a terminal, "
        "without --quiet; default 1GiB)",
    )
    add_quiet_flag(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from weightbus.core.meta import dtype_from_name
    from weightbus.core.publisher import Publisher, PushError

    try:
        weights = _read(args.model_dir, args.progress_min_bytes)
        adapter = _adapter_config(Path(args.model_dir), args.base_fingerprint)
        if args.dtype is not None:
            dtype: torch.dtype = dtype_from_name(args.dtype)
            weights = [(name, tensor.to(dtype)) for name, tensor in weights]
        nbytes = sum(tensor.nbytes for _, tensor in weights)
        with Publisher(
            args.engine,
            transport=args.transport,
            bucket_bytes=args.bucket_bytes,
            token=args.token,
            timeout_s=args.timeout_s,
            progress=bars_on() and nbytes >= args.progress_min_bytes,
        ) as publisher:
            result = publisher.push(
                weights,
                version=args.version,
                step=args.step,
                pause_mode=args.pause_mode,
                atomic=args.atomic,
                verify=args.verify,
                force=args.force,
                **adapter,
            )
    except (PushError, ValueError, OSError) as exc:
        print(f"weightbus push: error: {exc}", file=sys.stderr)
        return 1
    summary = {
        "version": result.version,
        "fingerprint": result.fingerprint,
        "bytes": result.nbytes,
        "seconds": round(result.seconds, 4),
        "engines": [engine.url for engine in result.engines],
    }
    print(json.dumps(summary))
    return 0


def _read(model_dir: str, progress_min_bytes: int) -> list:
    """Every tensor of the checkpoint in `model_dir`, with a bar of the bytes read when its
    tensors hold at least `progress_min_bytes` and bars are on."""
    from tqdm import tqdm

    from weightbus.core.checkpoint import iter_safetensors, safetensors_files, safetensors_metas

    if not bars_on():
        return list(iter_safetensors(model_dir))
    metas = safetensors_metas(safetensors_files(model_dir))  # headers only
    total_bytes = sum(meta.nbytes for meta, _ in metas.values())
    if total_bytes < progress_min_bytes:
        return list(iter_safetensors(model_dir))
    weights = []
    with tqdm(
        total=total_bytes, unit="B", unit_scale=True, desc=f"read {model_dir}", file=sys.stderr
    ) as bar:
        for name, tensor in iter_safetensors(model_dir):
            weights.append((name, tensor))
            bar.update(tensor.nbytes)
    return weights


def _adapter_config(model_dir: Path, base_fingerprint: str | None) -> dict:
    """The push's adapter options when `model_dir` is a peft adapter directory (else none).

    Raises:
        ValueError: an adapter directory without --base-fingerprint, or the flag without one.
    """
    config_path = model_dir / "adapter_config.json"
    if not config_path.is_file():
        if base_fingerprint is not None:
            raise ValueError(
                f"--base-fingerprint needs a peft adapter directory: {config_path} is missing"
            )
        return {}
    if base_fingerprint is None:
        raise ValueError(
            f"{model_dir} is a peft adapter: give --base-fingerprint, the fingerprint of the base "
            "model it was trained on"
        )
    config = json.loads(config_path.read_text())
    return {"adapter": config, "base_fingerprint": base_fingerprint}
