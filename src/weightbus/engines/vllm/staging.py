"""Stage, then load: a vLLM rank keeps a whole push in reusable buffers until every rank has
verified it, so a killed, corrupted or refused push never reaches vLLM's parameters.

Staging costs one copy of this worker's part of the pushed tensors (in full-shaped buffers:
vLLM's loaders narrow them to the rank's shard; the rest is never backed by memory), allocated
by the first push and reused by every later push of the same layout, so later pushes write at
memcpy speed instead of faulting fresh pages in. Transports that write into a rank's memory
(`shm` direct mode, `nixl`) write each part straight into the staging: no copy on the worker.
A set of buffers that holds a whole verified version says which (`HeldVersion`): the base of a
delta, a staged two-phase version, or the previous version a rollback loads again.
"""

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from weightbus.core.checkpoint import safetensors_files, safetensors_metas
from weightbus.core.delta import apply_to_slice, slice_of
from weightbus.core.digest import tensor_digest
from weightbus.core.meta import TensorMeta
from weightbus.core.plan.shard import ShardCopy
from weightbus.core.transport import (
    DirectPlacement,
    ParamArena,
    direct_placement,
    remove_stale_slots,
)
from weightbus.core.wire.messages import SliceSpec
from weightbus.engines.vllm.experts import expert_block

# a child of vLLM's logger: vLLM configures handlers for its own tree only
logger = logging.getLogger("vllm.weightbus")

# The head of a tied model is its embedding: checkpoints may or may not carry it, pushes do not.
TIED_HEAD = "lm_head.weight"


def checkpoint_metas(
    model_dir: str | Path, dtype: torch.dtype, tied: bool
) -> dict[str, TensorMeta]:
    """The tensors a push must carry, from the served checkpoint's safetensors headers: names
    and full shapes as saved, floating tensors in the dtype vLLM serves.

    Raises:
        FileNotFoundError: `model_dir` holds no safetensors checkpoint.
        ValueError: a file is not safetensors, or holds a dtype weightbus does not carry.
    """
    metas = {}
    for name, (saved, _) in safetensors_metas(safetensors_files(model_dir)).items():
        served = dtype if saved.dtype.is_floating_point else saved.dtype
        metas[name] = TensorMeta(name, served, saved.shape)
    if tied:
        metas.pop(TIED_HEAD, None)
    return metas


@dataclass(frozen=True, slots=True)
class AppliedDelta:
    """The delta last received into a set of buffers: what turns the version of fingerprint
    `base_fingerprint` into the one they hold, so another set holding that base catches up by
    applying it again instead of copying every byte.

    Attributes:
        whole: the tensors it carried whole.
        changes: its sparse changes as applied, `(name, flat indices in the full tensor,
            values)`.
    """

    base_fingerprint: str
    whole: list[str]
    changes: list[tuple[str, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class HeldVersion:
    """A verified version, every tensor of which a set of staging buffers holds whole."""

    version: str
    step: int | None
    fingerprint: str
    digests: dict[str, str]

    def summary(self) -> dict:
        """What the control plane reports of it (a rollback's target: version, step,
        fingerprint)."""
        return {"version": self.version, "step": self.step, "fingerprint": self.fingerprint}


class StagingBuffers:
    """One full-shaped buffer per tensor name, all in one `ParamArena` (a file under /dev/shm,
    or private memory where /dev/shm cannot hold it); of a tensor this worker loads a part of
    (`slices`) only that part is written and backed by memory, where vLLM's loader narrows to
    it (the rest of the buffer is a hole). Transports that write into a rank's memory (`shm`
    direct mode, `nixl`) write each part straight into it (`placement`); the others go
    through `put`, a `Receiver` loader that copies into it. `apply` and `digest` make the
    buffers a delta's `SliceWriter`.

    Attributes:
        slices: the part of each tensor this worker loads (absent: all of it).
        held: the verified version the buffers hold (None: none, or overwritten since).
        applied: the delta received into them last (None: the last push was whole).
    """

    def __init__(self, slices: dict[str, SliceSpec] | None = None) -> None:
        self._metas: dict[str, TensorMeta] = {}
        self._arena: ParamArena | None = None
        self._placement: DirectPlacement | None = None
        self.slices = slices or {}
        self.held: HeldVersion | None = None
        self.applied: AppliedDelta | None = None

    def prepare(self, metas: Mapping[str, TensorMeta]) -> None:
        """Hold a buffer for each tensor of `metas`: the memory of the same layout is kept
        (and what it holds); another layout replaces it (holding nothing)."""
        if metas == self._metas:
            return
        self.release()
        layout = [
            (name, torch.empty(meta.shape, dtype=meta.dtype, device="meta"))
            for name, meta in metas.items()
        ]
        written = {
            name: _written_ranges(metas[name], spec)
            for name, spec in self.slices.items()
            if name in metas
        }
        remove_stale_slots()  # staging files of killed workers
        try:
            self._arena = ParamArena(layout, written=written)
        except OSError as exc:
            logger.warning("weightbus: staging in private memory (no shm direct writes): %s", exc)
            self._arena = ParamArena(layout, shared=False)
        self._metas = dict(metas)

    @property
    def _buffers(self) -> dict[str, torch.Tensor]:
        """Each tensor's full-shaped buffer: its view into the arena."""
        return {} if self._arena is None else self._arena.views

    def placement(self, *, shared: bool) -> DirectPlacement | None:
        """Where a transport writes each part straight into these buffers (None: nothing
        allocated, or `shared` asked of private memory)."""
        arena = self._arena
        if arena is None or (shared and not arena.shared):
            return None
        if self._placement is None:
            # an expert another expert-parallel rank holds: no bytes, no region
            absent = [name for name in self._buffers if self._absent(name)]
            copies = [(name, name, self._copy(name)) for name in self._buffers
                      if not self._absent(name)]  # fmt: skip
            self._placement = direct_placement(arena, copies, absent)
        return self._placement

    def _absent(self, name: str) -> bool:
        spec = self.slices.get(name)
        return spec is not None and spec.length == 0

    def _copy(self, name: str) -> ShardCopy:
        spec = self.slices.get(name)
        if spec is None:
            return ShardCopy.whole(tuple(self._buffers[name].shape))
        return ShardCopy(spec.dim, spec.start, spec.dim, spec.start, spec.length)

    def put(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy each tensor's part into its buffer.

        Raises:
            KeyError: a tensor these buffers were not prepared for, or of another shape.
        """
        names = []
        for name, tensor in pairs:
            buffer = self._buffers.get(name)
            if buffer is None or buffer.dtype != tensor.dtype or buffer.shape != tensor.shape:
                raise KeyError(
                    f"the staging buffers hold no {tensor.dtype} {tuple(tensor.shape)} {name!r}"
                )
            spec = self.slices.get(name)
            if spec is None:
                buffer.copy_(tensor)
            else:
                slice_of(buffer, spec).copy_(slice_of(tensor, spec))
            names.append(name)
        return names

    def pairs(self, names: Iterable[str]) -> list[tuple[str, torch.Tensor]]:
        return [(name, self._buffers[name]) for name in names]

    def catch_up(self, other: "StagingBuffers") -> None:
        """Hold what `other` holds (the base of a delta received into these buffers, prepared
        for the same tensors): where these hold the version `other`'s last delta started
        from, by applying that delta again (its changed elements and whole tensors), else by
        copying every part."""
        last = other.applied
        if last is not None and self.held is not None:
            replay = last.base_fingerprint == self.held.fingerprint
        else:
            replay = False
        if replay:
            assert last is not None
            self.put(other.pairs(last.whole))
            for name, indices, values in last.changes:
                self.apply(name, indices, values)
        else:
            self.put(other.pairs(list(other._buffers)))
        self.held = other.held

    # a delta's SliceWriter
    def apply(self, name: str, indices: torch.Tensor, values: torch.Tensor) -> None:
        if self.applied is not None:
            self.applied.changes.append((name, indices, values))
        buffer, spec = self._buffers[name], self.slices.get(name)
        if spec is None:
            copy = ShardCopy.whole(tuple(buffer.shape))
        else:
            copy = ShardCopy(spec.dim, spec.start, spec.dim, 0, spec.length)
        destination = buffer if spec is None else slice_of(buffer, spec)
        apply_to_slice(destination, tuple(buffer.shape), copy, indices, values)

    def digest(self, name: str) -> str:
        buffer, spec = self._buffers[name], self.slices.get(name)
        return tensor_digest(buffer if spec is None else slice_of(buffer, spec))

    @property
    def nbytes(self) -> int:
        """The memory these buffers hold once every part was written (0: none yet)."""
        return 0 if self._arena is None else self._arena.reserved_bytes

    def release(self) -> None:
        if self._arena is not None:
            self._arena.close()
        self._arena = self._placement = None
        self._metas.clear()
        self.held = self.applied = None


def _written_ranges(meta: TensorMeta, spec: SliceSpec) -> list[tuple[int, int]]:
    """The byte ranges `[start, stop)` of a full row-major tensor that hold part `spec`: one
    run per index of the dimensions before `spec.dim`."""
    if not meta.shape:
        return [(0, meta.nbytes)]
    inner = math.prod(meta.shape[spec.dim + 1 :]) * meta.dtype.itemsize
    stride = meta.shape[spec.dim] * inner
    start, stop = spec.start * inner, (spec.start + spec.length) * inner
    outer = math.prod(meta.shape[: spec.dim])
    return [(index * stride + start, index * stride + stop) for index in range(outer)]


def load_group(name: str) -> str:
    """The block a checkpoint tensor is loaded with: its module's parent
    (`model.layers.0.self_attn` for `...self_attn.q_proj.weight`), for an expert's matrix its
    MoE block (`model.layers.0.mlp` for `...mlp.experts.17.gate_proj.weight`: every expert of
    a layer lands in one fused parameter). vLLM fuses tensors only inside such a block (q/k/v
    into `qkv_proj`, gate/up into `gate_up_proj`, experts into `w13_weight` and `w2_weight`),
    so loading or skipping whole blocks never hands vLLM part of a fused parameter."""
    block = expert_block(name)
    if block is not None:
        return block
    parts = name.split(".")
    return ".".join(parts[:-2]) if len(parts) > 2 else name


def changed_tensors(digests: Mapping[str, str], loaded: Mapping[str, str] | None) -> list[str]:
    """The tensors to load: every tensor of a block in which any tensor's digest differs from
    the one loaded last (all of them when nothing is known of the loaded version)."""
    if loaded is None:
        return sorted(digests)
    stale_groups = {load_group(n) for n, digest in digests.items() if loaded.get(n) != digest}
    return sorted(name for name in digests if load_group(name) in stale_groups)
