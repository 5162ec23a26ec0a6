"""Reference-engine replicas placed by Ray, and Publishers that push to them.

`RayFleet.start(config)` places every rank of every replica as an `EngineRank` actor on its
bundle (see `placement.py`), forms each replica's TP group, and returns once every replica's
API server accepts requests. `fleet.handles` is a small picklable description (URLs, nodes,
token) that any process of the cluster can turn into a `Publisher` with `publisher_for`: each
replica is pushed over `shm` when it runs on the caller's node and over `nixl` or `dist`
otherwise, in one push (one version, one two-phase commit). `fleet.shutdown()` stops the
replicas, removes the placement groups weightbus created and the shared memory of any killed
rank.
"""

import dataclasses
import importlib.util
import logging
import os
import secrets
import select
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from weightbus.apps.ray.placement import check_bundle_indices, check_owned, default_bundle_indices
from weightbus.apps.ray.rank import MAX_CONCURRENCY, EngineRank, RankPlacement
from weightbus.core.owners import pid_alive
from weightbus.core.publisher import Publisher
from weightbus.core.transport.parts.shared_memory import remove_stale_slots
from weightbus.engines.reference.server.launcher import ServeConfig, checked_model

logger = logging.getLogger(__name__)

# How often a sweep looks again at a process that exited but is not reaped yet (no pidfd
# tells that), and how often start-up looks at every rank's failure while rank 0 gets ready.
_EXIT_POLL_S = 0.05
_START_POLL_S = 1.0


@dataclasses.dataclass(kw_only=True, slots=True)
class RayFleetConfig:
    """A fleet of reference-engine replicas on Ray; `__post_init__` names the field to fix.

    Attributes:
        engine: every replica's engine flags (`model`, `tp_size`, `dtype`, ...); its `host`
            and `port` are each rank 0's node address and a free port, its `api_token` the
            fleet's (generated when None: the API servers listen beyond loopback).
        num_replicas: replicas, each `engine.tp_size` rank actors.
        rank_resources: what each rank actor asks for (`CPU`, `GPU`, `memory`, custom).
        strategy: placement strategy of the groups weightbus creates (one per replica).
        placement_group: the caller's group instead; weightbus then creates none.
        bundle_indices: with `placement_group`, `bundle_indices[i][r]` is the bundle of
            replica i's rank r, applied in that order (default: `i * tp_size + r`).
        ready_timeout_s: bound of placement and start-up.
    """

    engine: ServeConfig
    num_replicas: int = 1
    rank_resources: dict[str, float] = dataclasses.field(default_factory=lambda: {"CPU": 1.0})
    strategy: str = "STRICT_PACK"
    placement_group: PlacementGroup | None = None
    bundle_indices: list[list[int]] | None = None
    ready_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        check_owned(
            bundle_indices=self.bundle_indices,
            placement_group=self.placement_group,
            strategy=self.strategy,
            num_replicas=self.num_replicas,
        )
        bad = {k: v for k, v in self.rank_resources.items() if not v >= 0}
        if bad:
            raise ValueError(f"rank_resources must be >= 0, got {bad}")
        if self.ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s must be positive, got {self.ready_timeout_s}")


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """One replica as a Publisher needs it: its URL and the nodes its ranks run on."""

    url: str
    node_ids: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class FleetHandles:
    """What any process of the cluster needs to push to the fleet (pass it to a trainer
    actor): the replicas and the token of their admin routes."""

    replicas: tuple[ReplicaInfo, ...]
    api_token: str = dataclasses.field(repr=False)

    @property
    def urls(self) -> list[str]:
        return [replica.url for replica in self.replicas]


@dataclasses.dataclass(slots=True)
class Replica:
    """A running replica: its URL, its rank actors and where each one runs."""

    index: int
    url: str
    actors: list[Any]
    ranks: list[RankPlacement]


def cross_node_transport(name: str = "auto") -> str:
    """The transport to replicas on other nodes: `nixl` when installed, else `dist`."""
    if name != "auto":
        return name
    return "nixl" if importlib.util.find_spec("nixl") is not None else "dist"


def routes_for(
    handles: FleetHandles, node_id: str, *, local: str = "shm", cross_node: str = "auto"
) -> dict[str, str]:
    """Each replica's transport from node `node_id`: `local` where all its ranks run on that
    node, `cross_node` otherwise."""
    remote = cross_node_transport(cross_node)
    return {
        replica.url: local if set(replica.node_ids) == {node_id} else remote
        for replica in handles.replicas
    }


def publisher_for(
    handles: FleetHandles,
    *,
    local: str = "shm",
    cross_node: str = "auto",
    master_addr: str | None = None,
    **options: Any,
) -> Publisher:
    """A Publisher to every replica of the fleet, from this process (a driver or an actor).

    Args:
        handles: `RayFleet.handles`.
        local: transport to replicas whose ranks all run on this process's node.
        cross_node: transport to the others (`auto`: `nixl` when installed, else `dist`).
        master_addr: this host's address as the engines reach it, for a `dist` group
            (default: this node's Ray address).
        options: more `Publisher` arguments (`timeout_s`, `bucket_bytes`, `transport_options`
            by transport name: `nixl`'s `host` defaults to this node's Ray address).

    Returns:
        The Publisher; with `dist` routes, its weights group formed.
    """
    node_ip = ray.util.get_node_ip_address()
    routes = routes_for(
        handles, ray.get_runtime_context().get_node_id(), local=local, cross_node=cross_node
    )
    logger.info("routes from this node: %s", routes)
    transport_options = dict(options.pop("transport_options", None) or {})
    # NIXL's control socket and UCX listen where the other nodes reach this one
    transport_options["nixl"] = {"host": node_ip, **transport_options.get("nixl", {})}
    publisher = Publisher(
        handles.urls,
        transport=routes,
        token=handles.api_token,
        transport_options=transport_options,
        **options,
    )
    if "dist" in routes.values():
        try:
            publisher.setup_transport(master_addr=master_addr or node_ip)
        except Exception:
            publisher.close()
            raise
    return publisher


class RayFleet:
    """Replicas of the reference engine, placed by Ray (see the module docstring).

    Use `RayFleet.start(config)`; `shutdown()` (or a `with` block) stops everything it started.
    """

    def __init__(self, config: RayFleetConfig, api_token: str) -> None:
        self.config = config
        self.api_token = api_token
        self.replicas: list[Replica] = []
        self._owned_groups: list[PlacementGroup] = []

    @classmethod
    def start(cls, config: RayFleetConfig) -> "RayFleet":
        """Place and start every replica; return once all accept requests.

        Raises:
            ValueError: a wrong bundle index (named, with why) or engine flag; nothing started.
            TimeoutError: placement did not complete within `ready_timeout_s`.
            RuntimeError: a replica failed to start (what started is stopped).
        """
        checked_model(config.engine)  # a flag the model refuses fails here, not in an actor
        token = config.engine.api_token or secrets.token_urlsafe(24)
        fleet = cls(config, token)
        try:
            slots = fleet._place()
            fleet._start_replicas(slots)
        except BaseException:
            fleet.shutdown()
            raise
        return fleet

    @property
    def handles(self) -> FleetHandles:
        """The fleet as `publisher_for` needs it (picklable: pass it to a trainer actor)."""
        return FleetHandles(
            replicas=tuple(
                ReplicaInfo(r.url, tuple(rank.node_id for rank in r.ranks)) for r in self.replicas
            ),
            api_token=self.api_token,
        )

    def publisher(self, **options: Any) -> Publisher:
        """`publisher_for(self.handles, **options)`, from this process."""
        return publisher_for(self.handles, **options)

    def health(self, timeout_s: float = 10.0) -> dict[str, list[str]]:
        """What is wrong with each replica, by URL (empty lists: all ranks serve).

        A rank whose actor died (killed, its node lost) reads `rank r: actor died`; a live
        rank reports why its step loop stopped, if it did.
        """
        # by URL; a replica still starting has none yet
        names = [replica.url or f"replica {replica.index}" for replica in self.replicas]
        calls = [
            (name, rank, actor.failure.remote())
            for name, replica in zip(names, self.replicas, strict=True)
            for rank, actor in enumerate(replica.actors)
        ]
        refs = [ref for _, _, ref in calls]
        answered, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        problems: dict[str, list[str]] = {name: [] for name in names}
        for url, rank, ref in calls:
            if ref not in answered:
                reason = f"did not answer within {timeout_s} s"
            else:
                try:
                    reason = ray.get(ref)
                except ray.exceptions.RayActorError:
                    reason = "actor died"
            if reason is not None:
                problems[url].append(f"rank {rank}: {reason}")
        return problems

    def __enter__(self) -> "RayFleet":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # --- placement ---

    def _place(self) -> list[list[tuple[PlacementGroup, int]]]:
        """(group, bundle) of every rank, checked before any actor starts."""
        c = self.config
        tp_size = c.engine.tp_size
        if c.placement_group is None:
            groups = [
                placement_group([dict(c.rank_resources)] * tp_size, strategy=c.strategy)
                for _ in range(c.num_replicas)
            ]
            self._owned_groups = groups
            self._wait_placed(groups)
            return [[(group, rank) for rank in range(tp_size)] for group in groups]
        group = c.placement_group
        indices = c.bundle_indices
        if indices is None:
            indices = default_bundle_indices(c.num_replicas, tp_size)
        check_bundle_indices(
            indices,
            group.bundle_specs,
            num_replicas=c.num_replicas,
            tp_size=tp_size,
            rank_resources=c.rank_resources,
        )
        self._wait_placed([group])
        return [[(group, index) for index in replica] for replica in indices]

    def _wait_placed(self, groups: Sequence[PlacementGroup]) -> None:
        timeout_s = self.config.ready_timeout_s
        ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=timeout_s)
        if len(ready) < len(groups):
            raise TimeoutError(
                f"{len(groups) - len(ready)} placement group(s) not placed within {timeout_s} s: "
                "the cluster lacks the resources of some bundle"
            )

    # --- start-up ---

    def _start_replicas(self, slots: list[list[tuple[PlacementGroup, int]]]) -> None:
        engine = dataclasses.replace(
            self.config.engine, host="127.0.0.1", port=0, api_token=self.api_token
        )
        serve_json = msgspec.json.encode(engine).decode()
        for index, replica_slots in enumerate(slots):
            actors = [self._rank_actor(serve_json, r, slot) for r, slot in enumerate(replica_slots)]
            self.replicas.append(Replica(index, "", actors, []))  # placed: shutdown stops it
        timeout_s = self.config.ready_timeout_s
        for replica in self.replicas:
            replica.ranks = ray.get(
                [a.placement.remote() for a in replica.actors], timeout=timeout_s
            )
        for replica in self.replicas:
            _start_ranks(replica, timeout_s)
        self._wait_ready(timeout_s)
        logger.info("fleet ready: %s", [r.url for r in self.replicas])

    def _wait_ready(self, timeout_s: float) -> None:
        """Every replica's URL once its API server accepts requests; a rank that fails
        meanwhile (any rank: rank 0 would see a later rank's failure only at its TP group's
        timeout) fails the start at once, naming it.

        Raises:
            RuntimeError: a rank failed, or a replica was not ready within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        pending = {r.actors[0].wait_ready.remote(timeout_s): r for r in self.replicas}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=_START_POLL_S)
            for ref in ready:
                pending.pop(ref).url = ray.get(ref)
            failed = {url: why for url, why in self.health().items() if why}
            if pending and failed:
                raise RuntimeError(f"replicas failed to start: {failed}")
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"replicas not ready within {timeout_s} s")

    def _rank_actor(self, serve_json: str, tp_rank: int, slot: tuple[PlacementGroup, int]) -> Any:
        group, bundle_index = slot
        resources = dict(self.config.rank_resources)
        num_cpus = resources.pop("CPU", 0.0)
        num_gpus = resources.pop("GPU", 0.0)
        memory = resources.pop("memory", None)
        return _ENGINE_RANK.options(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            memory=memory,
            resources=resources,
            max_concurrency=MAX_CONCURRENCY,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group,
                placement_group_bundle_index=bundle_index,
                placement_group_capture_child_tasks=False,
            ),
        ).remote(serve_json, tp_rank, max(1, int(num_cpus)))

    # --- shutdown ---

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop every replica (its ranks leave their shared memory), kill the actors, remove
        the placement groups weightbus created, and sweep shared memory of ranks that died.
        Calling it again does nothing."""
        if not (self.replicas or self._owned_groups):
            return
        pids_by_node: dict[str, list[int]] = {}
        for replica in self.replicas:
            for rank in replica.ranks:
                pids_by_node.setdefault(rank.node_id, []).append(rank.pid)
        try:
            stops = [r.actors[0].stop.remote(timeout_s) for r in self.replicas if r.actors]
            stops += [a.stop.remote(timeout_s) for r in self.replicas for a in r.actors[1:]]
            ray.wait(stops, num_returns=len(stops), timeout=2 * timeout_s + 5)
            for replica in self.replicas:
                for actor in replica.actors:
                    ray.kill(actor)
            for group in self._owned_groups:
                remove_placement_group(group)
            _sweep_nodes(pids_by_node, timeout_s)
        finally:
            self._owned_groups, self.replicas = [], []


_ENGINE_RANK = ray.remote(EngineRank)


def _start_ranks(replica: Replica, timeout_s: float) -> None:
    """Form the replica's TP group: on loopback when every rank shares rank 0's address."""
    rank0 = replica.ranks[0]
    same_host = all(rank.node_ip == rank0.node_ip for rank in replica.ranks)
    host = "127.0.0.1" if same_host else rank0.node_ip
    port = ray.get(replica.actors[0].serve_store.remote(host), timeout=timeout_s)
    ray.get([a.start.remote(host, port) for a in replica.actors], timeout=timeout_s)


@ray.remote(num_cpus=0)
def _sweep(pids: list[int], timeout_s: float) -> list[str]:
    """On one node: wait (bounded) for the killed ranks to exit, then remove what dead
    weightbus processes left in shared memory."""
    deadline = time.monotonic() + timeout_s
    try:
        for pid in set(pids) - {os.getpid()}:
            _wait_exited(pid, deadline)
    finally:
        removed = remove_stale_slots()
    return removed


def _wait_exited(pid: int, deadline: float) -> None:
    """Wait until `pid` has exited and been reaped, or the deadline. A kill is asynchronous
    and acks nothing: a pidfd turns readable at the exit; where there is none, poll."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (OSError, AttributeError):  # no pidfd here (old kernel, seccomp, not Linux)
        pidfd = None
    if pidfd is not None:
        try:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            poller.poll(max(0.0, deadline - time.monotonic()) * 1000)
        finally:
            os.close(pidfd)
    while pid_alive(pid) and time.monotonic() < deadline:  # a zombie, until it is reaped
        time.sleep(_EXIT_POLL_S)


def _sweep_nodes(pids_by_node: dict[str, list[int]], timeout_s: float) -> None:
    """Remove the shared memory of dead ranks on each node (a killed actor leaves its arena).
    A node that is gone is skipped: its memory went with it."""
    sweeps = {
        _sweep.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            pids, timeout_s
        ): node
        for node, pids in pids_by_node.items()
    }
    ready, _ = ray.wait(list(sweeps), num_returns=len(sweeps), timeout=timeout_s + 5)
    for ref in ready:
        try:
            removed = ray.get(ref)
        except ray.exceptions.RayError as exc:
            logger.warning("no shared-memory sweep on node %s: %s", sweeps[ref], exc)
            continue
        if removed:
            logger.info("removed shared memory of dead ranks: %s", removed)
