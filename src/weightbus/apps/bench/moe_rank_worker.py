"""One trainer rank of `weightbus bench moe --trainer-ranks N` (run by `moe_ranks.py`: RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set).

It holds the checkpoint's Qwen3-MoE as FSDP2's `fully_shard` holds a transformers 5 model's
state: every tensor a DTensor `Shard(0)` on a gloo CPU mesh, the experts fused
(`mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`) and so cut by expert: each rank
holds a contiguous half of every layer's experts and its chunk of every other tensor's rows.
(The DTensors are built directly, without transformers' model class, whose import alone costs
a second or two per process; the demo's `--trainer-ranks` runs `fully_shard` itself.) Each rank
reads only its own shards from the checkpoint's per-expert tensors, then times, in interleaved
rounds:

- `floor`: every rank copies the bytes it holds into a preallocated /dev/shm buffer at once
  (the least an expert-parallel push into shared memory must do; a ring of at most 256 MiB,
  beyond any cache, so that the floor does not double the bench's memory);
- `gather alone`: every tensor `full_tensor()`ed (an all-gather over the gloo group), nothing
  pushed: what the baseline pays before its push;
- per transport, `EP ranks` (a `Publisher` on the trainer's group: each rank sends the experts
  and rows it holds) and `full_tensor + rank 0` (the gather, then one push from rank 0, as
  users do it without a group).

Each row's time is rank 0's (every rank returns from a push at its outcome). It writes
`<out>/rank<r>.json`: its shard, each row's seconds, the bytes it sent, the fingerprint pushed
and the peak private memory (sampled `RssAnon`) above the push's start.
"""

import functools
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from weightbus.apps.bench.sharded_worker import PeakAnon
from weightbus.core.publisher import Publisher

_GROUP_TIMEOUT_S = 600.0
_FLOOR_BUFFER_BYTES = 256 * 2**20
# the transport alone, as the rows of `weightbus bench moe` push: in place, verify none
_OPTIONS = {"atomic": False, "pause_mode": "in_place", "verify": "none"}
# a checkpoint's expert tensor, and the fused tensors transformers 5 holds (the parts' rows
# one after the other)
_PER_EXPERT = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?:gate|up|down)_proj\.weight$"
)
_FUSED_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
# the rows' Publisher options by transport
TRANSPORTS = {
    "shm": {"transport": "shm", "transport_options": {"direct": True}},
    "dist": {"transport": "dist"},
}


def ep_state(model_dir: str) -> dict[str, Any]:
    """The checkpoint (one `model.safetensors` of per-expert tensors) as FSDP2 shards a
    transformers 5 Qwen3-MoE: `Shard(0)` DTensors on a gloo CPU mesh of the default group, each
    layer's experts fused; this rank's shards only are read."""
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state: dict[str, Any] = {}
    experts: dict[str, int] = {}  # a layer's `...mlp.experts` -> its number of experts
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as checkpoint:
        for name in checkpoint.keys():  # noqa: SIM118 - a safetensors handle, not a dict
            if match := _PER_EXPERT.match(name):
                prefix = match["prefix"]
                experts[prefix] = max(experts.get(prefix, 0), int(match["expert"]) + 1)
                continue
            rows = checkpoint.get_slice(name)
            state[name] = _shard(mesh, tuple(rows.get_shape()), lambda a, b, r=rows: r[a:b])
        for prefix, count in experts.items():
            for fused, parts in _FUSED_PARTS.items():
                read = functools.partial(_experts, checkpoint, prefix, parts)
                rows, columns = checkpoint.get_slice(f"{prefix}.0.{parts[0]}.weight").get_shape()
                state[f"{prefix}.{fused}"] = _shard(mesh, (count, len(parts) * rows, columns), read)
    return state


def _experts(checkpoint: Any, prefix: str, parts: tuple[str, ...], first: int, stop: int):
    """Experts `first` to `stop` of a layer as its fused tensor holds them: each expert's
    `parts` (gate and up, or down) one after the other, `[stop - first, rows, columns]`."""
    names = [f"{prefix}.{e}.{part}.weight" for e in range(first, stop) for part in parts]
    one = checkpoint.get_slice(f"{prefix}.0.{parts[0]}.weight")
    rows, columns = one.get_shape()
    if not names:  # a rank past the last expert: an empty block of the checkpoint's dtype
        return one[0:0].view(0, len(parts) * rows, columns)
    tensors = [checkpoint.get_tensor(name) for name in names]
    return torch.cat(tensors).view(stop - first, len(parts) * rows, columns)


def _shard(mesh: Any, shape: tuple[int, ...], read: Callable[[int, int], torch.Tensor]) -> Any:
    """A DTensor of `shape` `Shard(0)` on `mesh` (`torch.chunk`'s cut, as FSDP2's) holding
    `read(first, stop)`: this rank's rows."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, [Shard(0)])
    first = offset[0] if local_shape[0] else 0  # an empty shard: a rank past the last row
    local = read(first, first + local_shape[0]).contiguous()
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride
    )


class _Rows:
    """This rank's rows: what each does, its publishers, and what its pushes returned."""

    def __init__(self, state: dict[str, Any], args: dict, folder: Path) -> None:
        self.state = state
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.held = [p.to_local() for p in state.values()]
        self.shard_bytes = sum(t.nbytes for t in self.held)
        self.fingerprints: dict[str, str] = {}
        self.sent: dict[str, int] = {}
        self.publishers: list[Publisher] = []
        path = folder / f"floor-{self.rank}.bin"
        size = min(self.shard_bytes, _FLOOR_BUFFER_BYTES)
        with path.open("wb") as handle:
            handle.truncate(size)
        self.floor_buffer = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        path.unlink()  # the mapping stays
        self.rows: dict[str, Callable[[int], None]] = {"floor": self._floor}
        if self.world > 1:
            self.rows["gather alone"] = self._gather
        for transport in args["transports"]:
            self._add(transport, args)

    def _add(self, transport: str, args: dict) -> None:
        options = {**TRANSPORTS[transport], "timeout_s": 600, "bucket_bytes": args["bucket_bytes"]}
        sharded = Publisher([args["url"]], group=dist.group.WORLD, **options)
        self.publishers.append(sharded)
        self.rows[f"{transport}: EP ranks"] = lambda index: self._push(
            f"{transport}: EP ranks", sharded, self.state, index
        )
        if self.world == 1:  # one rank holds everything: nothing to gather
            return
        alone = None
        if self.rank == 0:
            if transport == "dist":  # a weights group of its own beside the ranks' one
                options["transport_options"] = {"group_name": "weightbus-rank-0"}
            alone = Publisher([args["url"]], **options)
            self.publishers.append(alone)
            if transport == "dist":  # a group of several forms its weights group itself
                alone.init_weights_group("127.0.0.1", timeout_s=_GROUP_TIMEOUT_S)
        self.rows[f"{transport}: full_tensor + rank 0"] = lambda index: self._gathered_push(
            f"{transport}: full_tensor + rank 0", alone, index
        )

    def _floor(self, index: int) -> None:
        ring, offset = self.floor_buffer.numel(), 0
        for tensor in self.held:
            flat, start = tensor.reshape(-1).view(torch.uint8), 0
            while start < flat.numel():
                count = min(flat.numel() - start, ring - offset)
                self.floor_buffer[offset : offset + count].copy_(flat[start : start + count])
                start, offset = start + count, (offset + count) % ring
        dist.barrier()

    def _gather(self, index: int) -> None:
        full = [p.full_tensor() for p in self.state.values()]
        del full
        dist.barrier()

    def _push(self, row: str, publisher: Publisher, weights: object, index: int) -> None:
        version = f"moe-ranks-{self.world}-{row}-{index}-{time.monotonic_ns()}"
        result = publisher.push(weights, version=version, **_OPTIONS)
        self.fingerprints[row] = result.fingerprint
        self.sent[row] = result.rank_sent_bytes[publisher.rank]

    def _gathered_push(self, row: str, publisher: Publisher | None, index: int) -> None:
        full = {name: p.full_tensor() for name, p in self.state.items()}
        if publisher is not None:
            self._push(row, publisher, full, index)
        else:
            self.sent[row] = 0
        del full
        dist.barrier()

    def close(self) -> None:
        for publisher in self.publishers:
            publisher.close()


def _measure(rows: _Rows, repeat: int) -> dict[str, dict]:
    """Every row once per round, after one untimed round; rank 0's median seconds, and the
    largest peak above a push's start over every round (the first's allocations included)."""
    seconds: dict[str, list[float]] = {name: [] for name in rows.rows}
    peaks: dict[str, int] = dict.fromkeys(rows.rows, 0)
    for index in range(repeat + 1):
        for name, run in rows.rows.items():
            dist.barrier()
            with PeakAnon() as peak:
                start = time.perf_counter()
                run(index)
                elapsed = time.perf_counter() - start
            peaks[name] = max(peaks[name], peak.extra_bytes)
            if index:
                seconds[name].append(elapsed)
    return {
        name: {
            "seconds": statistics.median(seconds[name]),
            "samples": seconds[name],
            "peak_extra_bytes": peaks[name],
            "sent_bytes": rows.sent.get(name),
            "fingerprint": rows.fingerprints.get(name),
        }
        for name in rows.rows
    }


def main() -> None:
    args = json.loads(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=_GROUP_TIMEOUT_S))
    state = ep_state(args["model_dir"])
    shm = Path("/dev/shm")  # noqa: S108 - the floor's buffer is shared memory, as the engine's
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as tmp:
        rows = _Rows(state, args, Path(tmp))
        try:
            measured = _measure(rows, args["repeat"])
        finally:
            rows.close()
    result = {"rank": rows.rank, "shard_bytes": rows.shard_bytes, "rows": measured}
    (Path(args["out"]) / f"rank{rows.rank}.json").write_text(json.dumps(result))
    os._exit(0)  # gloo's teardown waits for peers that may have stopped


if __name__ == "__main__":
    main()
