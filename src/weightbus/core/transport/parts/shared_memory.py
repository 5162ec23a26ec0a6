"""weightbus files under /dev/shm: `shm` slots and parameter arenas, created 0600, mapped once.

Names are `weightbus-shm-<pid>-<random>-<index>` (a publisher's slots) and
`weightbus-params-<pid>-<random>` (a rank's parameters, `arena.py`): unguessable, and they tell
which process owns them, so files of a process that died without closing (SIGKILL) are found and
removed by the next publisher or engine on the host (`remove_stale_slots`).
"""

import logging
import mmap
import os
import secrets
import shutil
import tempfile
from pathlib import Path

import torch

from weightbus.core.owners import owner_is_dead, private_dir

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")  # noqa: S108 - POSIX shared memory lives here on Linux
SLOT_PREFIX = "weightbus-shm-"
ARENA_PREFIX = "weightbus-params-"  # a rank's parameters offered for direct writes


def private_ipc_dir() -> Path:
    """A new 0700 directory for a publisher's sockets, named after its owner like the slots."""
    return private_dir(SLOT_PREFIX)


def private_shm_dir(prefix: str) -> Path:
    """A new 0700 directory `<prefix><pid>-<random>-...` under /dev/shm (the temporary
    directory where there is none), after removing those of dead owners with that prefix.

    Its unguessable name and mode make a world-writable /dev/shm safe for a session's files.
    """
    parent = SHM_DIR if SHM_DIR.is_dir() else Path(tempfile.gettempdir())
    for path in parent.glob(f"{prefix}*-*"):
        if path.is_dir() and owner_is_dead(path.name, prefix):
            logger.info("removing %s, left by a dead process", path)
            shutil.rmtree(path, ignore_errors=True)
    return private_dir(prefix, parent)


def remove_stale_slots() -> list[str]:
    """Unlink slots, parameter arenas and socket directories whose owning process is gone;
    returns the names of the files removed."""
    removed = []
    for prefix in (SLOT_PREFIX, ARENA_PREFIX):
        for path in SHM_DIR.glob(f"{prefix}*"):
            if owner_is_dead(path.name, prefix):
                try:
                    path.unlink(missing_ok=True)
                except OSError as exc:  # another user's file in the sticky /dev/shm
                    logger.warning("cannot remove %s: %s", path, exc)
                    continue
                removed.append(path.name)
    for path in Path(tempfile.gettempdir()).glob(f"{SLOT_PREFIX}*"):
        if path.is_dir() and owner_is_dead(path.name, SLOT_PREFIX):
            shutil.rmtree(path, ignore_errors=True)
    if removed:
        logger.info("removed %d shared-memory slots of dead publishers", len(removed))
    return removed


class Slot:
    """One mapped shared-memory file, viewed as a flat `uint8` tensor (no copy)."""

    def __init__(self, name: str, nbytes: int, fd: int) -> None:
        self.name = name
        self.nbytes = nbytes
        stat = os.fstat(fd)
        self.identity = (stat.st_dev, stat.st_ino)
        self._mmap = mmap.mmap(fd, nbytes)
        os.close(fd)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)

    @staticmethod
    def new_name(index: int) -> str:
        """An unguessable name for a slot of this process (its pid lets stale slots be found)."""
        return f"{SLOT_PREFIX}{os.getpid()}-{secrets.token_hex(8)}-{index}"

    @classmethod
    def create(cls, name: str, nbytes: int) -> "Slot":
        """A new slot named `name` (from `new_name`), its pages touched once so later writes
        never fault."""
        fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # reserve the pages now: a full /dev/shm is an OSError here, not a SIGBUS later
            os.posix_fallocate(fd, 0, nbytes)
        except OSError:
            os.close(fd)
            (SHM_DIR / name).unlink(missing_ok=True)
            raise
        slot = cls(name, nbytes, fd)
        slot.tensor.zero_()
        return slot

    @classmethod
    def open(cls, name: str, nbytes: int, prefix: str = SLOT_PREFIX) -> "Slot":
        """Map an existing slot (or another weightbus file under /dev/shm named `prefix...`).

        Raises:
            ValueError: the name is not a weightbus slot, it does not exist, cannot be opened
                (a link, a directory, another user's), or it is smaller than `nbytes`.
        """
        if not name.startswith(prefix) or "/" in name or "\0" in name:
            raise ValueError(f"{name!r} is not a weightbus shared-memory file")
        try:
            # never through a link: the file must be the one its owner created here
            fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise ValueError(f"shared-memory file {name} does not exist (owner gone?)") from None
        except OSError as exc:  # too long a name, a directory, a link, no permission
            raise ValueError(f"cannot open shared-memory file {name}: {exc.strerror}") from None
        size = os.fstat(fd).st_size
        if size < nbytes:
            os.close(fd)
            raise ValueError(f"shared-memory slot {name} has {size} bytes, expected {nbytes}")
        return cls(name, nbytes, fd)

    def current_identity(self) -> tuple[int, int] | None:
        """(device, inode) of the file now under this name, or None when it is gone."""
        try:
            stat = (SHM_DIR / self.name).stat()
        except FileNotFoundError:
            return None
        return (stat.st_dev, stat.st_ino)

    def close(self) -> None:
        """Drop this slot's references: the file is unmapped once no tensor views it.

        Never `mmap.close()` here: tensors from `torch.frombuffer` hold the mmap object but no
        buffer export, so closing it would unmap memory that live views still read.
        """
        self.tensor = None
        self._mmap = None

    def unlink(self) -> None:
        (SHM_DIR / self.name).unlink(missing_ok=True)
