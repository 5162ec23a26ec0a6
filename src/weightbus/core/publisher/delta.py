"""Delta pushes on the publisher: when a push may be a delta, what each engine is told, and the
base kept for the next one.

A push is a delta only when every engine can take it: this Publisher holds a base (the last
version it pushed, same tensors), the transport carries arbitrary tensors (not `nixl`, which
writes only into parameters), every engine reports its ranks' slice maps and serves the base's
fingerprint. Anything else is a full push, with the reason in `DeltaReport.reason`. An engine
that refuses the delta anyway (409: it no longer serves the base) gets the full push after it.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec
import torch

from weightbus.core.delta import DeltaBase, DeltaEncoding, rank_digests, version_digests
from weightbus.core.publisher.targets import EngineTarget
from weightbus.core.transport import BucketSink
from weightbus.core.wire.delta import DELTA_BASE_REFUSAL, DeltaSpec
from weightbus.core.wire.messages import SliceSpec

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
    def full(cls, reason: str, encoding: DeltaEncoding | None = None, base: str | None = None):
        if encoding is None:
            return cls(sent=False, reason=reason, base_version=base)
        return cls(sent=False, **_figures(encoding), reason=reason, base_version=base)


def _figures(encoding: DeltaEncoding) -> dict:
    return {
        "changed_fraction": encoding.changed_fraction,
        "tensors": {kind: encoding.count(kind) for kind in ("same", "sparse", "full")},
        "stream_bytes": encoding.stream_bytes,
        "full_bytes": encoding.full_bytes,
        "encode_s": encoding.encode_s,
    }


@dataclass(slots=True)
class DeltaPlan:
    """A push decided to go as a delta: its encoding and each engine's spec."""

    encoding: DeltaEncoding
    digests: dict[str, str]
    fingerprint: str
    specs: dict[str, DeltaSpec]
    report: DeltaReport

    @property
    def stream(self) -> dict[str, torch.Tensor]:
        return dict(self.encoding.stream)


class DeltaState:
    """A Publisher's base and what it learnt of its engines' slice maps.

    Args:
        max_ratio: `auto` sends a delta only when it carries at most this share of the bytes.
        sparse: send changed elements of changed tensors; False: changed tensors go whole
            (only unchanged tensors are skipped).
    """

    def __init__(self, max_ratio: float = DEFAULT_MAX_RATIO, sparse: bool = True) -> None:
        if not 0 < max_ratio <= 1:
            raise ValueError(f"delta_max_ratio must be in (0, 1], got {max_ratio}")
        self.max_ratio = max_ratio
        self.sparse = sparse
        self.base: DeltaBase | None = None
        self._slice_maps: dict[str, list[list[SliceSpec]] | None] = {}

    @property
    def base_nbytes(self) -> int:
        """Host memory the base holds (a copy of the last version pushed)."""
        return 0 if self.base is None else self.base.nbytes

    def forget(self, url: str | None = None) -> None:
        """Drop what is known of an engine's slice map (all engines': None)."""
        if url is None:
            self._slice_maps.clear()
        else:
            self._slice_maps.pop(url, None)

    def plan(
        self,
        mode: DeltaMode,
        tensors: Mapping[str, torch.Tensor],
        targets: Sequence[EngineTarget],
        sink: BucketSink,
        timeout_s: float,
    ) -> DeltaPlan | DeltaReport:
        """A delta plan for this push over `sink`, or the report of why it goes whole."""
        base = self.base
        if mode == "never":
            return DeltaReport.full("delta='never'")
        if base is None:
            return DeltaReport.full("no base: the first push with deltas on goes whole")
        if mode == "auto" and sink.copies_locally:
            why = f"auto: {sink.name} copies at memory speed, a delta would cost more than it saves"
            return DeltaReport.full(why, base=base.version)
        carries_any_tensors = sink.carries_any_tensors
        why = base.mismatch(tensors) or self._engines_refuse(
            targets, carries_any_tensors, timeout_s
        )
        if why:
            return DeltaReport.full(why, base=base.version)
        digests, fingerprint = version_digests(tensors)
        encoding = base.encode(tensors, digests, sparse=self.sparse)
        ratio = encoding.stream_bytes / max(encoding.full_bytes, 1)
        if mode == "auto" and ratio > self.max_ratio:
            reason = (
                f"a delta would carry {ratio:.0%} of the bytes (auto: at most {self.max_ratio:.0%})"
            )
            return DeltaReport.full(reason, encoding, base.version)
        specs = self._specs(encoding, digests, fingerprint, tensors, targets)
        report = DeltaReport(
            sent=True,
            reason=f"delta on {base.version!r}",
            base_version=base.version,
            **_figures(encoding),
        )
        return DeltaPlan(encoding, digests, fingerprint, specs, report)

    def _engines_refuse(
        self, targets: Sequence[EngineTarget], carries_any_tensors: bool, timeout_s: float
    ) -> str | None:
        assert self.base is not None
        if not carries_any_tensors:
            return "the transport writes only into parameters (no delta over it)"
        for target in targets:
            if self._slice_map(target, timeout_s) is None:
                return f"engine {target.url} cannot apply a delta"
            served = target.weights(timeout_s).fingerprint
            if served != self.base.fingerprint:
                return f"engine {target.url} does not serve the base {self.base.version!r}"
        return None

    def _slice_map(self, target: EngineTarget, timeout_s: float) -> list[list[SliceSpec]] | None:
        if target.url not in self._slice_maps:
            self._slice_maps[target.url] = target.slice_maps(timeout_s)
        return self._slice_maps[target.url]

    def _specs(
        self,
        encoding: DeltaEncoding,
        digests: dict[str, str],
        fingerprint: str,
        tensors: Mapping[str, torch.Tensor],
        targets: Sequence[EngineTarget],
    ) -> dict[str, DeltaSpec]:
        assert self.base is not None
        listed = self.base.tensor_list(encoding, digests)
        sparse = [t.name for t in listed if t.kind == "sparse"]
        by_layout: dict[bytes, list[list[str]]] = {}
        specs = {}
        for target in targets:
            slice_map = self._slice_maps[target.url]
            assert slice_map is not None
            key = msgspec.msgpack.encode(slice_map)
            if key not in by_layout:
                by_layout[key] = rank_digests(slice_map, sparse, tensors, digests)
            specs[target.url] = DeltaSpec(
                base_version=self.base.version,
                base_fingerprint=self.base.fingerprint,
                fingerprint=fingerprint,
                tensors=listed,
                rank_digests=by_layout[key],
            )
        return specs

    def keeps_base(self, mode: DeltaMode) -> bool:
        """A whole push of `mode` becomes the next base (deltas on, or a base already kept)."""
        return mode != "never" or self.base is not None

    def committed_delta(
        self, plan: DeltaPlan, tensors: Mapping[str, torch.Tensor], version: str
    ) -> None:
        """The delta landed: the base becomes its version."""
        assert self.base is not None
        self.base.advance(plan.encoding, tensors, version, plan.fingerprint, plan.digests)

    def committed_full(
        self,
        tensors: Mapping[str, torch.Tensor],
        version: str,
        fingerprint: str,
        digests: Mapping[str, str],
    ) -> None:
        """A full push landed: keep a copy of it as the next base (in the old base's buffers
        when the tensors are alike: no page faults)."""
        if self.base is not None and self.base.mismatch(tensors) is None:
            self.base.replace(tensors, version, fingerprint, digests)
        else:
            self.base = None  # free the old copy before making the new one
            self.base = DeltaBase(version, fingerprint, tensors, digests)


def is_base_refusal(reason: str) -> bool:
    """An engine's answer says it does not serve the delta's base (its 409)."""
    return DELTA_BASE_REFUSAL in reason
