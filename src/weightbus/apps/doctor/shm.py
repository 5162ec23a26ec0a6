"""Shared memory against a model size: what a push keeps there on this host.

A `weightbus serve` engine keeps each rank's parameters in a file under /dev/shm (a
`ParamArena`), and an atomic push (the default) a staging copy beside them: a co-located `shm`
push writes straight into them (direct mode). Where /dev/shm cannot hold them, the engine keeps
its parameters in private memory and `shm` streams through its slots instead (slower). `disk` and
`hf_dir` write a copy of the version under /dev/shm by default.
"""

import os
from dataclasses import dataclass, field
from pathlib import Path

from weightbus.core.plan.planner import DEFAULT_BUCKET_BYTES
from weightbus.core.transport.parts.shared_memory import SHM_DIR
from weightbus.core.transport.shm.sink import DEFAULT_NUM_SLOTS

SHM_MOUNT = "mount -t tmpfs -o size=<N>G tmpfs /dev/shm (as root)"
_GIB = 2**30


@dataclass(frozen=True, slots=True)
class ShmUse:
    """One way a push uses /dev/shm: what it keeps there and whether that fits now."""

    name: str
    need_bytes: int
    fits: bool


@dataclass(frozen=True, slots=True)
class ShmReport:
    """Attributes:
    size_bytes, free_bytes: of the file system at /dev/shm (0 when there is none).
    model_bytes: the model size asked about, or None.
    fits: whether the default push (atomic, `shm` direct into one engine) fits, or None.
    uses: what each way of pushing `model_bytes` keeps in /dev/shm.
    fix: the line that makes /dev/shm larger, when the default push does not fit.
    """

    size_bytes: int
    free_bytes: int
    model_bytes: int | None = None
    fits: bool | None = None
    uses: list[ShmUse] = field(default_factory=list)
    fix: str | None = None


def shm_size_bytes(stat: os.statvfs_result) -> int:
    return stat.f_blocks * stat.f_frsize


def shm_free_bytes(stat: os.statvfs_result) -> int:
    """Bytes a process may still write there."""
    return stat.f_bavail * stat.f_frsize


def shm_resize(size_gib: int) -> str:
    """The line that gives /dev/shm `size_gib` GiB."""
    return (
        f"mount -o remount,size={size_gib}G /dev/shm (as root), "
        f"or docker run --shm-size={size_gib}g"
    )


def resized_gib(size_bytes: int, free_bytes: int, need_bytes: int) -> int:
    """The size in GiB /dev/shm needs for `need_bytes` more, next to what it holds now."""
    return -(-(size_bytes - free_bytes + need_bytes) // _GIB)


def shm_uses(model_bytes: int, free_bytes: int) -> list[ShmUse]:
    """Each way of pushing `model_bytes` into one co-located engine, with what it keeps in
    /dev/shm (every more engine on this host keeps as much again, slots excepted)."""
    needs = {
        "shm direct, atomic (default): parameters + staging": 2 * model_bytes,
        "shm direct, atomic=False: parameters": model_bytes,
        "shm slots (engine --no-shm-weights)": DEFAULT_NUM_SLOTS * DEFAULT_BUCKET_BYTES,
        "disk / hf_dir: one version": model_bytes,
    }
    return [ShmUse(name, need, need <= free_bytes) for name, need in needs.items()]


def shm_report(model_bytes: int | None, shm_dir: Path = SHM_DIR) -> ShmReport:
    try:
        stat = os.statvfs(shm_dir)
    except OSError:
        fits = None if model_bytes is None else False
        return ShmReport(0, 0, model_bytes, fits, fix=SHM_MOUNT)
    size_bytes, free_bytes = shm_size_bytes(stat), shm_free_bytes(stat)
    if model_bytes is None:
        return ShmReport(size_bytes, free_bytes)
    uses = shm_uses(model_bytes, free_bytes)
    default = uses[0]  # what a push does unless told otherwise
    if default.fits:
        return ShmReport(size_bytes, free_bytes, model_bytes, True, uses)
    fix = shm_resize(resized_gib(size_bytes, free_bytes, default.need_bytes))
    return ShmReport(size_bytes, free_bytes, model_bytes, False, uses, fix)
