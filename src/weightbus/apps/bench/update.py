"""`weightbus bench update`: push Llama-shaped weights into real engines, every path in one run.

For each size: write a Hugging Face checkpoint of Llama-shaped bf16 weights, start
`weightbus serve --model DIR --tp N --dtype bfloat16` engine(s), then time on the same weights:
the floor (one memcpy of the model's bytes into a preallocated buffer, all cores) and a push
over each transport with verification on and off, loaded in place. Where the NaN/inf check
runs is a column: in place, it is the Publisher's pre-pass over every byte (timed alone too).
An `shm` first transport is also pushed atomically (staged, then swapped), where the check runs
in the copy pass: verify none and full, and verify none without the check
(`allow_nonfinite=True`). Reports median push seconds, GB/s, the ratio to the floor, the
lower bound of each `shm` path and the ratio to it (`roofline`: its passes over the bytes at
the rates measured in the same run, shown as the `pass:` rows), the speed-up of `shm` over
`disk` (in place), and the engines' extra peak RSS.
"""

import argparse
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from weightbus.apps.bench.llama_weights import hf_config, llama_shape, llama_weights
from weightbus.apps.bench.memory import child_pids, reset_peak, rss_bytes
from weightbus.apps.bench.roofline import (
    CHECK_IN_CACHE,
    HASH_IN_CACHE,
    VERIFY_FROM_MEMORY,
    PathPasses,
    Rates,
    rate_operations,
)
from weightbus.apps.bench.timing import Measurement, measure_interleaved, write_json
from weightbus.apps.launch import start_engine, stop_engine
from weightbus.apps.tables import print_table
from weightbus.core.finite import refuse_nonfinite
from weightbus.core.publisher import Publisher
from weightbus.core.units import byte_size_arg, format_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="1GiB", help="comma-separated model sizes")
    parser.add_argument("--tp", type=int, default=2, help="TP size of each engine")
    parser.add_argument("--engines", type=int, nargs="+", default=[1], help="engine counts")
    parser.add_argument(
        "--transports",
        nargs="+",
        default=["shm", "shm-slots", "disk"],
        choices=sorted(_PATHS),
        help="shm writes straight into parameters when the engines allow it; shm-slots forces "
        "the slot path",
    )
    parser.add_argument("--bucket-bytes", type=byte_size_arg, default="256MiB")
    parser.add_argument("--repeat", type=int, default=3, help="timed pushes per row (median)")
    parser.add_argument("--json", default=None, help="also write the results to this file")


# the Publisher's pre-pass over every byte, timed alone
_CHECK_ALONE = "non-finite check alone"

# --transports names: a transport, or shm forced into one of its modes
_PATHS = {
    "shm": ("shm", {}),  # direct when every rank offers its parameters
    "shm-slots": ("shm", {"direct": False}),
    "disk": ("disk", {}),
}


class _Pusher:
    """Pushes one configuration repeatedly, each push a new version.

    Args:
        atomic: stage, then swap (the Publisher's default); else load in place.
        checked: the Publisher's NaN/inf check is on (False: `allow_nonfinite=True`).
    """

    def __init__(
        self,
        urls: list[str],
        path: str,
        verify: str,
        bucket_bytes: int,
        *,
        atomic: bool = False,
        checked: bool = True,
    ) -> None:
        transport, options = _PATHS[path]
        self.publisher = Publisher(
            urls,
            transport=transport,
            bucket_bytes=bucket_bytes,
            timeout_s=600,
            transport_options=options,
        )
        self.verify = verify
        self.atomic = atomic
        self.checked = checked
        self.count = 0
        self.mode = transport

    def __call__(self, weights: list) -> None:
        self.count += 1
        version = f"{self.publisher.transport}-{self.verify}-{self.count}-{time.monotonic_ns()}"
        result = self.publisher.push(
            weights,
            version=version,
            atomic=self.atomic,
            pause_mode="in_place",
            verify=self.verify,
            allow_nonfinite=not self.checked,
        )
        self.mode = result.mode

    @property
    def name(self) -> str:
        loads = " atomic" if self.atomic else ""
        return f"{self.mode}{loads} verify={self.verify}" + ("" if self.checked else " unchecked")

    @property
    def passes(self) -> PathPasses | None:
        """The passes over the bytes this path makes (None: `disk`, not modelled)."""
        if not self.mode.startswith("shm"):
            return None
        direct = "direct" in self.mode
        full = self.verify == "full"
        return PathPasses(
            copies=1 if direct else 2,
            hashes=2 if direct and full else 1,
            check=self.nan_check,
            verify=full,
        )

    @property
    def nan_check(self) -> str:
        """Where the push's NaN/inf check runs: an atomic whole `shm` push checks in its copy
        pass (`stream_refuses_nonfinite`), every other push before sending."""
        if not self.checked:
            return "off"
        return "in copy" if self.atomic and self.mode.startswith("shm") else "pre-pass"


def _pushers(urls: list[str], args: argparse.Namespace) -> list[_Pusher]:
    """In place: each transport, verify full and none. Atomic, for an `shm` first transport:
    verify full and none with the check in the copy, and verify none unchecked."""
    pushers = [
        _Pusher(urls, path, verify, args.bucket_bytes)
        for path in args.transports
        for verify in ("full", "none")
    ]
    first = args.transports[0]
    if _PATHS[first][0] == "shm":
        pushers += [
            _Pusher(urls, first, verify, args.bucket_bytes, atomic=True, checked=checked)
            for verify, checked in (("full", True), ("none", True), ("none", False))
        ]
    return pushers


def _reset_peak_rss(pids: list[int]) -> dict[int, int]:
    """Reset the ranks' peak RSS (VmHWM) and return their current RSS."""
    for pid in pids:
        reset_peak(pid)
    return {pid: rss_bytes(pid, "VmRSS") for pid in pids}


def _extra_peak_rss(pids: list[int], pusher: _Pusher, weights: list) -> int:
    """The most a rank's RSS rose above its resting RSS during one more (untimed) push."""
    before = _reset_peak_rss(pids)
    pusher(weights)
    return max(rss_bytes(pid, "VmHWM") - before[pid] for pid in pids)


def _bench_size(size: int, num_engines: int, args: argparse.Namespace, workdir: Path) -> dict:
    weights = llama_weights(size, torch.bfloat16)
    model_bytes = sum(t.nbytes for _, t in weights)
    model_dir = workdir / f"model-{size}-{num_engines}-engines"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(hf_config(llama_shape(size, 2))))
    save_file(dict(weights), str(model_dir / "model.safetensors"))
    engines = []
    try:
        # extend appends one by one: engines started before a failure are still stopped
        engines.extend(
            start_engine(str(model_dir), args.tp, extra=["--dtype", "bfloat16"])
            for _ in range(num_engines)
        )
        (model_dir / "model.safetensors").unlink()  # loaded: free its RAM for the big sizes
        pids = [pid for proc, _ in engines for pid in child_pids(proc.pid)]
        source = torch.empty(model_bytes, dtype=torch.uint8).fill_(1)
        floor_buffer = torch.empty(model_bytes, dtype=torch.uint8)
        urls = [url for _, url in engines]
        pushers = _pushers(urls, args)
        # The first push of each path makes its slots and mappings: the rank memory it adds
        # is measured there (shared pages count in every rank that touches them). The first
        # atomic push also allocates the engines' staging copy.
        peak_extra = {}
        for p in pushers:
            extra = _extra_peak_rss(pids, p, weights)
            peak_extra[p.name] = extra
        operations = [
            ("floor: memcpy into preallocated", model_bytes, lambda: floor_buffer.copy_(source)),
            (_CHECK_ALONE, model_bytes, lambda: refuse_nonfinite(weights)),
        ]
        operations += [(p.name, model_bytes, lambda p=p: p(weights)) for p in pushers]
        operations += rate_operations(weights)
        rows = measure_interleaved(operations, args.repeat)
        nan_check = {p.name: p.nan_check for p in pushers}
        passes = {p.name: p.passes for p in pushers}
        for pusher in pushers:
            pusher.publisher.close()
    finally:
        for proc, _ in engines:
            stop_engine(proc)
    return {
        "size": model_bytes,
        "engines": num_engines,
        "rows": rows,
        "peak_extra_rss": peak_extra,
        "nan_check": nan_check,
        "bounds": _bounds(rows, passes, model_bytes),
    }


def _bounds(rows: list[Measurement], passes: dict, model_bytes: int) -> dict[str, float]:
    """Each modelled path's lower bound in seconds (`roofline`), from the rates of this run."""
    by_name = {m.name: m for m in rows}
    rates = Rates(
        copy_all_cores=model_bytes / rows[0].median_s,
        hash_one_core=by_name[HASH_IN_CACHE].gb_per_s * 1e9,
        check_one_core=by_name[CHECK_IN_CACHE].gb_per_s * 1e9,
        prepass_all=by_name[_CHECK_ALONE].gb_per_s * 1e9,
        verify_one_core=by_name[VERIFY_FROM_MEMORY].gb_per_s * 1e9,
        cores=torch.get_num_threads(),
    )
    return {
        name: rates.bound_s(model_bytes, path) for name, path in passes.items() if path is not None
    }


def _print(result: dict, args: argparse.Namespace) -> None:
    rows: list[Measurement] = result["rows"]
    floor = rows[0]
    # in-place disk rows, by their verify level: the baseline of the other in-place rows
    disk = {m.name.rsplit(" ", 1)[-1]: m for m in rows if m.name.startswith("disk")}
    print(
        f"\n{format_bytes(result['size'])} Llama-shaped bf16, {result['engines']} engine(s) of "
        f"TP {args.tp}, median of {args.repeat}, in-place loads unless atomic"
    )
    table = []
    for m in rows:
        baseline = None if " atomic " in m.name else disk.get(m.name.rsplit(" ", 1)[-1])
        vs_disk = f"{baseline.median_s / m.median_s:.1f}x" if baseline and baseline is not m else ""
        rss = result["peak_extra_rss"].get(m.name)
        bound = result["bounds"].get(m.name)
        table.append(
            [
                m.name,
                result["nan_check"].get(m.name, "alone" if m.name == _CHECK_ALONE else ""),
                f"{m.median_s:.3f}",
                f"{m.gb_per_s:.2f}",
                f"{m.median_s / floor.median_s:.2f}",
                "" if bound is None else f"{bound:.3f}",
                "" if bound is None else f"{m.median_s / bound:.2f}",
                vs_disk,
                "" if rss is None else format_bytes(rss),
            ]
        )
    headers = [
        "path",
        "NaN check",
        "median s",
        "GB/s",
        "x floor",
        "bound s",
        "x bound",
        "vs disk",
        "rank extra peak RSS",
    ]
    print_table(headers, table)


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    torch.set_num_threads(os.cpu_count() or 1)
    results = []
    shm = Path("/dev/shm")  # noqa: S108 - the benchmark's checkpoints live in RAM
    with tempfile.TemporaryDirectory(
        prefix="weightbus-bench-", dir=shm if shm.is_dir() else None
    ) as tmp:
        for size_text in args.sizes.split(","):
            for num_engines in args.engines:
                size = byte_size_arg(size_text)
                result = _bench_size(size, num_engines, args, Path(tmp))
                results.append(result)
                _print(result, args)
    if args.json:
        write_json(args.json, {"suite": "update", "results": results})
    return 0
