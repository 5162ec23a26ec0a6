"""What a user would otherwise pick to move weights, each with real receiver processes.

- `BroadcastCase`: one `torch.distributed` broadcast per tensor over a gloo group of the
  publisher and N receivers (OpenRLHF, older verl);
- `PickleCase`: tensors pickled through `torch.multiprocessing` queues to N receivers (what
  `update_weights_from_tensor` does on a CPU host: the storage moves to shared memory and a
  file descriptor travels).

Receivers hold preallocated tensors of the model's shapes and copy into them; they slice
nothing (a TP rank of an engine would also have to shard), which favours the baselines.
"""

import datetime as dt
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from weightbus.apps.bench.llama_weights import llama_shape

START_TIMEOUT_S = 120.0
ROUND_TIMEOUT_S = 600.0
_STOP, _ROUND = 0, 1


def _empty_model(size: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.empty(dims, dtype=dtype) for _, dims in llama_shape(size).tensor_shapes()]


def _receiver_group(rank: int, world_size: int, port: int) -> dist.ProcessGroupGloo:
    """A receiver's handle on the gloo group (its store client stays referenced by it)."""
    timeout = dt.timedelta(seconds=ROUND_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore("bench", store), rank, world_size, timeout)


def _broadcast_receiver(rank: int, world_size: int, port: int, size: int, dtype_name: str) -> None:
    torch.set_num_threads(1)
    group = _receiver_group(rank, world_size, port)
    tensors = _empty_model(size, getattr(torch, dtype_name))
    command = torch.zeros(1, dtype=torch.int64)
    while True:
        group.broadcast(command, 0).wait()
        if int(command) == _STOP:
            return
        for tensor in tensors:
            group.broadcast(tensor, 0).wait()
        group.barrier().wait()


class BroadcastCase:
    """One gloo broadcast per tensor from the publisher to `num_receivers` processes."""

    name = "torch.distributed broadcast per tensor (gloo)"
    kind = "broadcast"

    def __init__(self, weights: Sequence[tuple[str, torch.Tensor]], size: int, num_receivers: int):
        self.tensors = [tensor.contiguous() for _, tensor in weights]
        world_size = num_receivers + 1
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback; children inherit it
        self._store = _master_store(world_size)
        port = self._store.port
        spawn = mp.get_context("spawn")
        dtype_name = str(self.tensors[0].dtype).removeprefix("torch.")
        self.procs = [
            spawn.Process(
                target=_broadcast_receiver,
                args=(rank, world_size, port, size, dtype_name),
                daemon=True,
            )
            for rank in range(1, world_size)
        ]
        for proc in self.procs:
            proc.start()
        timeout = dt.timedelta(seconds=START_TIMEOUT_S)
        self.group = dist.ProcessGroupGloo(
            dist.PrefixStore("bench", self._store), 0, world_size, timeout
        )

    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def prepare(self) -> None:
        """Nothing: the trainer's tensors are broadcast as they are."""

    def run(self) -> None:
        self.group.broadcast(torch.tensor([_ROUND]), 0).wait()
        for tensor in self.tensors:
            self.group.broadcast(tensor, 0).wait()
        self.group.barrier().wait()  # every receiver has every tensor

    def close(self) -> None:
        self.group.broadcast(torch.tensor([_STOP]), 0).wait()
        _join(self.procs)


def _master_store(world_size: int) -> dist.TCPStore:
    """A TCPStore master on a port the OS picks (`.port` tells which)."""
    return dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        True,
        timeout=dt.timedelta(seconds=START_TIMEOUT_S),
        wait_for_workers=False,
    )


def _pickle_receiver(
    inbox: mp.Queue, acks: mp.Queue, size: int, dtype_name: str, timeout_s: float
) -> None:
    torch.set_num_threads(1)
    tensors = _empty_model(size, getattr(torch, dtype_name))
    acks.put("ready")
    while True:
        message = inbox.get(timeout=timeout_s)
        if message is None:
            return
        for index in range(len(tensors)):
            received = inbox.get(timeout=timeout_s)
            tensors[index].copy_(received)
            del received  # frees the shared-memory segment once every holder did
        acks.put(message)


class PickleCase:
    """Fresh trainer tensors pickled through one `torch.multiprocessing` queue per receiver."""

    name = "pickle via torch.multiprocessing queues"
    kind = "pickle"

    def __init__(self, weights: Sequence[tuple[str, torch.Tensor]], size: int, num_receivers: int):
        self.weights = [tensor for _, tensor in weights]
        spawn = mp.get_context("spawn")
        dtype_name = str(self.weights[0].dtype).removeprefix("torch.")
        self.inboxes = [spawn.Queue() for _ in range(num_receivers)]
        self.acks = spawn.Queue()
        self.procs = [
            spawn.Process(
                target=_pickle_receiver,
                args=(inbox, self.acks, size, dtype_name, ROUND_TIMEOUT_S),
                daemon=True,
            )
            for inbox in self.inboxes
        ]
        for proc in self.procs:
            proc.start()
        for _ in self.procs:
            self.acks.get(timeout=START_TIMEOUT_S)
        self.fresh: list[torch.Tensor] = []
        self.rounds = 0

    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def prepare(self) -> None:
        """A trainer hands over new tensors each update (e.g. gathered or cast from fp32
        master weights): pickling must move each one into shared memory. Not timed."""
        self.fresh = [tensor.clone() for tensor in self.weights]

    def run(self) -> None:
        self.rounds += 1
        for inbox in self.inboxes:
            inbox.put(self.rounds)
        for tensor in self.fresh:
            for inbox in self.inboxes:
                inbox.put(tensor)
        for _ in self.inboxes:
            if self.acks.get(timeout=ROUND_TIMEOUT_S) != self.rounds:
                raise RuntimeError("a pickle receiver acknowledged the wrong round")
        self.fresh = []

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        _join(self.procs)
        for inbox in [*self.inboxes, self.acks]:
            inbox.close()


def _join(procs: list, timeout_s: float = 30.0) -> None:
    for proc in procs:
        proc.join(timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout_s)
