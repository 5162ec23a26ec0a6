"""Helpers of the Ray tests: nodes by name, engine actors, and what a shutdown must not leave."""

from pathlib import Path

import ray

from weightbus.core.transport.parts.shared_memory import SHM_DIR

NODES = ("n0", "n1", "n2")


def node_ids() -> dict[str, str]:
    """Node name (its custom resource) -> Ray node id."""
    return {
        name: node["NodeID"]
        for node in ray.nodes()
        if node["Alive"]
        for name in NODES
        if name in node["Resources"]
    }


def engine_actors() -> int:
    """`EngineRank` actors the cluster has had (alive or dead)."""
    actors = ray._private.state.actors()  # the GCS table: the state API needs a dashboard
    return sum(
        1 for info in actors.values() if info.get("ActorClassName", "").endswith("EngineRank")
    )


def arenas_of(pids: list[int]) -> list[str]:
    """weightbus shared-memory files owned by these processes."""
    return [
        p.name for p in SHM_DIR.glob("weightbus-*") if any(f"-{pid}-" in p.name for pid in pids)
    ]


def ray_processes(session_dir: str) -> list[str]:
    """Processes of the cluster: its daemons (their command line names its session) and workers."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (FileNotFoundError, PermissionError, ProcessLookupError, NotADirectoryError):
            continue
        if session_dir in cmdline or cmdline.startswith("ray::"):
            found.append(f"{proc.name}: {cmdline[:120]}")
    return found
