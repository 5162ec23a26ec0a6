"""Resident memory of benchmark processes, read from /proc (Linux)."""

from pathlib import Path


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """`VmRSS` (resident now) or `VmHWM` (peak resident) of a process; 0 if unknown."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak(pid: int) -> None:
    """Reset a process's peak resident size (`VmHWM`) to its current size.

    Writing 5 to /proc/PID/clear_refs does it (Linux >= 4.0); where that is not allowed, the
    peak keeps counting from the process's start.
    """
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return


def child_pids(pid: int) -> list[int]:
    """Direct children of a process (e.g. the ranks of a `weightbus serve` launcher)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        return [int(child) for child in children.read_text().split()]
    except OSError:
        return []
