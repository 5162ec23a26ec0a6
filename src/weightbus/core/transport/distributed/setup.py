"""The weights group's life across processes: formed and left by the leader (`form_group`,
`leave_group`), joined and left by every engine rank (`apply_rank_setup`, the registry's
`rank_setup` of `dist`)."""

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import accumulate

from weightbus.core.store import serve_store
from weightbus.core.transport.base import EngineLink, EngineRequestError
from weightbus.core.transport.distributed.group import destroy_group, join_group
from weightbus.core.transport.distributed.messages import (
    Backend,
    WeightsGroupDestroy,
    WeightsGroupError,
    WeightsGroupInfo,
    WeightsGroupInit,
)
from weightbus.core.transport.distributed.sender import JoinOrder, failed_ranks
from weightbus.core.transport.sending import RankWork
from weightbus.core.wire.messages import RankLayout, SliceSpec

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


def form_group(
    engines: Sequence[EngineLink],
    *,
    name: str,
    master_addr: str,
    master_port: int = 0,
    backend: Backend = "gloo",
    timeout_s: float = 60.0,
    senders: int = 1,
    everyone: Callable[[JoinOrder, Callable[[RankWork], None]], object] | None = None,
) -> WeightsGroupInfo:
    """Leader: form weights group `name`, served on `master_addr:master_port` (0: a port from
    the OS), with `senders` trainer ranks (this process is rank 0; the others join as the sink's
    `everyone` tells them) and every rank of `engines` after them (asked in parallel).

    Raises:
        WeightsGroupError: an engine, a trainer rank or this process could not join (each
            named); the group is left on this process.
    """
    futures = _run_all(engines, lambda engine: engine.tp_size(timeout_s))
    failures = _failures(futures)
    if failures:
        raise WeightsGroupError(name, "initialisation", failures)
    tp_sizes = [futures[engine.url].result() for engine in engines]
    offsets = dict(
        zip([e.url for e in engines], accumulate([senders, *tp_sizes[:-1]]), strict=True)
    )
    world_size = senders + sum(tp_sizes)
    store = serve_store(master_addr, master_port, world_size=world_size, timeout_s=timeout_s)

    def lead() -> bool:
        """Every engine joins, and this process: whether every member did (else `failures`
        says why)."""
        joins = _run_all(
            engines,
            lambda engine: engine.setup_transport(
                "dist",
                WeightsGroupInit(
                    master_addr=master_addr,
                    master_port=store.port,
                    rank_offset=offsets[engine.url],
                    world_size=world_size,
                    backend=backend,
                    group_name=name,
                    timeout_s=timeout_s,
                ),
                timeout_s + ANSWER_MARGIN_S,
            ),
        )
        publisher = None
        try:
            join_group(
                name=name,
                master_addr=master_addr,
                master_port=store.port,
                group_rank=0,
                world_size=world_size,
                timeout_s=timeout_s,
                senders=senders,
                store=store,
            )
        except (TimeoutError, OSError) as exc:
            publisher = str(exc)
        failures.update(_failures(joins))
        if publisher is not None:
            failures["publisher"] = publisher
        return not failures

    def leader_part(work: RankWork) -> None:
        if not lead():  # the trainer ranks that did not join, named, end the step at once
            missing = {
                f"trainer rank {rank}": error or "did not join (dead?)"
                for rank, error in failed_ranks(work.group, work.key).items()
            }
            if missing:
                raise WeightsGroupError(name, "initialisation", missing)

    try:
        if everyone is None:
            lead()
        else:
            order = JoinOrder(
                group_name=name,
                master_addr=master_addr,
                master_port=store.port,
                world_size=world_size,
                timeout_s=timeout_s,
            )
            everyone(order, leader_part)
    except WeightsGroupError as exc:  # trainer ranks that did not join, named
        failures.update(exc.failures)
    except (TimeoutError, OSError) as exc:  # the trainer group's own store failed
        failures["trainer ranks"] = str(exc)
    if failures:
        destroy_group(name)
        raise WeightsGroupError(name, "initialisation", failures)
    return WeightsGroupInfo(name, world_size, offsets)


def leave_group(engines: Sequence[EngineLink], *, name: str, timeout_s: float) -> None:
    """Leader: leave group `name` here and on every engine.

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
