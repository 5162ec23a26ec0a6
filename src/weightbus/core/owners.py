"""Names that carry their owner's pid, so what a killed process left behind can be found."""

import os
import secrets
import tempfile
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (on this host)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def owner_is_dead(name: str, prefix: str) -> bool:
    """For `name` = `<prefix><pid>-...`: whether that pid is gone (False when no pid)."""
    pid = name[len(prefix) :].split("-", 1)[0] if name.startswith(prefix) else ""
    return pid.isdigit() and not pid_alive(int(pid))


def private_dir(prefix: str, parent: str | Path | None = None) -> Path:
    """A new 0700 directory `<prefix><pid>-<64 random bits>-...` under `parent` (default: the
    temporary directory).

    The pid lets `owner_is_dead` find it after a crash; the random part keeps the name
    unguessable in a shared place such as /dev/shm (mkdtemp's own suffix has ~41 bits).
    """
    return Path(
        tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-{secrets.token_hex(8)}-", dir=parent)
    )
