"""`weightbus bench nixl`: `nixl` pushes into a real engine vs raw NIXL WRITEs, same run.

Per size, Llama-shaped bf16 weights go into one `weightbus serve --tp N` engine in two settings:
on one host (no UCX options: the transport's defaults; `dist` over loopback), then in its own
network namespace joined by a veth pair (root and `ip` only; UCX_TLS=tcp on both sides, `dist`
over the veth). Interleaved rounds (after a warm-up round) time: the floor (plain NIXL WRITEs of
each rank's share between the same processes into the same memory, `raw_write_seconds`);
`nixl` pushes in place (verify none: the transport alone) and atomic (the push defaults); `dist`
broadcast pushes (in place, verify none, as `weightbus bench dist`); on one host, a gloo
broadcast per tensor to N receivers (`BroadcastCase`, loopback only). Then one default push per
transport checks the engine's fingerprint. Exits 1 if a push fails or a fingerprint differs.
"""

import argparse
import contextlib
import logging
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from weightbus.apps import netns
from weightbus.apps.bench.baselines import BroadcastCase
from weightbus.apps.bench.dist import DistPusher, write_model
from weightbus.apps.bench.llama_weights import llama_weights
from weightbus.apps.bench.timing import Measurement, write_json
from weightbus.apps.launch import start_engine, stop_engine
from weightbus.apps.netns import ip
from weightbus.apps.progress import RoundsProgress
from weightbus.apps.tables import print_table
from weightbus.core.publisher import Publisher, PushError
from weightbus.core.units import byte_size_arg, format_bytes

TARGET_OF_FLOOR_BANDWIDTH = 0.85
FLOOR, PER_TENSOR = "floor: raw NIXL WRITEs", "gloo broadcast per tensor"
IN_PLACE, ATOMIC = "nixl push, in place, verify none", "nixl push, atomic, verify full"
DIST = "dist broadcast push, in place, verify none"
_IN_PLACE = {"atomic": False, "pause_mode": "in_place", "verify": "none"}
_ENGINE_ARGS = ("--dtype", "bfloat16")


def _sizes(text: str) -> list[int]:
    return [byte_size_arg(part) for part in text.split(",") if part]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sizes = {"type": _sizes, "nargs": "+", "default": [[256 << 20, 1 << 30]]}
    parser.add_argument("--size", **sizes, help="model sizes (256MiB 1GiB)")
    parser.add_argument("--tp", type=int, default=2, help="TP size of the engine")
    parser.add_argument("--bucket-bytes", type=byte_size_arg, default="64MiB")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds (median)")
    parser.add_argument("--json", default=None, help="also write the results to this file")


@dataclass(frozen=True)
class Namespace:
    """A network namespace joined to this one by a veth pair (`link` here, `engine_link`)."""

    name: str
    host: str
    engine_host: str
    link: str
    engine_link: str
    mtu: int = 1500  # veth's default, an Ethernet link without jumbo frames


@contextlib.contextmanager
def namespace() -> Iterator[Namespace]:
    """A new namespace and veth pair on 10.X.9.0/24 (a free X), always deleted on exit.

    Create it before this process first uses UCX: UCX caches the routes it sees then, and
    finds no route over a link created later."""
    netns.reap_stale()
    tag, subnet = os.getpid(), f"10.{netns.free_subnet()}.9"
    name = netns.namespace_name("bench")
    ns = Namespace(name, f"{subnet}.1", f"{subnet}.2", f"wbn{tag}a", f"wbn{tag}b")
    ip("netns", "add", ns.name)
    try:
        ip("link", "add", ns.link, "type", "veth", "peer", "name", ns.engine_link)
        ip("link", "set", ns.engine_link, "netns", ns.name)
        ip("addr", "add", f"{ns.host}/24", "dev", ns.link)
        ip("-n", ns.name, "addr", "add", f"{ns.engine_host}/24", "dev", ns.engine_link)
        ip("link", "set", ns.link, "mtu", str(ns.mtu), "up")
        ip("-n", ns.name, "link", "set", ns.engine_link, "mtu", str(ns.mtu), "up")
        ip("-n", ns.name, "link", "set", "lo", "up")
        yield ns
    finally:
        ip("link", "del", ns.link, check=False)  # gone with the namespace, if not before
        ip("netns", "del", ns.name, check=False)


def start_engine_in(ns: Namespace, model_dir: Path, tp: int, token: str):
    """`weightbus serve` inside `ns`, on its veth address; its UCX on tcp over that veth."""
    ucx = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": ns.engine_link}
    env = {**os.environ, "WEIGHTBUS_API_TOKEN": token, **ucx}
    extra = [*_ENGINE_ARGS, "--host", ns.engine_host]
    prefix = ["ip", "netns", "exec", ns.name]
    return start_engine(str(model_dir), tp, extra=extra, prefix=prefix, env=env)


@dataclass(frozen=True)
class Setting:
    """Where the engine runs and how the publisher reaches it."""

    label: str
    url: str
    host: str  # this process's address as the engine's ranks reach it (ZMQ, weights group)
    nixl_options: dict
    token: str | None = None


@contextlib.contextmanager
def _engine(model_dir: Path, tp: int, ns: Namespace | None) -> Iterator[Setting]:
    if ns is None:
        proc, url = start_engine(str(model_dir), tp, extra=_ENGINE_ARGS)
        setting = Setting("one host, default UCX settings", url, "127.0.0.1", {})
    else:
        token = secrets.token_hex(16)
        proc, url = start_engine_in(ns, model_dir, tp, token)
        label = f"two namespaces over veth (MTU {ns.mtu}), UCX_TLS=tcp both sides"
        options = {"ucx_tls": "tcp", "ucx_devices": ns.link}
        setting = Setting(label, url, ns.host, options, token)
    try:
        yield setting
    finally:
        stop_engine(proc)


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _rounds(operations: list[tuple[str, Callable[[], float]]], nbytes: int, repeat: int):
    """Every operation once per round (each returns its seconds), after a warm-up round."""
    samples: dict[str, list[float]] = {name: [] for name, _ in operations}
    with RoundsProgress(len(operations), repeat) as progress:
        for index in range(repeat + 1):
            for name, fn in operations:
                progress.row(index, name)
                seconds = fn()
                if index:
                    samples[name].append(seconds)
    return [Measurement(name, nbytes, samples[name]) for name, _ in operations]


def _check_fingerprints(weights: list, publishers: dict[str, Publisher]) -> list[str]:
    """One default push per transport: the fingerprint it and the engine report."""
    failures = []
    for name, publisher in publishers.items():
        expected = publisher.fingerprint(weights)
        result = publisher.push(weights, version=f"check-{name}-{time.monotonic_ns()}")
        served = {state.fingerprint for state in publisher.engine_weights()}
        if {result.fingerprint, *served} != {expected}:
            failures.append(f"{name}: fingerprints {sorted(served)}, expected {expected}")
    return failures


@dataclass
class Result:
    setting: str
    size: int
    rows: list[Measurement]
    bytes_per_rank: dict[str, int]  # row name -> bytes the most loaded rank received
    nixl_rank_bytes: dict[str, int]  # "engine.rank" -> bytes nixl wrote into it
    failures: list[str]


def _measure(setting: Setting, weights: list, args, baseline: BroadcastCase | None) -> Result:
    nbytes = sum(t.nbytes for _, t in weights)
    common = {"token": setting.token, "bucket_bytes": args.bucket_bytes, "timeout_s": 600}
    options = {"host": setting.host, **setting.nixl_options}
    with (
        Publisher([setting.url], transport="nixl", transport_options=options, **common) as nixl,
        Publisher([setting.url], transport="dist", **common) as dist,
    ):
        dist.init_weights_group(setting.host, timeout_s=120)
        broadcast = DistPusher(dist, "broadcast")

        def nixl_push(**push: object) -> float:
            version = f"nixl-{time.monotonic_ns()}"
            return _seconds(lambda: nixl.push(weights, version=version, **push))

        operations = [
            (IN_PLACE, lambda: nixl_push(**_IN_PLACE)),
            (FLOOR, nixl.sink.raw_write_seconds),  # overwrites the weights: the next push rewrites
            (ATOMIC, nixl_push),
            (DIST, lambda: _seconds(lambda: broadcast(weights))),
        ]
        if baseline is not None:
            operations.append((PER_TENSOR, lambda: _seconds(baseline.run)))
        rows = _rounds(operations, nbytes, args.repeat)
        shares = {f"{e}.{r}": n for (e, r), n in nixl.sink.rank_bytes.items()}
        failures = _check_fingerprints(weights, {"nixl": nixl, "dist": dist})
    share, dist_bytes = max(shares.values()), max(broadcast.rank_sent_bytes.values())
    per_rank = {FLOOR: share, IN_PLACE: share, ATOMIC: share, DIST: dist_bytes, PER_TENSOR: nbytes}
    return Result(setting.label, nbytes, rows, per_rank, shares, failures)


def _bench_size(size: int, args, workdir: Path, ns: Namespace | None) -> list[Result]:
    print(f"{format_bytes(size)}: weights, checkpoint, TP-{args.tp} engines", file=sys.stderr)
    weights = llama_weights(size, torch.bfloat16)
    model_dir = write_model(weights, size, workdir)
    baseline = BroadcastCase(weights, size, args.tp)
    try:
        with _engine(model_dir, args.tp, None) as setting:
            results = [_measure(setting, weights, args, baseline)]
    finally:
        baseline.close()
    if ns is not None:
        with _engine(model_dir, args.tp, ns) as setting:
            results.append(_measure(setting, weights, args, None))
    return results


def _cells(m: Measurement, floor: Measurement, share: int, size: int) -> list[str]:
    ratio = m.median_s / floor.median_s
    share_text = f"{format_bytes(share)} ({share / size:.2f})"
    return [m.name, f"{m.median_s:.3f}", f"{m.gb_per_s:.2f}", f"{ratio:.2f}", share_text]


def _print(result: Result, args: argparse.Namespace) -> None:
    by_name = {m.name: m for m in result.rows}
    floor, size = by_name[FLOOR], result.size
    print(
        f"\n{format_bytes(size)} Llama-shaped bf16 into 1 engine of TP {args.tp}, "
        f"{result.setting}, buckets {format_bytes(args.bucket_bytes)}, median of {args.repeat}"
    )
    headers = ["path", "median s", "model GB/s", "x floor time", "bytes per rank (x model)"]
    print_table(
        headers, [_cells(m, floor, result.bytes_per_rank[m.name], size) for m in result.rows]
    )
    for name in (IN_PLACE, ATOMIC):
        of_floor = floor.median_s / by_name[name].median_s
        verdict = "met" if of_floor >= TARGET_OF_FLOOR_BANDWIDTH else "NOT met"
        print(
            f"{name}: {of_floor:.2f}x the raw NIXL bandwidth (target >= "
            f"{TARGET_OF_FLOOR_BANDWIDTH}: {verdict}), "
            f"{by_name[DIST].median_s / by_name[name].median_s:.2f}x as fast as {DIST}"
        )
    shares = ", ".join(f"{key}: {format_bytes(n)}" for key, n in result.nixl_rank_bytes.items())
    print(f"nixl bytes per engine.rank: {shares}")


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    torch.set_num_threads(os.cpu_count() or 1)
    if reason := netns.unavailable():
        print(f"skipping the two-namespace setting: {reason}", file=sys.stderr)
    shm = Path("/dev/shm")  # noqa: S108 - the benchmark's checkpoint lives in RAM
    results: list[Result] = []
    failures: list[str] = []
    # the namespace exists before this process's first NIXL agent (see `namespace`)
    with contextlib.nullcontext() if reason else namespace() as ns:
        try:
            for size in [size for sizes in args.size for size in sizes]:
                where = shm if shm.is_dir() else None
                with tempfile.TemporaryDirectory(prefix="weightbus-bench-", dir=where) as tmp:
                    results += _bench_size(size, args, Path(tmp), ns)
        except PushError as exc:
            failures.append(f"a push failed: {exc}")
    for result in results:
        _print(result, args)
        failures += [f"{result.setting}: {failure}" for failure in result.failures]
    if args.json:
        write_json(args.json, {"suite": "nixl", "results": [vars(r) for r in results]})
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0
