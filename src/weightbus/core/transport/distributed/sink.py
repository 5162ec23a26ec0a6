"""`dist`, the leader's side: buckets travel on a torch.distributed gloo group spanning hosts.

The weights group (`group.py`, `setup.py`) is formed once and reused: the trainer ranks are its
first ranks, every engine rank (`source.py`) a member after them. Per push, `prepare` has every
trainer rank digest its share, and `stream`, once every engine rank said it is ready
(`handshake.py`), has every trainer rank send its part (`sender.py`):

    UpdateBegin -> (BucketSent, bucket data) x buckets -> UpdateEnd

- `broadcast`: every engine rank receives every byte, one broadcast per bucket entry straight
  from the trainer's tensors. Only a group of one can: other trainer ranks would receive too.
- `parts`: each engine rank receives only the regions of each bucket it loads (its TP slices,
  from the `RankLayout` it reported when it joined), in parts from the trainer ranks that hold
  them (`schedule.py`), point to point, each payload with its xxh3-128 (`slices.py`). No engine
  rank holds whole tensors, so engines run with `verify: none` and the transport checks bytes.
- `auto`: parts when the trainer group has several ranks or every engine rank has tp > 1.

A push with no group formed forms it first (`setup_on_push`), as one after a failed push of a
group of N does (`setup_broken`): the other trainer ranks join when told (`sender.JoinOrder`).
"""

import contextlib
import functools
import secrets
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from weightbus.core.trainer.digests import combine_shares
from weightbus.core.trainer.group import TrainerGroup, TrainerRankError
from weightbus.core.transport.base import BucketSink, EngineLink, Progress, PushSession, no_progress
from weightbus.core.transport.distributed.group import (
    WeightsGroup,
    abort,
    find_group,
    get_group,
)
from weightbus.core.transport.distributed.handshake import start_stream
from weightbus.core.transport.distributed.messages import (
    DEFAULT_GROUP_NAME,
    MAX_PREFETCH_DEPTH,
    Backend,
    DistDescription,
    WeightsGroupDestroy,
    WeightsGroupError,
    WeightsGroupInfo,
)
from weightbus.core.transport.distributed.sender import (
    DigestOrder,
    LeaderPart,
    SessionOrder,
    SessionReport,
    failed_ranks,
)
from weightbus.core.transport.distributed.setup import form_group, leave_group
from weightbus.core.transport.distributed.slices import check_slices, layout_slices
from weightbus.core.transport.sending import Sending

Mode = Literal["auto", "broadcast", "parts"]
MODES = ("auto", "broadcast", "parts")
# Bound of leaving the group at `close` (engines that do not answer by then are left as is).
CLOSE_TIMEOUT_S = 10.0


class DistSink(BucketSink):
    """The leader's side of `dist`: `setup` (`Publisher.init_weights_group`) forms the weights
    group, every push reuses it.

    Args:
        group_name: the weights group to push on.
        mode: `broadcast`, `parts` or `auto`.
        prefetch_depth: buckets each engine rank receives ahead of the one it loads.
        master_addr, master_port, group_timeout_s: the defaults of `setup` (a group formed on
            a push): the leader's address as every rank reaches it, the store's port (0: one
            from the OS), the bound of forming it.

    Attributes:
        rank_sent_bytes: bytes each engine group rank got in the last push, alignment padding
            included (`PushSession.sent_bytes` counts the push's tensor bytes).
    """

    name = "dist"

    def __init__(
        self,
        group_name: str = DEFAULT_GROUP_NAME,
        mode: Mode = "auto",
        prefetch_depth: int = 1,
        *,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        group_timeout_s: float = 60.0,
    ) -> None:
        _check_mode(mode)
        if not 1 <= prefetch_depth <= MAX_PREFETCH_DEPTH:
            raise ValueError(
                f"prefetch_depth must be in [1, {MAX_PREFETCH_DEPTH}], got {prefetch_depth}"
            )
        self.group_name = group_name
        self.requested_mode = mode
        self.prefetch_depth = prefetch_depth
        self.master_addr, self.master_port = master_addr, master_port
        self.group_timeout_s = group_timeout_s
        self.rank_sent_bytes: dict[int, int] = {}
        self._session_mode: tuple[str, str] = ("", "broadcast")
        self._members: Sequence[EngineLink] = ()  # the engines of the group this sink formed
        self._engine_at_offset: dict[int, str] = {}  # first group rank -> engine URL
        self._reform = False  # a group of N's push failed: form the group again first
        self._live_session: str | None = None  # the session the trainer ranks are sending

    # --- the weights group ---

    def setup(
        self,
        engines: Sequence[EngineLink],
        steps: Sending | None = None,
        *,
        master_addr: str | None = None,
        master_port: int | None = None,
        backend: Backend = "gloo",
        timeout_s: float | None = None,
    ) -> WeightsGroupInfo:
        """Form the weights group with every trainer rank (through `steps`) and every rank of
        `engines`, anew if it was formed (`setup.form_group`; options left out: the sink's).

        Raises:
            WeightsGroupError: an engine, a trainer rank or the leader could not join (named).
        """
        self._members = ()
        timeout_s = self.group_timeout_s if timeout_s is None else timeout_s
        trainers = steps if steps is not None and not steps.single else None
        if trainers is not None:  # within the call's bound: the ranks wait for it no longer
            timeout_s = max(0.001, min(timeout_s, trainers.deadline - time.monotonic()))
        info = form_group(
            engines,
            name=self.group_name,
            master_addr=master_addr or self.master_addr,
            master_port=self.master_port if master_port is None else master_port,
            backend=backend,
            timeout_s=timeout_s,
            senders=1 if trainers is None else trainers.group.world_size,
            everyone=None if trainers is None else functools.partial(self.everyone, trainers),
        )
        self._members = tuple(engines)
        self._engine_at_offset = {offset: url for url, offset in info.rank_offsets.items()}
        self._reform = False
        return info

    def setup_on_push(self, steps: Sending | None) -> dict[str, Any] | None:
        """A push with no weights group formed forms it with the sink's options."""
        if steps is None or self._members:
            return None
        return {}

    def teardown_engine(self, engine: EngineLink, timeout_s: float) -> None:
        """The engine's ranks leave the group; it is no longer a member, confirmed or not."""
        self._members = tuple(m for m in self._members if m.url != engine.url)
        request = WeightsGroupDestroy(group_name=self.group_name)
        engine.teardown_transport("dist", request, timeout_s)

    def sibling_options(
        self, sink_options: dict[str, Any], setup_options: dict[str, Any] | None
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """A group of its own (a fresh name and store port): processes register groups by
        name, and a fixed store port is taken by this sink's group."""
        name = f"{self.group_name[:48]}-join-{secrets.token_hex(4)}"
        setup = None if setup_options is None else {**setup_options, "master_port": 0}
        return {**sink_options, "group_name": name, "master_port": 0}, setup

    def teardown(self, timeout_s: float) -> None:
        """Leave the weights group here and on every engine (the other trainer ranks: when
        their senders close, or the group forms again).

        Raises:
            WeightsGroupError: an engine did not confirm (this process has left regardless).
        """
        members, self._members = self._members, ()
        leave_group(members, name=self.group_name, timeout_s=timeout_s)

    def setup_broken(self) -> str | None:
        if self._reform:
            return "the last push failed: the trainer ranks form the group anew"
        group = find_group(self.group_name) if self._members else None
        return None if group is None else group.broken

    def _group(self, sending: Sending) -> WeightsGroup:
        group = get_group(self.group_name)
        group.check_usable()
        if group.senders != sending.group.world_size:
            raise ValueError(
                f"weights group {self.group_name!r} was formed for {group.senders} trainer "
                f"ranks, this push has {sending.group.world_size}: re-initialise it"
            )
        return group

    def _push_mode(self, group: WeightsGroup, sending: Sending) -> Literal["broadcast", "parts"]:
        mode = self.requested_mode
        _check_mode(mode)
        if mode == "broadcast" and not sending.single:
            raise ValueError(
                "dist broadcast needs one process holding every tensor: a trainer group of "
                f"{sending.group.world_size} ranks sends in parts (mode 'parts' or 'auto')"
            )
        if mode != "auto":
            return mode
        tp_sizes = [layout.tp_size for layout in group.layouts.values()]
        split = tp_sizes and min(tp_sizes) > 1
        return "parts" if split or not sending.single else "broadcast"

    # --- one push ---

    def prepare(
        self, session: PushSession, sending: Sending, progress: Progress = no_progress
    ) -> DistDescription:
        group = self._group(sending)
        mode = self._push_mode(group, sending)
        if mode == "parts":
            shapes = {meta.name: meta.shape for meta in session.plan.metas}
            for layout in group.layouts.values():
                check_slices(layout_slices(layout), shapes)
        self._session_mode = (session.session_id, mode)
        # each bucket's message carries the digests of the tensors it completes
        reports = self.everyone(sending, DigestOrder())
        session.digests.update(combine_shares(sending.layout, [r.digests for r in reports]))
        return DistDescription(
            group_name=self.group_name,
            session_id=session.session_id,
            mode=mode,
            prefetch_depth=self.prefetch_depth,
        )

    @property
    def mode(self) -> str:
        return f"dist {self._session_mode[1]}"

    def receiver_verify(self, verify: str) -> str:
        return verify if self._session_mode[1] == "broadcast" else "none"

    def stream(
        self,
        session: PushSession,
        sending: Sending,
        timeout_s: float,
        progress: Progress = no_progress,
    ) -> None:
        session_id, mode = self._session_mode
        assert session_id == session.session_id, "prepare() the session first"
        try:
            group = self._group(sending)
            deadline = time.monotonic() + timeout_s
            # raises when the push cannot start: nothing moved, the group stays usable
            start_stream(
                group,
                session.session_id,
                deadline,
                abandoned=lambda: session.abandoned,
                describe_rank=lambda group_rank: self._describe_rank(group, group_rank),
            )
            leader = LeaderPart(session, progress)
            order = SessionOrder(
                group_name=self.group_name,
                session_id=session.session_id,
                mode=mode,
                bucket_bytes=session.plan.bucket_bytes,
                plan_hash=session.plan.plan_hash,
                timeout_s=max(0.0, deadline - time.monotonic()),
                layouts=[group.layouts[rank] for rank in sorted(group.layouts)],
            )
            if mode == "parts":  # every rank checks it computed the leader's parts first
                _, hashed = sending.senders(self.key, self.name).parts_plan(sending.layout, order)
                order = msgspec.structs.replace(order, parts_hash=hashed)
            self._live_session = session.session_id
            try:
                reports: list[SessionReport] = self.everyone(sending, order, hooks=leader)
            except BaseException as exc:
                # the engine ranks are at some step of the stream: the group must be formed again
                group.broken = group.broken or f"a push failed midway: {exc}"
                cause = _failure_cause(sending.group, leader.key) if leader.key else None
                if cause is None:
                    raise
                raise cause from exc
            finally:
                self._live_session = None
        except BaseException:
            # whatever failed (an engine that lost its group, a rank that died), a group of N
            # forms its group anew before the next push rather than find out midway
            self._reform = not sending.single
            raise
        sent = [report.sent_bytes for report in reports]
        sending.count_sent(sent)
        session.count_sent(sum(sent))
        rank_bytes: Counter[int] = Counter()
        for report in reports:
            rank_bytes.update(report.rank_bytes)
        self.rank_sent_bytes = dict(rank_bytes)

    def engine_answered(self, session: PushSession, url: str, reason: str) -> None:
        """An engine that failed mid-stream (its ranks lost a sender: a trainer rank died)
        ends every member's pending operation at once, instead of at the push's deadline."""
        super().engine_answered(session, url, reason)
        live = session.session_id == self._live_session
        group = find_group(self.group_name) if live else None
        if group is not None and group.senders > 1 and session.at_fault:
            abort(group, f"engine {url} failed mid-stream: {reason}")

    def _describe_rank(self, group: WeightsGroup, group_rank: int) -> str:
        """`engine URL (group rank r)`, or `group rank r` for a rank of no known engine."""
        layout = group.layouts.get(group_rank)
        url = None if layout is None else self._engine_at_offset.get(group_rank - layout.tp_rank)
        if url is None:
            return f"group rank {group_rank}"
        return f"engine {url} (group rank {group_rank})"

    def close(self) -> None:
        """Leave the group this sink formed (bounded: engines that do not answer are left)."""
        if self._members:
            with contextlib.suppress(WeightsGroupError):
                self.teardown(timeout_s=CLOSE_TIMEOUT_S)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _failure_cause(group: TrainerGroup, key: str) -> TrainerRankError | None:
    """After a failed step `key`: the trainer ranks that died or failed on their own (not
    because the group broke under them), named, or None."""
    reasons = [
        f"trainer rank {rank} sent no report (dead?)"
        if error is None
        else f"trainer rank {rank} failed: {error}"
        for rank, error in sorted(failed_ranks(group, key).items())
        if error is None or not error.startswith(("GroupBrokenError", "TimeoutError"))
    ]
    return TrainerRankError("; ".join(reasons)) if reasons else None
