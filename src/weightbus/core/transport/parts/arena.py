"""Direct mode, engine side: a rank's parameters in one shared-memory file.

A `ParamArena` is one file under /dev/shm (mode 0600, named `weightbus-params-<pid>-<random>`)
holding every parameter of a model at 256-byte aligned offsets. Its space is reserved with
`posix_fallocate`, so a full /dev/shm is an `OSError` at allocation, never a SIGBUS later (an
arena made with `written` reserves those pages only: reading or writing a hole backs it, and
can SIGBUS on a full /dev/shm).
`adopt(model)` moves the parameters into it (one copy, when the arena is made); afterwards a
co-located publisher writes each update straight into them (`DirectTarget` tells it where).
"""

import mmap
import os
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import msgspec
import torch
import xxhash

from weightbus.core.meta import dtype_name
from weightbus.core.plan.bucket import ALIGN_BYTES, align_up
from weightbus.core.plan.shard import ShardCopy
from weightbus.core.transport.parts.layout import region_view
from weightbus.core.transport.parts.shared_memory import ARENA_PREFIX, SHM_DIR
from weightbus.core.wire import DirectTarget, ParamRegion, WireShardCopy

# Called with an arena's name when it closes: transports that registered its memory elsewhere
# (a NIXL agent) let go of it, so a released arena is freed at once.
_close_listeners: list[Callable[[str], None]] = []


def on_arena_close(listener: Callable[[str], None]) -> None:
    """Call `listener(arena name)` whenever an arena of this process closes."""
    if listener not in _close_listeners:
        _close_listeners.append(listener)


PAGE_BYTES = mmap.PAGESIZE


class ParamArena:
    """Named parameters laid out in one shared-memory file (or one block of private memory).

    Args:
        params: `(name, tensor)` pairs whose dtypes and shapes define the layout (the values
            are not copied; see `adopt`).
        written: per name, the byte ranges `[start, stop)` of its tensor that will ever be
            written (reserved, page by page; the rest stays a hole, backed by no memory until
            something reads or writes it); absent names: all of it. A vLLM worker's staging
            holds full-shaped tensors of which it writes its TP slice only.
        shared: in a file under /dev/shm (another process can map it: `shm` direct mode);
            else in this process's private memory (`nixl` can still register it).

    Raises:
        OSError: /dev/shm cannot hold the parameters (the file is removed again).
    """

    def __init__(
        self,
        params: Iterable[tuple[str, torch.Tensor]],
        *,
        written: Mapping[str, Sequence[tuple[int, int]]] | None = None,
        shared: bool = True,
    ) -> None:
        params = list(params)
        self.regions: list[ParamRegion] = []
        offset = 0
        for name, tensor in params:
            shape = tuple(tensor.shape)
            self.regions.append(ParamRegion(name, dtype_name(tensor.dtype), shape, offset))
            offset += align_up(tensor.numel() * tensor.element_size())
        self.nbytes = max(offset, ALIGN_BYTES)
        self.shared = shared
        self.name = f"{ARENA_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        spans = None if written is None else self._spans(params, written)
        # the memory the arena holds once every written byte was written
        self.reserved_bytes = self.nbytes if spans is None else sum(n for _, n in spans)
        if shared:  # `memory`: the whole arena as one `uint8` tensor
            self._mmap = self._map_file(spans)
            self.memory = torch.frombuffer(self._mmap, dtype=torch.uint8)
        else:
            self._mmap = None
            self.memory = torch.empty(self.nbytes, dtype=torch.uint8)
        self.views = {region.name: region_view(self.memory, region) for region in self.regions}

    def _map_file(self, spans: list[tuple[int, int]] | None) -> mmap.mmap:
        fd = os.open(SHM_DIR / self.name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            if spans is None:
                os.posix_fallocate(fd, 0, self.nbytes)
            else:
                os.ftruncate(fd, self.nbytes)
                for start, nbytes in spans:
                    os.posix_fallocate(fd, start, nbytes)
            return mmap.mmap(fd, self.nbytes)
        except OSError:
            self.unlink()
            raise
        finally:
            os.close(fd)

    def _spans(
        self,
        params: list[tuple[str, torch.Tensor]],
        written: Mapping[str, Sequence[tuple[int, int]]],
    ) -> list[tuple[int, int]]:
        """`(offset, nbytes)` of the file's pages that `written` says will be written, merged."""
        pages: list[tuple[int, int]] = []
        for region, (name, tensor) in zip(self.regions, params, strict=True):
            ranges = written.get(name, [(0, tensor.numel() * tensor.element_size())])
            for start, stop in ranges:
                if stop > start:
                    first = (region.offset + start) // PAGE_BYTES * PAGE_BYTES
                    end = -(-(region.offset + stop) // PAGE_BYTES) * PAGE_BYTES
                    pages.append((first, min(end, self.nbytes)))
        merged: list[list[int]] = []
        for start, end in sorted(pages):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return [(start, end - start) for start, end in merged]

    def adopt(self, model: torch.nn.Module, *, copy: bool = True) -> None:
        """Point every parameter of `model` at its place in the arena (copying its values)."""
        for name, param in model.named_parameters():
            view = self.views[name]
            if copy:
                view.copy_(param.data)
            param.data = view

    def unlink(self) -> None:
        """Remove the file's name (the memory lives until every mapping is gone)."""
        if self.shared:
            (SHM_DIR / self.name).unlink(missing_ok=True)

    def close(self) -> None:
        """Unlink and drop this arena's references: the memory is unmapped (and freed) once
        no tensor views it any more; parameters still pointing here stay valid until then."""
        self.unlink()
        self.views.clear()
        self.memory = None
        self._mmap = None
        for listener in _close_listeners:
            listener(self.name)


@dataclass(frozen=True, slots=True)
class DirectPlacement:
    """What a rank offers for direct writes, and where each tensor's slice lands locally.

    Attributes:
        target: the wire description sent in `ReceiverHello.direct`.
        regions: HF name -> the parameter region the publisher fills (a view into the arena).
        memory: the whole arena as bytes (what a transport registers for remote writes).
    """

    target: DirectTarget
    regions: dict[str, torch.Tensor]
    memory: torch.Tensor | None = None


def direct_placement(
    arena: ParamArena,
    copies: Iterable[tuple[str, str, ShardCopy]],
    absent: Iterable[str] = (),
) -> DirectPlacement | None:
    """The direct target of `arena` for a model's slice map (`model.shard_copies()`) and the
    model's tensors of which this rank holds no part (`absent`).

    Returns None when a copy cannot be expressed as one narrowed dimension on both sides.
    """
    wire_copies, regions = [], {}
    for hf_name, param_name, copy in copies:
        if copy.src_dim != copy.dst_dim:
            return None
        wire_copies.append(
            WireShardCopy(
                hf_name,
                param_name,
                copy.dst_dim,
                copy.src_start,
                copy.dst_start,
                copy.length,
                copy.dst_slot,
            )
        )
        regions[hf_name] = copy.destination(arena.views[param_name])
    absent = sorted(absent)
    layout = msgspec.msgpack.encode([arena.regions, wire_copies, absent])
    target = DirectTarget(
        file=arena.name,
        nbytes=arena.nbytes,
        layout_hash=xxhash.xxh3_128_hexdigest(layout),
        params=arena.regions,
        copies=wire_copies,
        absent=absent,
    )
    return DirectPlacement(target, regions, arena.memory)
