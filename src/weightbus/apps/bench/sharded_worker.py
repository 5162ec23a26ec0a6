"""One trainer rank of `weightbus bench sharded` (run by it: RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set). It builds the checkpoint's Llama on the meta device, shards it with FSDP2's
`fully_shard` on a gloo CPU mesh, fills its own shards from the checkpoint (never the whole
model), then times each push path and writes `<out>/rank<r>.json`."""

import json
import os
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from weightbus.apps.cluster.rank import fsdp_model
from weightbus.core.publisher import Publisher

_SAMPLE_S = 0.002
# every push of the bench: staged then swapped, between two steps, every digest checked
_OPTIONS = {"atomic": True, "pause_mode": "in_place", "verify": "full"}


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


class PeakAnon:
    """The peak private memory (RssAnon) above its value at the start, sampled every 2 ms:
    what a push allocates, not the engines' shared memory it writes into."""

    def __enter__(self) -> "PeakAnon":
        self.base = self.peak = _rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(_SAMPLE_S):
            self.peak = max(self.peak, _rss_anon())

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_anon())

    @property
    def extra_bytes(self) -> int:
        return self.peak - self.base


def _timed(push, repeat: int) -> dict:
    seconds, peaks, sent = [], [], []
    for index in range(repeat + 1):  # the first warms up (page faults, mappings)
        dist.barrier()
        with PeakAnon() as peak:
            start = time.perf_counter()
            sent_bytes = push(index)
            elapsed = time.perf_counter() - start
        if index:
            seconds.append(elapsed)
            peaks.append(peak.extra_bytes)
            sent.append(sent_bytes)
    return {"seconds": statistics.median(seconds), "peak_bytes": max(peaks), "sent_bytes": sent[-1]}


# the paths compared: (row name, Publisher options); each both ways: every rank its shards (a
# Publisher on the trainer's group), and the gather then one push from rank 0
_PATHS = (
    ("shm direct", {"transport": "shm", "transport_options": {"direct": True}}),
    ("shm slots", {"transport": "shm", "transport_options": {"direct": False}}),
    ("nixl", {"transport": "nixl"}),
    ("dist", {"transport": "dist"}),
)


def _sharded_row(model: torch.nn.Module, args: dict, name: str, options: dict) -> dict:
    """Median push of every rank's own shards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sharded = Publisher(
        [args["url"]], group=dist.group.WORLD, timeout_s=600, bucket_bytes=args["bucket_bytes"],
        **options,
    )  # fmt: skip

    def push(index: int) -> int:
        version = f"sharded-{world}-{name}-{index}-{time.monotonic_ns()}"
        return sharded.push(model, version=version, **_OPTIONS).rank_sent_bytes[rank]

    try:
        return _timed(push, args["repeat"])
    finally:
        sharded.close()


def _gathered_row(model: torch.nn.Module, args: dict, name: str, options: dict) -> dict:
    """Median of today's path: every parameter `full_tensor()`ed, one push from rank 0."""
    world = dist.get_world_size()
    publisher = None
    if dist.get_rank() == 0:
        publisher = Publisher(
            [args["url"]], timeout_s=600, bucket_bytes=args["bucket_bytes"], **options
        )
        if options["transport"] == "dist":  # a group of several forms its weights group itself
            publisher.init_weights_group("127.0.0.1")

    def push(index: int) -> int:
        full = {name: p.full_tensor() for name, p in model.state_dict().items()}
        sent = 0
        if publisher is not None:
            version = f"gathered-{world}-{name}-{index}-{time.monotonic_ns()}"
            sent = publisher.push(full, version=version, **_OPTIONS).sent_bytes
        dist.barrier()
        return sent

    try:
        return _timed(push, args["repeat"])
    finally:
        if publisher is not None:
            publisher.close()


def main() -> None:
    args = json.loads(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = fsdp_model(args["model_dir"])
    shard_bytes = sum(p.to_local().nbytes for p in model.state_dict().values())
    results = {"rank": rank, "world_size": world, "shard_bytes": shard_bytes, "rows": {}}
    for name, options in _PATHS:
        if name.split()[0] not in args["transports"]:
            continue
        rows = results["rows"]
        rows[f"sharded {name}"] = _sharded_row(model, args, name, options)
        rows[f"full_tensor + Publisher {name}"] = _gathered_row(model, args, name, options)
    (Path(args["out"]) / f"rank{rank}.json").write_text(json.dumps(results))
    os._exit(0)


if __name__ == "__main__":
    main()
