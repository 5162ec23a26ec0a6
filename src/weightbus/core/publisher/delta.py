"""Delta pushes on the publisher: when a push may be a delta, what each engine is told, and the
base every trainer rank keeps for the next one.

A push is a delta only when every engine can take it: the ranks hold a base (what each held of
the last version pushed, the same layout), the transport carries arbitrary tensors, every
engine reports its ranks' slice maps and serves the base's fingerprint. Anything else is a full
push, with the reason in `DeltaReport.reason`. An engine that refuses the delta anyway (409: it
no longer serves the base) gets the full push after it.

The leader decides (`DeltaState.plan`); every rank encodes its own changes (`EncodeStep`:
`RankBase.encode`, no gather), and once the leader has added up the counts and named each
tensor's kind (`StreamStep`), every rank sends its part of the delta's stream: the tensors that
go whole, and its segment of each sparse tensor's indices and values.
"""

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import torch

from weightbus.core.delta import CellChanges, RankBase, encode_cells, payload_names
from weightbus.core.delta.bits import index_dtype
from weightbus.core.digest import EMPTY_SLICE_DIGEST, fingerprint_of_metas
from weightbus.core.meta import TensorMeta, dtype_name
from weightbus.core.publisher.targets import EngineTarget
from weightbus.core.trainer.boxes import Box
from weightbus.core.trainer.cells import range_box
from weightbus.core.trainer.digests import Region
from weightbus.core.trainer.holdings import Holding
from weightbus.core.trainer.layout import HeldMeta, TrainerLayout
from weightbus.core.transport import BucketSink
from weightbus.core.transport.sending import RankWork
from weightbus.core.wire.delta import DELTA_BASE_REFUSAL, DeltaKind, DeltaSpec, DeltaTensor
from weightbus.core.wire.messages import SliceSpec

if TYPE_CHECKING:
    from weightbus.core.publisher.push_session import PushRequest
    from weightbus.core.publisher.ranks import TrainerRanks
    from weightbus.core.publisher.results import PushResult

# `never`: full pushes, no base kept. `always`: a delta whenever the engines can take one.
# `auto`: a delta when it carries at most `max_ratio` of a full push's bytes.
DeltaMode = Literal["auto", "never", "always"]
DELTA_MODES = ("auto", "never", "always")
DEFAULT_MAX_RATIO = 0.5


def check_delta_mode(mode: str) -> DeltaMode:
    """Raises: ValueError: `mode` is not one of `DELTA_MODES`."""
    if mode not in DELTA_MODES:
        raise ValueError(f"delta must be one of {', '.join(DELTA_MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaReport:
    """How a push was sent: as a delta (`sent`) or whole, and why.

    Attributes:
        sent: the engines received changes to `base_version`, not the whole version.
        reason: why the push was (or was not) a delta.
        changed_fraction: changed elements over all elements (None: not compared).
        tensors: per kind (`same`, `sparse`, `full`), how many tensors.
        stream_bytes, full_bytes: the bytes a delta carries, and a full push's.
        encode_s: seconds spent comparing with the base.
        prepare_s: seconds the publisher spent on the delta before sending: the new version's
            digests, the engines' checks, the comparison and the slice digests.
    """

    sent: bool
    reason: str
    base_version: str | None = None
    changed_fraction: float | None = None
    tensors: dict[str, int] | None = None
    stream_bytes: int = 0
    full_bytes: int = 0
    encode_s: float = 0.0
    prepare_s: float = 0.0

    @classmethod
    def full(cls, reason: str, figures: dict | None = None, base: str | None = None):
        return cls(sent=False, reason=reason, base_version=base, **(figures or {}))


class EncodeStep(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The leader's word: encode your changes to `changed` (`compare` False: none, they go
    whole)."""

    changed: list[str]
    compare: bool


class EncodeReport(msgspec.Struct, frozen=True, kw_only=True):
    """A rank's changed elements: per tensor, per cell it encodes, how many."""

    counts: dict[str, dict[int, int]]


class StreamStep(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The leader's word: the delta goes; each changed tensor's kind, and per sparse tensor
    the changed elements of each cell (where each owner's segment lies)."""

    kinds: dict[str, DeltaKind]
    counts: dict[str, list[int]]


@dataclass(slots=True)
class DeltaPlan:
    """A push decided to go as a delta: what the ranks stream and each engine's spec."""

    layout: TrainerLayout
    holdings: dict[str, Holding]
    digests: dict[str, str]
    fingerprint: str
    specs: dict[str, DeltaSpec]
    report: DeltaReport


@dataclass(slots=True)
class _Pending:
    """This rank's part of the push in flight: its changes, the kinds, and on the leader the
    version's identity."""

    changes: dict[str, list[CellChanges]] = field(default_factory=dict)
    kinds: dict[str, DeltaKind] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    fingerprint: str | None = None


class DeltaState:
    """A rank's base and, on the leader, what it learnt of its engines' slice maps.

    Args:
        max_ratio: `auto` sends a delta only when it carries at most this share of the bytes.
        sparse: send changed elements of changed tensors; False: changed tensors go whole
            (only unchanged tensors are skipped).
    """

    def __init__(self, max_ratio: float = DEFAULT_MAX_RATIO, sparse: bool = True) -> None:
        if not 0 < max_ratio <= 1:
            raise ValueError(f"delta_max_ratio must be in (0, 1], got {max_ratio}")
        self.max_ratio, self.sparse = max_ratio, sparse
        self.base: RankBase | None = None
        # engine URL -> its ranks' slice maps, and the expert map they follow (MoE engines)
        self._slice_maps: dict[str, list[list[SliceSpec]] | None] = {}
        self._expert_maps: dict[str, str | None] = {}
        self._pending = _Pending()
        self._pool = ThreadPoolExecutor(max_workers=max(torch.get_num_threads(), 1))

    @classmethod
    def of(cls, mode: str, max_ratio: float, sparse: bool) -> "DeltaState":
        """Raises: ValueError: an unknown mode or a ratio outside (0, 1]."""
        check_delta_mode(mode)
        return cls(max_ratio, sparse)

    @property
    def base_nbytes(self) -> int:
        """Host memory the base holds (a copy of what this rank pushed last)."""
        return 0 if self.base is None else self.base.nbytes

    def keeps_base(self, mode: DeltaMode) -> bool:
        """A whole push of `mode` becomes the next base (deltas on, or a base already kept)."""
        return mode != "never" or self.base is not None

    # --- the leader ---

    def plan(
        self,
        mode: DeltaMode,
        request: "PushRequest",
        *,
        targets: Sequence[EngineTarget],
        sink: BucketSink,
        ranks: "TrainerRanks",
        timeout_s: float,
    ) -> DeltaPlan | DeltaReport:
        """A delta plan for this push over `sink`, or the report of why it goes whole."""
        self._pending = _Pending()
        base = self.base
        if mode == "never":
            return DeltaReport.full("delta='never'")
        if base is None:
            return DeltaReport.full("no base: the first push with deltas on goes whole")
        if mode == "auto" and sink.copies_locally:
            why = f"auto: {sink.name} copies at memory speed, a delta would cost more than it saves"
            return DeltaReport.full(why, base=base.version)
        carries = sink.carries_any_tensors_from(ranks.group.world_size)
        why = base.mismatch(request.layout) or self._engines_cannot(targets, carries, timeout_s)
        if why:
            return DeltaReport.full(why, base=base.version)
        return self._encode(mode, request, targets, ranks, timeout_s)

    def _encode(
        self,
        mode: DeltaMode,
        request: "PushRequest",
        targets: Sequence[EngineTarget],
        ranks: "TrainerRanks",
        timeout_s: float,
    ) -> DeltaPlan | DeltaReport:
        """Encode the changes, then ask the engines whether they hold the base: last, so that
        no call that wakes an engine (vLLM's workers spin for 1 s after one) runs before the
        passes over the weights."""
        base, layout, round_ = self.base, request.layout, request.round
        assert base is not None
        digests = ranks.digests(round_, layout, request.holdings)
        start = time.perf_counter()
        changed = [
            meta.name for meta in layout.metas if digests[meta.name] != base.digests[meta.name]
        ]
        step = EncodeStep(changed=changed, compare=self.sparse)
        work = RankWork(
            holdings=request.holdings,
            layout=layout,
            group=ranks.group,
            key=round_.announce(step),
            deadline=round_.deadline,
        )
        counts = self.on_encode(step, work)
        for report in ranks.collect_reports(round_, work.key, "delta encoding", EncodeReport):
            for name, found in report.counts.items():
                counts.setdefault(name, {}).update(found)
        kinds, figures = delta_kinds(layout, changed, counts, self.sparse)
        figures["encode_s"] = time.perf_counter() - start
        ratio = figures["stream_bytes"] / max(figures["full_bytes"], 1)
        if mode == "auto" and ratio > self.max_ratio:
            why = (
                f"a delta would carry {ratio:.0%} of the bytes (auto: at most {self.max_ratio:.0%})"
            )
            return DeltaReport.full(why, figures, base.version)
        totals = {
            name: [
                counts[name].get(cell, 0) for cell in range(len(encode_cells(layout)[name] or []))
            ]
            for name, kind in kinds.items()
            if kind == "sparse"
        }
        fingerprint = fingerprint_of_metas(layout.metas, digests)
        specs = self._specs(
            request, targets, ranks, kinds=kinds, digests=digests, fingerprint=fingerprint
        )
        why = self._base_refusal(targets, timeout_s)
        if why:
            return DeltaReport.full(why, figures, base.version)
        stream = StreamStep(kinds=kinds, counts=totals)
        round_.announce(stream)
        self._pending.kinds = dict(stream.kinds)
        self._pending.digests, self._pending.fingerprint = digests, fingerprint
        stream_layout, holdings = delta_stream(
            layout, request.holdings, stream, self._pending.changes, ranks.rank
        )
        report = DeltaReport(
            sent=True, reason=f"delta on {base.version!r}", base_version=base.version, **figures
        )
        return DeltaPlan(stream_layout, holdings, digests, fingerprint, specs, report)

    def _engines_cannot(
        self, targets: Sequence[EngineTarget], carries_any_tensors: bool, timeout_s: float
    ) -> str | None:
        if not carries_any_tensors:
            return "the transport writes only into parameters (no delta over it)"
        for target in targets:
            if self._slice_map(target, timeout_s) is None:
                return f"engine {target.url} cannot apply a delta"
        return None

    def _base_refusal(self, targets: Sequence[EngineTarget], timeout_s: float) -> str:
        base = self.base
        assert base is not None
        for target in targets:
            why = target.delta_refusal(base.version, base.fingerprint or "", timeout_s)
            if why:
                return why
        return ""

    def _slice_map(self, target: EngineTarget, timeout_s: float) -> list[list[SliceSpec]] | None:
        if target.url not in self._slice_maps:
            self._expert_maps[target.url] = target.expert_map_hash(timeout_s)
            self._slice_maps[target.url] = target.slice_maps(timeout_s)
        return self._slice_maps[target.url]

    def forget_layouts(self) -> None:
        """Read the engines' slice maps again at the next delta (an engine refused a delta's
        base: its experts may have moved)."""
        self._slice_maps.clear()
        self._expert_maps.clear()

    def _specs(
        self,
        request: "PushRequest",
        targets: Sequence[EngineTarget],
        ranks: "TrainerRanks",
        *,
        kinds: dict[str, DeltaKind],
        digests: dict[str, str],
        fingerprint: str,
    ) -> dict[str, DeltaSpec]:
        assert self.base is not None
        layout = request.layout
        listed = [
            DeltaTensor(meta.name, kinds.get(meta.name, "same"), self.base.digests[meta.name],
                        digests[meta.name])
            for meta in layout.metas
        ]  # fmt: skip
        sparse = [tensor.name for tensor in listed if tensor.kind == "sparse"]
        maps = {target.url: self._slice_maps[target.url] or [] for target in targets}
        by_engine = _slice_digests(layout, request, ranks, maps, sparse=sparse, digests=digests)
        return {
            url: DeltaSpec(
                base_version=self.base.version,
                base_fingerprint=self.base.fingerprint or "",
                fingerprint=fingerprint,
                tensors=listed,
                rank_digests=by_engine[url],
                expert_map=self._expert_maps.get(url),
            )
            for url in maps
        }

    # --- every rank ---

    def step_handlers(self) -> dict[type, Any]:
        """What the other ranks do on the leader's delta words."""

        def encode(step: EncodeStep, work: RankWork, streams: dict) -> bytes:
            self._pending = _Pending()
            counts = self.on_encode(step, work)
            return msgspec.msgpack.encode(EncodeReport(counts=counts))

        def stream(step: StreamStep, work: RankWork, streams: dict) -> bytes:
            self._pending.kinds = dict(step.kinds)
            streams["delta"] = delta_stream(
                work.layout, work.holdings, step, self._pending.changes, work.group.rank
            )
            return b""

        return {EncodeStep: encode, StreamStep: stream}

    def on_encode(self, step: EncodeStep, work: RankWork) -> dict[str, dict[int, int]]:
        """This rank's changes to `step.changed` (kept for the stream and the base)."""
        assert self.base is not None, "a delta without a base"
        pool = self._pool if step.compare else None
        cells_of = encode_cells(work.layout)
        self._pending.changes = self.base.encode(
            step.changed, cells_of, work.holdings, work.group.rank, pool
        )
        return {
            name: {found.cell: found.indices.numel() for found in changed}
            for name, changed in self._pending.changes.items()
        }

    def whole_pushed(self, digests: Mapping[str, str], fingerprint: str) -> None:
        """The leader: a whole push's identity, for the base it becomes."""
        self._pending = _Pending(digests=dict(digests), fingerprint=fingerprint)

    def landed(self, result: "PushResult", held: Any, version: str, mode: DeltaMode) -> None:
        """A push landed on every engine: the base becomes its version (the same changes
        written into it, or a copy of what this rank held)."""
        pending, self._pending = self._pending, _Pending()
        if result.delta is not None and result.delta.sent and self.base is not None:
            full = [name for name, kind in pending.kinds.items() if kind == "full"]
            sparse = {n: c for n, c in pending.changes.items() if pending.kinds.get(n) == "sparse"}
            self.base.advance(sparse, full, held.holdings)
            self.base.version, self.base.fingerprint = version, result.fingerprint
            self.base.digests.update(pending.digests)
        elif self.keeps_base(mode) and result.adapter is None:
            self._keep(held, version, result.fingerprint, pending.digests)

    def committed_full(self, held: Any, version: str, digests: Mapping[str, str]) -> str:
        """`set_delta_base` on every rank: `held` is what the engines serve."""
        fingerprint = fingerprint_of_metas(held.layout.metas, digests)
        self._keep(held, version, fingerprint, digests)
        return fingerprint

    def _keep(self, held: Any, version: str, fingerprint: str, digests: Mapping[str, str]) -> None:
        base = self.base
        if base is not None and base.alike(held.holdings):
            base.replace(held.holdings)  # in the old base's buffers: no page faults
        else:
            self.base = base = None  # free the old copy before making the new one
            base = RankBase(held.holdings, held.layout.layout_hash, version=version)
            self.base = base
        base.layout_hash = held.layout.layout_hash
        base.version, base.fingerprint, base.digests = version, fingerprint, dict(digests)


def is_base_refusal(reason: str) -> bool:
    """An engine's answer says it does not serve the delta's base (its 409)."""
    return DELTA_BASE_REFUSAL in reason


def delta_kinds(
    layout: TrainerLayout, changed: list[str], counts: dict[str, dict[int, int]], sparse: bool
) -> tuple[dict[str, DeltaKind], dict]:
    """Each changed tensor's kind (sparse when its changes are smaller than it, its owners'
    segments in order), and the encoding's figures."""
    metas, cells_of = layout.metas_by_name, encode_cells(layout)
    kinds: dict[str, DeltaKind] = {}
    stream_bytes, changed_elements = 0, 0
    for name in changed:
        meta = metas[name]
        total = sum(counts.get(name, {}).values())
        changed_elements += total
        sparse_bytes = total * (index_dtype(meta.numel).itemsize + meta.element_bytes)
        if (
            sparse
            and cells_of[name] is not None
            and _in_order(cells_of[name])
            and (sparse_bytes < meta.nbytes)
        ):
            kinds[name] = "sparse"
            stream_bytes += sparse_bytes
        else:
            kinds[name] = "full"
            stream_bytes += meta.nbytes
    total_elements = sum(meta.numel for meta in layout.metas)
    figures = {
        # not compared (`sparse` off): unknown
        "changed_fraction": changed_elements / max(total_elements, 1) if sparse else None,
        "tensors": {
            "same": len(layout.metas) - len(changed),
            "sparse": sum(kind == "sparse" for kind in kinds.values()),
            "full": sum(kind == "full" for kind in kinds.values()),
        },
        "stream_bytes": stream_bytes,
        "full_bytes": sum(meta.nbytes for meta in layout.metas),
    }
    return kinds, figures


def _in_order(owned: list[tuple[int, Box]]) -> bool:
    """Each owner's cells follow one another (its segment of the payload is one range)."""
    seen: list[int] = []
    for owner, _ in owned:
        if seen and seen[-1] == owner:
            continue
        if owner in seen:
            return False
        seen.append(owner)
    return True


def delta_stream(
    layout: TrainerLayout,
    holdings: Mapping[str, Holding],
    step: StreamStep,
    changes: Mapping[str, list[CellChanges]],
    rank: int,
) -> tuple[TrainerLayout, dict[str, Holding]]:
    """The delta's stream, as every rank holds it (the same layout on every rank), and this
    rank's holdings of it: the tensors that go whole as they are held, and per sparse tensor
    each owner's segment of its indices and values."""
    cells_of = encode_cells(layout)
    by_rank: list[list[HeldMeta]] = [[] for _ in range(layout.world_size)]
    mine: dict[str, Holding] = {}
    for meta in layout.metas:
        kind = step.kinds.get(meta.name)
        if kind == "full":
            for holder, box in layout.holders(meta.name):
                by_rank[holder].append(
                    HeldMeta(meta.name, dtype_name(meta.dtype), tuple(meta.shape), box)
                )
            if meta.name in holdings:
                mine[meta.name] = holdings[meta.name]
        elif kind == "sparse":
            owned = cells_of[meta.name] or []
            segments = _segments(owned, step.counts[meta.name])
            _sparse_stream(
                meta, segments, changes.get(meta.name, []), rank=rank, by_rank=by_rank, mine=mine
            )
    return TrainerLayout(tuple(tuple(held) for held in by_rank)), mine


def _segments(owned: list[tuple[int, Box]], counts: list[int]) -> dict[int, tuple[int, int]]:
    """Each owner's range of a sparse tensor's payload (its cells' changes, in cell order)."""
    ends = list(accumulate(counts))
    segments: dict[int, tuple[int, int]] = {}
    for cell, (owner, _) in enumerate(owned):
        low, high = ends[cell] - counts[cell], ends[cell]
        first, _ = segments.get(owner, (low, low))
        segments[owner] = (first, high)
    return segments


def _sparse_stream(
    meta: TensorMeta,
    segments: dict[int, tuple[int, int]],
    changes: list[CellChanges],
    *,
    rank: int,
    by_rank: list[list[HeldMeta]],
    mine: dict[str, Holding],
) -> None:
    total = max((high for _, high in segments.values()), default=0)
    index_meta = TensorMeta(payload_names(meta.name)[0], index_dtype(meta.numel), (total,))
    value_meta = TensorMeta(payload_names(meta.name)[1], meta.dtype, (total,))
    for owner, (low, high) in segments.items():
        if low == high:
            continue
        box = Box(low, high, 0, 1)
        for part in (index_meta, value_meta):
            by_rank[owner].append(HeldMeta(part.name, dtype_name(part.dtype), part.shape, box))
        if owner == rank:
            found = sorted(changes, key=lambda each: each.cell)
            indices = torch.cat([each.indices for each in found]).to(index_meta.dtype)
            values = torch.cat([each.values for each in found])
            mine[index_meta.name] = Holding(index_meta, box, indices)
            mine[value_meta.name] = Holding(value_meta, box, values)


def _slice_digests(
    layout: TrainerLayout,
    request: "PushRequest",
    ranks: "TrainerRanks",
    maps: dict[str, list[list[SliceSpec]]],
    *,
    sparse: list[str],
    digests: dict[str, str],
) -> dict[str, list[list[str]]]:
    """Per engine, per rank: the digest of its slice of each sparse tensor (the new version),
    the trainer ranks digesting the slices' regions together (no gather)."""
    metas = layout.metas_by_name
    regions: list[Region] = []
    where: dict[Region, int] = {}
    rows: dict[str, list[list[Region | str]]] = {}
    for url, slice_map in maps.items():
        rows[url] = []
        for specs in slice_map:
            by_name = {spec.name: spec for spec in specs}
            row: list[Region | str] = []
            for name in sparse:
                spec = by_name.get(name)
                if spec is None:
                    raise ValueError(f"engine {url}: a rank's slice map lacks tensor {name!r}")
                if spec.length == 0:  # the rank holds none of it (another rank's expert)
                    row.append(EMPTY_SLICE_DIGEST)
                    continue
                box = range_box(metas[name], spec.dim, spec.start, spec.length)
                if box == Box.whole(metas[name].shape):
                    row.append(digests[name])
                    continue
                region = Region(name, box)
                where.setdefault(region, len(regions))
                if where[region] == len(regions):
                    regions.append(region)
                row.append(region)
            rows[url].append(row)
    found = ranks.region_digests(request.round, layout, request.holdings, regions)
    return {
        url: [[x if isinstance(x, str) else found[where[x]] for x in row] for row in table]
        for url, table in rows.items()
    }
