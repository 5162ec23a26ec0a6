"""The weights group's life across processes: formed and left by the publisher (`form_group`,
`leave_group`, through each engine's `EngineLink`), joined and left by every engine rank
(`apply_rank_setup`, the registry's `rank_setup` of `dist`)."""

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import accumulate

from weightbus.core.transport.base import EngineLink, EngineRequestError
from weightbus.core.transport.distributed.group import (
    create_publisher_group,
    destroy_group,
    join_group,
    serve_group,
)
from weightbus.core.transport.distributed.messages import (
    Backend,
    WeightsGroupDestroy,
    WeightsGroupError,
    WeightsGroupInfo,
    WeightsGroupInit,
)
from weightbus.core.wire.messages import RankLayout, SliceSpec

logger = logging.getLogger(__name__)

# Margin on top of a set-up's own timeout for an engine's answer to travel back.
ANSWER_MARGIN_S = 10.0


def _run_all(
    engines: Sequence[EngineLink], call: Callable[[EngineLink], object]
) -> dict[str, Future]:
    # one worker at least: a group whose engines all left is still left here
    pool = ThreadPoolExecutor(max_workers=max(1, len(engines)), thread_name_prefix="dist-setup")
    try:
        return {engine.url: pool.submit(call, engine) for engine in engines}
    finally:
        pool.shutdown(wait=False)


def _failures(futures: dict[str, Future]) -> dict[str, str]:
    failures = {}
    for url, future in futures.items():
        try:
            future.result()
        except EngineRequestError as exc:
            failures[url] = str(exc)
    return failures


def _tp_sizes(engines: Sequence[EngineLink], name: str, timeout_s: float) -> list[int]:
    futures = _run_all(engines, lambda engine: engine.tp_size(timeout_s))
    failures = _failures(futures)
    if failures:
        raise WeightsGroupError(name, "initialisation", failures)
    return [futures[engine.url].result() for engine in engines]


# Called with the group's store port, its size and the leader's own part of forming it (the
# engines and this process join; True when every member did): runs that part while the other
# trainer ranks join, and raises `WeightsGroupError` naming those that did not.
JoinSenders = Callable[[int, int, Callable[[], bool]], None]


def form_group(
    engines: Sequence[EngineLink],
    *,
    name: str,
    master_addr: str,
    master_port: int = 0,
    backend: Backend = "gloo",
    timeout_s: float = 60.0,
    senders: int = 1,
    join_senders: JoinSenders | None = None,
) -> WeightsGroupInfo:
    """Publisher: form weights group `name` with every rank of `engines`; this process is rank 0.

    Serves the group's store on `master_addr:master_port` (0: a free port from the OS), asks
    every engine in parallel to join (rank r of engine i is group rank `offset_i + r`) and
    joins itself. A trainer group of `senders` ranks has them before the engines' ranks: the
    others join through `join_senders`.

    Raises:
        WeightsGroupError: an engine, a trainer rank or this process could not join (each
            named); the group is left on this process.
    """
    tp_sizes = _tp_sizes(engines, name, timeout_s)
    offsets = list(accumulate([senders, *tp_sizes[:-1]]))
    world_size = senders + sum(tp_sizes)
    store = serve_group(
        name=name,
        master_addr=master_addr,
        master_port=master_port,
        world_size=world_size,
        timeout_s=timeout_s,
    )
    requests = {
        engine.url: WeightsGroupInit(
            master_addr=master_addr,
            master_port=store.port,
            rank_offset=offset,
            world_size=world_size,
            backend=backend,
            group_name=name,
            timeout_s=timeout_s,
        )
        for engine, offset in zip(engines, offsets, strict=True)
    }
    failures: dict[str, str] = {}

    def lead() -> bool:
        """Ask every engine to join, join too; whether every member did (what failed goes to
        `failures`)."""
        futures = _run_all(
            engines,
            lambda engine: engine.setup_transport(
                "dist", requests[engine.url], timeout_s + ANSWER_MARGIN_S
            ),
        )
        publisher = None
        try:
            create_publisher_group(
                name=name,
                store=store,
                master_addr=master_addr,
                world_size=world_size,
                timeout_s=timeout_s,
                senders=senders,
            )
        except (TimeoutError, OSError) as exc:
            publisher = str(exc)
        failures.update(_failures(futures))
        if publisher is not None:
            failures["publisher"] = publisher
        return not failures

    try:
        if join_senders is None:
            lead()
        else:
            join_senders(store.port, world_size, lead)
    except WeightsGroupError as exc:  # trainer ranks that did not join, named
        failures.update(exc.failures)
    except (TimeoutError, OSError) as exc:  # the trainer group's own store failed
        failures["trainer ranks"] = str(exc)
    if failures:
        destroy_group(name)
        raise WeightsGroupError(name, "initialisation", failures)
    rank_offsets = {engine.url: offset for engine, offset in zip(engines, offsets, strict=True)}
    return WeightsGroupInfo(name, world_size, rank_offsets)


def leave_group(engines: Sequence[EngineLink], *, name: str, timeout_s: float) -> None:
    """Publisher: leave group `name` here and on every engine.

    Raises:
        WeightsGroupError: an engine did not confirm (this process has left regardless).
    """
    request = WeightsGroupDestroy(group_name=name)
    futures = _run_all(
        engines, lambda engine: engine.teardown_transport("dist", request, timeout_s)
    )
    destroy_group(name)
    failures = _failures(futures)
    if failures:
        raise WeightsGroupError(name, "destruction", failures)


def apply_rank_setup(
    request: WeightsGroupInit | WeightsGroupDestroy,
    *,
    tp_rank: int,
    tp_size: int,
    slices: list[SliceSpec],
) -> None:
    """Engine rank: join (reporting this rank's slice map) or leave the group `request` names.

    Raises:
        TimeoutError: not every member joined within the request's `timeout_s`.
        OSError, ValueError, RuntimeError: the group could not form.
    """
    if isinstance(request, WeightsGroupDestroy):
        destroy_group(request.group_name)
        return
    group_rank = request.rank_offset + tp_rank
    join_group(
        name=request.group_name,
        master_addr=request.master_addr,
        master_port=request.master_port,
        group_rank=group_rank,
        world_size=request.world_size,
        timeout_s=request.timeout_s,
        layout=RankLayout(group_rank=group_rank, tp_rank=tp_rank, tp_size=tp_size, slices=slices),
    )
