"""The Receiver: one per engine rank; consumes a push session and verifies it.

`Receiver.receive` is a short loop over named steps: `_open` (header, version, plan and layout
checks), `_consume` (batches -> checks -> digests -> `load_weights`), `_close` (completeness and
fingerprint). Every failure becomes a message in the result: the caller (the engine) combines
the verdicts of all ranks and commits or aborts.
"""

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from weightbus.core.digest import checked_digest, fingerprint_of_digests
from weightbus.core.finite import describe_nonfinite
from weightbus.core.fp8 import FP8_DTYPE
from weightbus.core.meta import TensorMeta, dtype_name
from weightbus.core.plan import plan_buckets
from weightbus.core.receiver.delta import DeltaReceive, SliceWriter
from weightbus.core.transport import BucketSource, ReceivedBatch
from weightbus.core.transport.parts.prefetch import Prefetcher
from weightbus.core.wire import UpdateBegin, UpdateOrder

logger = logging.getLogger(__name__)

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], Iterable[str]]


@dataclass(slots=True, kw_only=True)
class RankResult:
    """One rank's verdict on a session."""

    ok: bool = True
    errors: list[str] = field(default_factory=list)
    bad_names: list[str] = field(default_factory=list)
    timed_out: bool = False
    touched: bool = False  # load_weights was called: the target may be partly overwritten
    fingerprint: str | None = None
    # name -> digest of every tensor of a verified session (each checked by one rank)
    digests: dict[str, str] = field(default_factory=dict)
    nbytes: int = 0
    phases: dict[str, float] = field(default_factory=dict)

    def fail(self, message: str, names: Iterable[str] = ()) -> None:
        self.ok = False
        self.errors.append(message)
        self.bad_names.extend(names)


@dataclass(slots=True)
class _Session:
    """Per-session state of one `receive` call."""

    header: UpdateBegin
    metas: dict[str, TensorMeta]
    order: dict[str, int]
    digests: dict[str, str] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)
    delta: DeltaReceive | None = None
    # when the publisher's last bytes were in (`tail_s` counts from it): the last batch's
    # arrival in direct mode (the publisher is done once it told), else its release (the
    # publisher waits for each batch's ack)
    last_bytes_at: float | None = None

    @classmethod
    def of(cls, header: UpdateBegin, delta: DeltaReceive | None) -> "_Session":
        metas = {meta.name: meta.to_meta() for meta in header.tensors}
        return cls(header, metas, {name: index for index, name in enumerate(metas)}, delta=delta)


def _describe(meta: TensorMeta) -> str:
    return f"{dtype_name(meta.dtype)}{list(meta.shape)}"


def _layout_errors(stream: dict[str, TensorMeta], expected: Mapping[str, TensorMeta]) -> list:
    """(message, names) for every way the stream's tensors differ from the model's."""
    problems = []
    unknown = sorted(set(stream) - set(expected))
    missing = sorted(set(expected) - set(stream))
    mismatched = sorted(
        name
        for name in set(stream) & set(expected)
        if (stream[name].dtype, stream[name].shape) != (expected[name].dtype, expected[name].shape)
    )
    # an unquantized push into an FP8 engine: the cause first, then the scales it lacks
    unquantized = [name for name in mismatched if expected[name].dtype == FP8_DTYPE]
    if unquantized:
        cause = (
            f"this engine serves {len(unquantized)} tensors in float8 (block FP8, with their "
            "weight_scale_inv scales) that the push sends unquantized: push with "
            "Publisher(quantize='fp8-block') (docs/fp8.md)"
        )
        problems.append((cause, ()))  # the tensors are named one by one below
    if unknown:
        problems.append((f"unknown tensors: {unknown}", unknown))
    if missing:
        problems.append((f"missing tensors: {missing}", missing))
    problems.extend(
        (
            f"tensor {name!r}: expected {_describe(expected[name])}, got {_describe(stream[name])}",
            [name],
        )
        for name in mismatched
    )
    return problems


class Receiver:
    """Receives push sessions on one rank and feeds them to the model's `load_weights`.

    Args:
        load_weights: the model's loader: takes `(hf_name, tensor)` pairs (views that must be
            copied, not kept) and returns the names it loaded.
        expected: the model's tensors by HF name with full (unsharded) dtype and shape; the
            stream must carry exactly these.
        rank, tp_size: digests are split across ranks: this rank checks tensors
            `rank, rank + tp_size, ...` of the stream; the engine combines all verdicts.
        prefetch_depth: batches received ahead of the one being loaded.
        slices: the rank's parameters as slices of full tensors, for delta pushes (None:
            this rank refuses them).
    """

    def __init__(
        self,
        *,
        load_weights: LoadWeights,
        expected: Mapping[str, TensorMeta],
        rank: int = 0,
        tp_size: int = 1,
        prefetch_depth: int = 1,
        slices: SliceWriter | None = None,
    ) -> None:
        self.slices = slices
        self.load_weights = load_weights
        self.expected = dict(expected)
        self.rank = rank
        self.tp_size = tp_size
        self.prefetch_depth = prefetch_depth

    def receive(self, source: BucketSource, order: UpdateOrder) -> RankResult:
        """Receive one session from `source`; never raises for bad data, returns the verdict."""
        result = RankResult()
        deadline = time.monotonic() + order.timeout_s
        start = time.perf_counter()
        try:
            session = self._open(source, order, result, deadline)
            # even a refused session is consumed to its end (nothing is loaded after a
            # failure): a streaming publisher must never be left waiting on this rank
            self._consume(source, session, order, result, deadline)
            self._close(source, session, result, deadline)
            if session.last_bytes_at is not None:
                result.phases["tail_s"] = time.perf_counter() - session.last_bytes_at
        except TimeoutError as exc:
            result.timed_out = True
            result.fail(f"timed out after {order.timeout_s:g} s: {exc}")
        except (ValueError, OSError) as exc:
            result.fail(str(exc))
        finally:
            source.close()
        result.phases["total_s"] = time.perf_counter() - start
        if not result.ok:
            logger.warning("update %s failed: %s", order.version, "; ".join(result.errors))
        return result

    # open
    def _open(
        self, source: BucketSource, order: UpdateOrder, result: RankResult, deadline: float
    ) -> _Session:
        header = source.begin(_remaining(deadline))
        if header.version != order.version:
            result.fail(f"stream version {header.version!r} != requested {order.version!r}")
        plan = plan_buckets((m.to_meta() for m in header.tensors), header.bucket_bytes)
        if plan.plan_hash != header.plan_hash:
            result.fail(f"stream plan hash {header.plan_hash} does not match its own layout")
        if order.plan_hash is not None and order.plan_hash != header.plan_hash:
            result.fail(f"stale plan: stream has {header.plan_hash}, expected {order.plan_hash}")
        stream = {meta.name: meta for meta in plan.metas}
        delta = self._delta(order, result)
        if delta is not None:
            problems = delta.check_open(stream)
        else:
            problems = [] if order.delta else _layout_errors(stream, self.expected)
        for message, names in problems:
            result.fail(message, names)
        # direct mode: the publisher writes into the parameters from now on
        result.touched = result.touched or header.direct
        return _Session.of(header, delta)

    def _delta(self, order: UpdateOrder, result: RankResult) -> DeltaReceive | None:
        if order.delta is None:
            return None
        if self.slices is None:
            result.fail("this engine cannot apply a delta push")
            return None
        return DeltaReceive(order.delta, self.expected, self.slices, self.rank)

    # consume
    def _consume(
        self,
        source: BucketSource,
        session: _Session,
        order: UpdateOrder,
        result: RankResult,
        deadline: float,
    ) -> None:
        timings = {"wait_s": 0.0, "verify_s": 0.0, "load_s": 0.0}
        prefetcher = Prefetcher(source.batches(_remaining(deadline)), self.prefetch_depth)
        try:
            while True:
                tick = time.perf_counter()
                try:
                    batch = prefetcher.get(_remaining(deadline))
                except StopIteration:
                    break
                timings["wait_s"] += time.perf_counter() - tick
                if session.header.direct:
                    session.last_bytes_at = time.perf_counter()
                try:
                    self._check(batch, session, result)
                    if result.ok and order.verify == "full":
                        tick = time.perf_counter()
                        # a delta streams changes, not values: the Publisher checked those
                        check = not order.allow_nonfinite and session.delta is None
                        self._verify(batch, session, result, check_nonfinite=check)
                        timings["verify_s"] += time.perf_counter() - tick
                    if result.ok and batch.tensors:
                        tick = time.perf_counter()
                        self._load(batch, session, result)
                        timings["load_s"] += time.perf_counter() - tick
                    result.nbytes += batch.nbytes
                finally:
                    # After a failure the stream is still drained, so the publisher is never
                    # left waiting for this rank.
                    batch.release()
                    if not session.header.direct:
                        session.last_bytes_at = time.perf_counter()
        finally:
            prefetcher.close()
        result.phases.update(timings)

    def _check(self, batch: ReceivedBatch, session: _Session, result: RankResult) -> None:
        for name, tensor in batch.tensors:
            meta = session.metas.get(name)
            if meta is not None and (tensor.dtype, tuple(tensor.shape)) != (meta.dtype, meta.shape):
                got = TensorMeta.of(name, tensor)
                result.fail(
                    f"tensor {name!r}: header says {_describe(meta)}, got {_describe(got)}", [name]
                )
        for name in [name for name, _ in batch.tensors] + [name for name, _ in batch.placed]:
            if name not in session.metas:
                result.fail(f"tensor {name!r} is not in the session header", [name])
            elif name in session.seen:
                result.fail(f"tensor {name!r} arrived twice", [name])
            session.seen.add(name)
            if name in batch.digests:
                session.digests[name] = batch.digests[name]

    def _verify(
        self, batch: ReceivedBatch, session: _Session, result: RankResult, *, check_nonfinite: bool
    ) -> None:
        """Check this rank's share of the whole tensors (`session.order`) and the slices written
        into its parameters against their digests and, with `check_nonfinite`, for NaN/inf: one
        pass over each tensor's bytes (`checked_digest`)."""
        mine = [
            (name, tensor, batch.digests.get(name), _WHOLE_FAILURES)
            for name, tensor in batch.tensors
            if session.order[name] % self.tp_size == self.rank
        ]
        mine += [
            (name, region, batch.placed_digests.get(name), _PLACED_FAILURES)
            for name, region in batch.placed
            if region is not None  # else this rank holds no slice of it
        ]
        nonfinite = []
        for name, tensor, expected, (missing, corrupted) in mine:
            if expected is None:
                result.fail(f"tensor {name!r} {missing}", [name])
                continue
            digest, holds_nonfinite = checked_digest(tensor, check_nonfinite=check_nonfinite)
            if digest != expected:
                result.fail(f"digest mismatch for tensor {name!r}: {corrupted}", [name])
            elif holds_nonfinite:
                nonfinite.append((name, tensor))
        found = describe_nonfinite(nonfinite)
        if found:
            result.fail(
                f"non-finite values in {', '.join(found.values())} (the push did not allow them)",
                list(found),
            )

    def _load(self, batch: ReceivedBatch, session: _Session, result: RankResult) -> None:
        tensors = batch.tensors
        result.touched = True
        if session.delta is not None:
            tensors, parts = session.delta.split(tensors)
            for name, part, tensor in parts:
                try:
                    session.delta.take(name, part, tensor)
                except (ValueError, RuntimeError, IndexError) as exc:
                    result.fail(str(exc), [name])
                    return
            if not tensors:
                return
        names = [name for name, _ in tensors]
        try:
            loaded = set(self.load_weights(tensors))
        except (KeyError, ValueError, RuntimeError) as exc:
            result.fail(f"load_weights failed: {exc}", names)
            return
        not_loaded = sorted(set(names) - loaded)
        if not_loaded:
            result.fail(f"the model did not load tensors {not_loaded}", not_loaded)

    # close
    def _close(
        self, source: BucketSource, session: _Session, result: RankResult, deadline: float
    ) -> None:
        header = session.header
        end = source.end(_remaining(deadline))
        missing = sorted(set(session.metas) - session.seen)
        if missing:
            result.fail(f"stream ended without tensors {missing}", missing)
        if end.session_id != header.session_id or end.version != header.version:
            result.fail("stream end does not match its beginning (session or version)")
        if not result.ok:
            return
        records = [
            (m.name, m.dtype, m.shape, session.digests.get(m.name, "")) for m in header.tensors
        ]
        fingerprint = fingerprint_of_digests(records)
        if fingerprint != end.fingerprint:
            result.fail(f"fingerprint mismatch: stream {end.fingerprint}, computed {fingerprint}")
            return
        if session.delta is not None:
            self._close_delta(session.delta, session.digests, result)
            return
        result.fingerprint = fingerprint
        result.digests = session.digests

    @staticmethod
    def _close_delta(delta: DeltaReceive, digests: dict[str, str], result: RankResult) -> None:
        tick = time.perf_counter()
        for message, names in delta.close_errors(digests):
            result.fail(message, names)
        result.phases["delta_verify_s"] = time.perf_counter() - tick
        if result.ok:
            result.fingerprint = delta.spec.fingerprint
            result.digests = delta.digests()


# what `_verify` says of a tensor (sent whole) or slice (written into the parameters) that came
# without its digest, or whose bytes do not match it
_WHOLE_FAILURES = ("arrived without a digest", "its bytes are corrupted")
_PLACED_FAILURES = (
    "was written without a slice digest",
    "the slice written into this rank's parameters is corrupted",
)


def _remaining(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("update timed out")
    return remaining
