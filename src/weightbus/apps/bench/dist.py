"""`weightbus bench dist`: `dist` pushes into a real engine vs raw gloo broadcasts, same run.

Starts one `weightbus serve --tp N` engine on Llama-shaped bf16 weights and N plain peer
processes (`python -m weightbus.apps.bench.dist PEER_JSON`) standing in for its ranks in a
second gloo
group of the same size. Then times, interleaved on the same bytes:

- the baseline: one raw gloo broadcast of the model's bytes as a single tensor;
- the naive path: one broadcast per tensor;
- `dist` pushes in `broadcast` and `parts` mode (verify none: the transport alone).

Reports median seconds, GB/s per receiving rank (bytes a rank received / s), the ratio to the
baseline's bandwidth, and the bytes each rank received (parts: its TP slices only).
"""

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch
from safetensors.torch import save_file

from weightbus.apps.bench.llama_weights import hf_config, llama_shape, llama_weights
from weightbus.apps.bench.timing import Measurement, measure_interleaved, write_json
from weightbus.apps.launch import start_engine, stop_engine
from weightbus.apps.tables import print_table
from weightbus.core.publisher import Publisher
from weightbus.core.store import serve_store
from weightbus.core.transport.distributed.group import WeightsGroup, destroy_group, join_group, wait
from weightbus.core.units import byte_size_arg, format_bytes
from weightbus.core.wire.messages import RankLayout

_GROUP_TIMEOUT_S = 120.0
_BASELINE_GROUP = "bench-baseline"
# Commands the publisher broadcasts to the peers: [command, argument].
_STOP, _SINGLE, _PER_TENSOR, _RECEIVE = 0, 1, 2, 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=byte_size_arg, default="512MiB", help="model size")
    parser.add_argument("--tp", type=int, default=2, help="TP size of the engine")
    parser.add_argument("--bucket-bytes", type=byte_size_arg, default="64MiB")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per row (median)")
    parser.add_argument("--json", default=None, help="also write the results to this file")


class PeerConfig(msgspec.Struct, frozen=True):
    """A baseline peer: group rank, world size and the publisher's store."""

    group_rank: int
    world_size: int
    port: int
    tensor_numels: list[int]


def _broadcast_command(group: WeightsGroup, command: int, argument: int = 0) -> None:
    header = torch.tensor([command, argument], dtype=torch.int64)
    wait(group, group.pg.broadcast(header, 0), time.monotonic() + _GROUP_TIMEOUT_S, "command")


def peer_main(config: PeerConfig) -> None:
    """A baseline receiver: joins the baseline group and follows the publisher's commands."""
    layout = RankLayout(group_rank=config.group_rank, tp_rank=0, tp_size=1, slices=[])
    group = join_group(
        name=_BASELINE_GROUP,
        master_addr="127.0.0.1",
        master_port=config.port,
        group_rank=config.group_rank,
        world_size=config.world_size,
        timeout_s=_GROUP_TIMEOUT_S,
        layout=layout,
    )
    tensors = [torch.empty(numel, dtype=torch.uint8) for numel in config.tensor_numels]
    whole = torch.empty(sum(config.tensor_numels), dtype=torch.uint8)
    while True:
        header = torch.zeros(2, dtype=torch.int64)
        deadline = time.monotonic() + 3600
        wait(group, group.pg.broadcast(header, 0), deadline, "command")
        command = int(header[0])
        if command == _STOP:
            break
        if command == _RECEIVE:  # the argument: bytes sent to each peer, point to point
            wait(group, group.pg.recv([whole[: int(header[1])]], 0, 0), deadline, "data")
            continue
        for tensor in [whole] if command == _SINGLE else tensors:
            wait(group, group.pg.broadcast(tensor, 0), deadline, "data")
    destroy_group(_BASELINE_GROUP)


class Baseline:
    """The publisher's end of the baseline group and its peer processes."""

    def __init__(self, num_peers: int, tensors: list[torch.Tensor]) -> None:
        store = serve_store("127.0.0.1", 0, world_size=num_peers + 1, timeout_s=_GROUP_TIMEOUT_S)
        numels = [t.numel() * t.element_size() for t in tensors]
        self.peers = [
            subprocess.Popen(  # noqa: S603 - this interpreter and our own module
                [
                    sys.executable,
                    "-m",
                    "weightbus.apps.bench.dist",
                    _peer_json(rank, num_peers, store, numels),
                ]
            )
            for rank in range(1, num_peers + 1)
        ]
        self.group = join_group(
            name=_BASELINE_GROUP,
            master_addr="127.0.0.1",
            master_port=store.port,
            group_rank=0,
            world_size=num_peers + 1,
            timeout_s=_GROUP_TIMEOUT_S,
            store=store,
        )
        self.tensors = [t.reshape(-1).view(torch.uint8) for t in tensors]
        self.whole = torch.cat(self.tensors)

    def single(self) -> None:
        _broadcast_command(self.group, _SINGLE)
        deadline = time.monotonic() + _GROUP_TIMEOUT_S
        wait(self.group, self.group.pg.broadcast(self.whole, 0), deadline, "single broadcast")

    def per_tensor(self) -> None:
        _broadcast_command(self.group, _PER_TENSOR)
        deadline = time.monotonic() + _GROUP_TIMEOUT_S
        for tensor in self.tensors:
            wait(self.group, self.group.pg.broadcast(tensor, 0), deadline, "tensor broadcast")

    def send_each(self, nbytes: int) -> None:
        """`nbytes` to every peer at once, point to point (what the parts mode's link carries)."""
        _broadcast_command(self.group, _RECEIVE, nbytes)
        deadline = time.monotonic() + _GROUP_TIMEOUT_S
        works = [
            self.group.pg.send([self.whole[:nbytes]], rank, 0)
            for rank in range(1, len(self.peers) + 1)
        ]
        for work in works:
            wait(self.group, work, deadline, "point-to-point send")

    def close(self) -> None:
        _broadcast_command(self.group, _STOP)
        for peer in self.peers:
            peer.wait(timeout=_GROUP_TIMEOUT_S)
        destroy_group(_BASELINE_GROUP)


def _peer_json(rank: int, num_peers: int, store, numels: list[int]) -> str:
    config = PeerConfig(
        group_rank=rank, world_size=num_peers + 1, port=store.port, tensor_numels=numels
    )
    return msgspec.json.encode(config).decode()


class DistPusher:
    """Pushes with one mode of the `dist` sink, each push a new version."""

    def __init__(self, publisher: Publisher, mode: str) -> None:
        self.publisher = publisher
        self.mode = mode
        self.count = 0
        self.rank_sent_bytes: dict[int, int] = {}

    def __call__(self, weights: list) -> None:
        self.publisher.sink.requested_mode = self.mode
        self.count += 1
        version = f"dist-{self.mode}-{self.count}-{time.monotonic_ns()}"
        self.publisher.push(
            weights, version=version, atomic=False, pause_mode="in_place", verify="none"
        )
        self.rank_sent_bytes = dict(self.publisher.sink.rank_sent_bytes)


def write_model(weights: list, size: int, workdir: Path, name: str = "model") -> Path:
    """Write `weights` and a Llama config of `size` as a Hugging Face checkpoint in
    `workdir / name`; return that directory."""
    model_dir = workdir / name
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(hf_config(llama_shape(size, 2))))
    save_file(dict(weights), str(model_dir / "model.safetensors"))
    return model_dir


def _bench(args: argparse.Namespace, workdir: Path) -> dict:
    weights = llama_weights(args.size, torch.bfloat16)
    model_bytes = sum(t.nbytes for _, t in weights)
    model_dir = write_model(weights, args.size, workdir)
    proc, url = start_engine(str(model_dir), args.tp, extra=["--dtype", "bfloat16"])
    baseline = Baseline(args.tp, [t for _, t in weights])
    publisher = Publisher([url], transport="dist", bucket_bytes=args.bucket_bytes, timeout_s=600)
    try:
        publisher.init_weights_group("127.0.0.1", timeout_s=_GROUP_TIMEOUT_S)
        pushers = {mode: DistPusher(publisher, mode) for mode in ("broadcast", "parts")}
        operations = [
            ("gloo broadcast, one tensor", model_bytes, baseline.single),
            ("gloo broadcast per tensor", model_bytes, baseline.per_tensor),
        ]
        operations += [
            (f"dist {mode}", model_bytes, lambda p=p: p(weights)) for mode, p in pushers.items()
        ]
        rows = measure_interleaved(operations, args.repeat)
    finally:
        publisher.close()
        baseline.close()
        stop_engine(proc)
    received = {
        "gloo broadcast, one tensor": model_bytes,
        "gloo broadcast per tensor": model_bytes,
        **{f"dist {mode}": max(p.rank_sent_bytes.values()) for mode, p in pushers.items()},
    }
    return {"size": model_bytes, "tp": args.tp, "rows": rows, "received": received}


def _print(result: dict, args: argparse.Namespace) -> None:
    rows: list[Measurement] = result["rows"]
    baseline = rows[0]
    print(
        f"\n{format_bytes(result['size'])} Llama-shaped bf16 into 1 engine of TP {result['tp']} "
        f"(gloo, loopback), buckets {format_bytes(args.bucket_bytes)}, median of {args.repeat}"
    )
    table = [
        [
            m.name,
            f"{m.median_s:.3f}",
            f"{m.gb_per_s:.2f}",
            f"{baseline.median_s / m.median_s:.2f}",
            format_bytes(result["received"][m.name]),
        ]
        for m in rows
    ]
    headers = ["path", "median s", "model GB/s", "x one-tensor bandwidth", "bytes per rank"]
    print_table(headers, table)


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    torch.set_num_threads(os.cpu_count() or 1)
    shm = Path("/dev/shm")  # noqa: S108 - the benchmark's checkpoint lives in RAM
    with tempfile.TemporaryDirectory(
        prefix="weightbus-bench-", dir=shm if shm.is_dir() else None
    ) as tmp:
        result = _bench(args, Path(tmp))
    _print(result, args)
    if args.json:
        write_json(args.json, {"suite": "dist", "results": [result]})
    return 0


if __name__ == "__main__":
    peer_main(msgspec.json.decode(sys.argv[1], type=PeerConfig))
