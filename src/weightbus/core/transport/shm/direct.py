"""The publisher's copies: straight into ranks' parameters (direct mode) or into slots.

Every rank of the session offered a `DirectTarget` (its parameters in a shared-memory file and
its slice map). The publisher maps each file once, validates the layout once per
`layout_hash`, and then copies every tensor's slices into every rank's parameters: each byte is
copied exactly once per engine and never staged in between. While it copies, it digests the
full tensor (for the fingerprint) and each slice it wrote (for the rank to verify), chunk by
chunk, so the digests read bytes that are still in cache. Copies go through numpy (one thread
each, GIL released) on a pool as wide as torch's thread count, largest tensors first; asked
to, they refuse NaN/inf chunk by chunk (`_CopyGuard`).
"""

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial

import torch

from weightbus.core.digest import TensorHasher
from weightbus.core.plan import BucketPlan, Plan
from weightbus.core.plan.bucket import (
    RowCheck,
    digest_part,
    nonfinite_row_check,
    pack_entry,
    pack_rows,
)
from weightbus.core.plan.shard import ShardCopy
from weightbus.core.transport.parts.layout import checked_copies, region_view
from weightbus.core.transport.parts.shared_memory import ARENA_PREFIX, Slot
from weightbus.core.wire import DirectTarget


@dataclass(frozen=True, slots=True)
class _Dest:
    """One rank's slice of one tensor: where it goes in that rank's mapped file."""

    rank_index: int
    copy: ShardCopy
    param: torch.Tensor  # the whole parameter, a view into the rank's mapped file

    def chunk(self, full: torch.Tensor, start: int, stop: int):
        """A `pack_rows` part: (destination, source) views of rows [start, stop), or None."""
        copy, dim = self.copy, self.copy.src_dim
        if full.dim() == 0:
            return self.param, full
        if dim > 0:  # columns of every row: the rows map one to one
            source = full[start:stop].narrow(dim, copy.src_start, copy.length)
            return copy.destination(self.param)[start:stop], source
        low, high = max(start, copy.src_start), min(stop, copy.src_start + copy.length)
        if low >= high:
            return None
        destination = self.param.narrow(0, copy.dst_start + low - copy.src_start, high - low)
        return destination, full[low:high]


class MappedTarget:
    """One rank's parameter file, mapped by the publisher, its layout checked against a plan.

    Raises:
        ValueError: the file is not a weightbus arena or the layout is inconsistent (the
            message names the tensor or parameter).
    """

    def __init__(self, target: DirectTarget, plan: Plan) -> None:
        self.key = (target.file, target.layout_hash, plan.plan_hash)
        self._file = Slot.open(target.file, target.nbytes, prefix=ARENA_PREFIX)
        checked = checked_copies(target, {meta.name: meta for meta in plan.metas})
        self.copies: dict[str, list[tuple[ShardCopy, torch.Tensor]]] = {
            name: [(each.copy, region_view(self._file.tensor, each.region)) for each in copies]
            for name, copies in checked.items()
        }
        # bytes of the rank's slices of each tensor: what writing it copies into this file
        self.slice_bytes: dict[str, int] = {
            name: sum(copy.destination(param).nbytes for copy, param in copies)
            for name, copies in self.copies.items()
        }

    def is_current(self) -> bool:
        """Whether the file under the mapped name is still the one mapped."""
        return self._file.current_identity() == self._file.identity

    def close(self) -> None:
        self.copies.clear()
        self.slice_bytes.clear()
        self._file.close()


class _StoppedError(Exception):
    """Another copy of the same write failed, or the write ended: this one stopped."""


@dataclass(frozen=True, slots=True)
class _CopyGuard:
    """What one tensor's copy checks: that its write still runs (`stop`, set by the write's
    first copy that fails: the others do not start, and stop before their next chunk) and,
    with `refuse_nonfinite`, that the rows just copied hold no NaN/inf."""

    name: str
    stop: threading.Event
    refuse_nonfinite: bool

    def check_running(self) -> None:
        """Raises: _StoppedError: the write failed elsewhere."""
        if self.stop.is_set():
            raise _StoppedError

    def chunk_check(self, full: torch.Tensor) -> RowCheck:
        """The `pack_rows` check of the copy of `full` (this tensor, contiguous): a copy whose
        last chunk is done completes."""
        refuse = nonfinite_row_check(self.name, full) if self.refuse_nonfinite else None
        end_row = full.shape[0] if full.dim() else 1

        def check(low: int, high: int) -> None:
            if refuse is not None:
                refuse(low, high)
            if high < end_row:
                self.check_running()

        return check


def _write_tensor(
    full: torch.Tensor, dests: list[_Dest], slice_digests: bool, guard: _CopyGuard
) -> tuple[str, dict[int, str]]:
    """Copy every rank's slice of `full`; return its digest and (with `slice_digests`) each
    slice's digest. `guard` checks each chunk once copied; a failure sets its `stop` for the
    write's other copies.

    Raises:
        NonFiniteWeightsError: the guard refuses NaN/inf and the tensor holds some (the copy
            stopped after the first bad chunk).
    """
    full = full if full.is_contiguous() else full.contiguous()
    digest = TensorHasher.of(full)
    slices: dict[int, TensorHasher] = {}
    if slice_digests:
        slices = {dest.rank_index: TensorHasher.of(dest.copy.source(full)) for dest in dests}
    parts = [(partial(dest.chunk, full), slices.get(dest.rank_index)) for dest in dests]
    parts.append(digest_part(full, digest))
    row_bytes = full[0].nbytes if full.dim() and full.shape[0] else full.nbytes
    check = guard.chunk_check(full)
    try:
        guard.check_running()
        pack_rows(0, full.shape[0] if full.dim() else 1, row_bytes, parts, check)
    except BaseException:
        guard.stop.set()
        raise
    return digest.hexdigest(), {rank: hasher.hexdigest() for rank, hasher in slices.items()}


def _one_torch_thread() -> None:
    """Pool initializer: torch ops in a copy thread (the NaN/inf check's sums of 32- and 64-bit
    chunks, contiguous copies) run on one thread.

    The pool is already as wide as the cores; at torch's default each op would also start a
    team of threads over every core, so the copies would oversubscribe them (on 2 cores, 1 GiB
    with a torch sum per chunk measured 0-15 ms faster this way). The setting is per thread:
    the caller's torch keeps its own.
    """
    torch.set_num_threads(1)


def _written(
    futures: Mapping[str, Future], name: str, deadline: float
) -> tuple[str, dict[int, str]]:
    """Tensor `name`'s digests once written.

    Raises:
        TimeoutError: not written by `deadline`.
        Exception: the failure that stopped the write's copies (raised once none of them runs
            any more), if this one was stopped.
    """
    try:
        return futures[name].result(max(0.0, deadline - time.monotonic()))
    except _StoppedError:
        pass
    for future in futures.values():
        future.cancel()
    wait(futures.values())
    failures = [
        future.exception()
        for future in futures.values()
        if not future.cancelled() and future.exception() is not None
    ]
    first = next((exc for exc in failures if not isinstance(exc, _StoppedError)), None)
    assert first is not None, "a write's copies stopped without a failure"
    raise first from None


class DirectWriter:
    """Copies with a pool of threads: straight into ranks' parameters (direct mode), or into a
    slot (slot mode), digesting the bytes as they pass (and, asked to, refusing NaN/inf)."""

    def __init__(self, workers: int | None = None) -> None:
        # the copy threads (one torch thread each): cells of sharded tensors run here too
        self.pool = ThreadPoolExecutor(
            max_workers=workers or torch.get_num_threads(),
            thread_name_prefix="shm-direct",
            initializer=_one_torch_thread,
        )

    def write(
        self,
        plan: Plan,
        tensors: Mapping[str, torch.Tensor],
        targets: list[MappedTarget],
        deadline: float,
        *,
        slice_digests: bool = True,
        refuse_nonfinite: bool = False,
    ) -> Iterator[tuple[int, dict[str, tuple[str, dict[int, str]]]]]:
        """Write every tensor of `tensors` (whole: the ones this rank sends); yield
        `(bucket index, {name: (digest, slice digests by rank)})` in bucket order, each bucket
        as soon as the tensors of `tensors` it finishes are written. Without `slice_digests`
        (receivers do not verify) the slices are not digested. Once it ends, however it ends,
        no copy of it writes any more.

        Raises:
            TimeoutError: the copies did not finish by `deadline` (`time.monotonic()`).
            NonFiniteWeightsError: `refuse_nonfinite` and a tensor holds NaN or inf (named);
                the copies stopped, some bytes of the version are written.
        """
        stop = threading.Event()
        futures: dict[str, Future] = {}
        for meta in sorted(plan.metas, key=lambda meta: -meta.nbytes):
            if meta.name not in tensors:
                continue
            dests = [
                _Dest(index, copy, param)
                for index, target in enumerate(targets)
                for copy, param in target.copies.get(meta.name, [])
            ]
            guard = _CopyGuard(meta.name, stop, refuse_nonfinite)
            futures[meta.name] = self.pool.submit(
                _write_tensor, tensors[meta.name], dests, slice_digests, guard
            )
        try:
            for bucket in plan.buckets:
                names = [name for name in bucket.finished_names() if name in futures]
                yield bucket.index, {name: _written(futures, name, deadline) for name in names}
        finally:
            stop.set()
            for future in futures.values():
                future.cancel()
            wait(futures.values())

    def pack(
        self,
        buffer: torch.Tensor,
        bucket: BucketPlan,
        tensors: Mapping[str, torch.Tensor],
        hashers: dict[str, TensorHasher],
        *,
        refuse_nonfinite: bool = False,
        extra: Sequence[Callable[[], int]] = (),
    ) -> dict[str, str]:
        """Pack the entries of `bucket` whose tensors are in `tensors` (whole: the ones this
        rank sends) into `buffer`, and run the `extra` copies (parts of tensors sent in cells)
        on the same pool; return the digests of the tensors of `tensors` it finishes. Once it
        returns or raises, no copy of it writes any more.

        `hashers` carries the digest state of tensors split across buckets (pack the buckets
        in plan order).

        Raises:
            ValueError: a tensor's dtype/shape differ from the plan.
            NonFiniteWeightsError: `refuse_nonfinite` and a tensor holds NaN or inf (named).
        """
        jobs = []
        for entry in bucket.entries:
            if entry.name in tensors:
                hasher = hashers.get(entry.name) or hashers.setdefault(
                    entry.name, TensorHasher.of_shape(entry.shape, entry.torch_dtype.itemsize)
                )
                jobs.append((entry, tensors[entry.name].detach(), hasher))
        # biggest first: two workers finish together
        jobs.sort(key=lambda job: -job[0].nbytes)
        packs = [
            self.pool.submit(
                pack_entry,
                buffer[entry.offset : entry.end],
                entry,
                tensor,
                hasher,
                refuse_nonfinite=refuse_nonfinite,
            )
            for entry, tensor, hasher in jobs
        ]
        packs += [self.pool.submit(copy) for copy in extra]
        wait(packs)
        for future in packs:
            future.result()
        return {
            name: hashers.pop(name).hexdigest()
            for name in bucket.finished_names()
            if name in hashers
        }

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
