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

import numpy as np
import torch

from weightbus.core.digest import TensorHasher
from weightbus.core.finite import NonFiniteWeightsError, bits_scanner, signed_view
from weightbus.core.plan import BucketPlan, Plan
from weightbus.core.plan.bucket import CHUNK_BYTES, pack_entry
from weightbus.core.plan.shard import ShardCopy
from weightbus.core.transport.parts.layout import checked_copies, region_view
from weightbus.core.transport.parts.shared_memory import ARENA_PREFIX, Slot
from weightbus.core.wire import DirectTarget

# tensors below this size are written in batches (`_batches`)
SMALL_TENSOR_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class _Dest:
    """One rank's slice of one tensor: its place in the rank's mapped file as a numpy view
    (made once per mapping: no torch call per chunk), rows first as the tensor's."""

    rank_index: int
    copy: ShardCopy
    region: np.ndarray  # `copy.destination(param)`, at least 1-D

    def views(self, rows: np.ndarray, low: int) -> tuple[np.ndarray, np.ndarray] | None:
        """`(destination, source)` for the tensor's `rows` (its rows from `low` on), or None
        when the slice has none of them."""
        dim, start, length = self.copy.src_dim, self.copy.src_start, self.copy.length
        if dim > 0:  # columns of every row: the rows map one to one
            columns = (*(slice(None),) * (dim - 1), slice(start, start + length))
            return self.region[low : low + rows.shape[0]], rows[(slice(None), *columns)]
        first, stop = max(low, start), min(low + rows.shape[0], start + length)
        if first >= stop:
            return None
        return self.region[first - start : stop - start], rows[first - low : stop - low]


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's elements as numpy, in place (as same-sized signed integers: bf16 and
    fp8 have no numpy dtype), at least 1-D (a scalar as one row)."""
    array = signed_view(tensor)
    array = tensor.detach().numpy() if array is None else array
    return array.reshape(1) if array.ndim == 0 else array


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
        # the same places as numpy views, for the copy loop
        self.regions: dict[str, list[tuple[ShardCopy, np.ndarray]]] = {
            name: [(copy, _as_numpy(copy.destination(param))) for copy, param in copies]
            for name, copies in self.copies.items()
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
        self.regions.clear()
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

    def scanner(self, dtype: torch.dtype) -> Callable[[np.ndarray], bool] | None:
        """The NaN/inf test of this tensor's chunks (None: not asked, or not floating)."""
        return bits_scanner(dtype) if self.refuse_nonfinite else None


def _write_tensor(
    full: torch.Tensor, dests: list[_Dest], slice_digests: bool, guard: _CopyGuard
) -> tuple[str, dict[int, str]]:
    """Copy every rank's slice of `full`; return its digest and (with `slice_digests`) each
    slice's digest. `CHUNK_BYTES` of rows at a time: each slice's copy, the digests and the
    NaN/inf check read the rows while they are in cache, through numpy views (no torch call
    per chunk). `guard` checks each chunk once copied; a failure sets its `stop` for the
    write's other copies.

    Raises:
        NonFiniteWeightsError: the guard refuses NaN/inf and the tensor holds some (the copy
            stopped after the first bad chunk).
    """
    full = full if full.is_contiguous() else full.contiguous()
    digest = TensorHasher.of(full)
    slices = {d.rank_index: TensorHasher.of(d.copy.source(full)) for d in dests}
    slices = slices if slice_digests else {}
    source, scan = _as_numpy(full), guard.scanner(full.dtype)
    row_bytes = source.nbytes // source.shape[0] if source.shape[0] else 0
    step = max(1, CHUNK_BYTES // max(1, row_bytes))
    try:
        for low in range(0, source.shape[0], step):
            guard.check_running()
            rows = source[low : low + step]
            _copy_rows(rows, low, dests, slices)
            digest.update(rows)
            if scan is not None and scan(rows):
                _refuse(guard.name)
    except BaseException:
        guard.stop.set()
        raise
    return digest.hexdigest(), {rank: hasher.hexdigest() for rank, hasher in slices.items()}


def _write_tensors(jobs: list[tuple], results: list[Future]) -> None:
    """`_write_tensor` of each job in turn, its digests (or failure) set on its result; a job
    whose result was cancelled is skipped."""
    for job, result in zip(jobs, results, strict=True):
        if not result.set_running_or_notify_cancel():
            continue
        try:
            result.set_result(_write_tensor(*job))
        except BaseException as exc:  # noqa: BLE001 - the failure is the result's
            result.set_exception(exc)


def _batches(plan: Plan, tensors: Mapping[str, torch.Tensor]) -> Iterator[list[str]]:
    """The names of `tensors`, largest first, in the batches one copy thread writes in turn:
    each tensor of `SMALL_TENSOR_BYTES` or more alone, smaller ones together up to
    `CHUNK_BYTES` (a thread per small tensor spent more on hand-offs and the GIL than on its
    bytes: 126 tensors of 160 KiB took 26 ms on 2 threads, 17 ms batched)."""
    batch: list[str] = []
    batch_bytes = 0
    for meta in sorted(plan.metas, key=lambda meta: -meta.nbytes):
        if meta.name not in tensors:
            continue
        if meta.nbytes >= SMALL_TENSOR_BYTES:
            yield [meta.name]
            continue
        batch.append(meta.name)
        batch_bytes += meta.nbytes
        if batch_bytes >= CHUNK_BYTES:
            yield batch
            batch, batch_bytes = [], 0
    if batch:
        yield batch


def _copy_rows(
    rows: np.ndarray, low: int, dests: list[_Dest], slices: dict[int, TensorHasher]
) -> None:
    """Copy the tensor's `rows` (from row `low` on) into every rank's slice, digesting what
    each slice received when `slices` has its hasher."""
    for dest in dests:
        pair = dest.views(rows, low)
        if pair is not None:
            np.copyto(pair[0], pair[1])
            if dest.rank_index in slices:
                slices[dest.rank_index].update(np.ascontiguousarray(pair[0]))


def _refuse(name: str) -> None:
    """Raises: NonFiniteWeightsError: tensor `name` holds NaN or inf (as
    `refuse_nonfinite_chunk` says it)."""
    raise NonFiniteWeightsError(f"tensor {name!r} holds NaN or infinite values")


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
    futures: Mapping[str, Future], tasks: list[Future], name: str, deadline: float
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
    _stop_all(futures, tasks)
    failures = [
        future.exception()
        for future in futures.values()
        if future.done() and not future.cancelled() and future.exception() is not None
    ]
    first = next((exc for exc in failures if not isinstance(exc, _StoppedError)), None)
    assert first is not None, "a write's copies stopped without a failure"
    raise first from None


def _stop_all(futures: Mapping[str, Future], tasks: list[Future]) -> None:
    """Cancel what has not started and wait until no task of the write copies any more."""
    for future in [*tasks, *futures.values()]:
        future.cancel()
    wait(tasks)


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
        futures: dict[str, Future] = {}  # each tensor's digests, set by its batch's task
        tasks: list[Future] = []
        for batch in _batches(plan, tensors):
            jobs = [
                (
                    tensors[name],
                    [
                        _Dest(index, copy, region)
                        for index, target in enumerate(targets)
                        for copy, region in target.regions.get(name, [])
                    ],
                    slice_digests,
                    _CopyGuard(name, stop, refuse_nonfinite),
                )
                for name in batch
            ]
            results = [Future() for _ in batch]
            futures.update(zip(batch, results, strict=True))
            tasks.append(self.pool.submit(_write_tensors, jobs, results))
        try:
            for bucket in plan.buckets:
                names = [name for name in bucket.finished_names() if name in futures]
                yield (
                    bucket.index,
                    {name: _written(futures, tasks, name, deadline) for name in names},
                )
        finally:
            stop.set()
            _stop_all(futures, tasks)

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
