"""Names that carry their owner's pid, so what a killed process left behind can be found."""

import os


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
