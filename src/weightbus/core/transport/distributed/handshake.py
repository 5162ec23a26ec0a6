"""`dist`: a push's hand-shake. Nothing of a push moves on the weights group before every engine
rank said it is ready; a push that cannot start is cancelled before then, and the group stays
usable (no collective started, so every member is at the same step).

A gloo wait cannot be interrupted, and one that times out closes the group's connections. So the
ranks answer through the group's store, which the publisher polls (checking between polls
whether an engine answered the push already), and the publisher's word goes point-to-point to
exactly the ranks that said ready:

    engine rank r: claim  <session>/rank/<r> := RankReady      (compare-and-set: first wins)
                   recv   StreamStart or UpdateAbort from rank 0 (bounded by the deadline)
    publisher:     poll   every rank's key claimed? a refusal? an engine answered? the deadline?
                   all ready: StreamStart to every rank, then the stream
                   else:      claim every key still free with UpdateAbort (a rank that comes
                              later reads why and fails at once) and send UpdateAbort to every
                              rank that said ready

A rank that cannot take part claims its key with a `RankRefusal` and sets `<session>/refused`:
its side of the group is broken (e.g. its slice map changed since the group formed), so the
publisher marks the group broken too and its next push forms it anew.
"""

import contextlib
import time
from collections.abc import Callable, Sequence

from weightbus.core.transport.distributed.group import (
    HANDSHAKE_TAG,
    WeightsGroup,
    recv_word,
    send_word,
)
from weightbus.core.transport.distributed.messages import RankReady, RankRefusal, StreamStart
from weightbus.core.wire import Message, ProtocolError, UpdateAbort, decode

# Hand-shake keys of this many past sessions stay in the store, so that a rank coming late
# (its engine accepted after the push was cancelled) still reads why and fails at once.
KEPT_SESSIONS = 16
# The publisher polls the ranks' answers this often: the shortest wait first, doubling.
POLL_FIRST_S = 0.0002
POLL_LONGEST_S = 0.002
# How long the ranks that said ready are given to take the cancellation once the push's own
# deadline has passed (each waits until its own deadline, a little later than the publisher's).
CANCEL_GRACE_S = 5.0
# A reason of at most this many characters (4 bytes each at most) fits in a word.
MAX_REASON_CHARS = 1900


class PushCancelledError(ValueError):
    """The push was cancelled in its hand-shake (`reason`: why): nothing of it moved, the group
    stays usable."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"push cancelled before anything was sent: {reason}")


def _key(session_id: str, name: str) -> str:
    return f"weightbus-handshake/{session_id}/{name}"


def _rank_key(session_id: str, group_rank: int) -> str:
    return _key(session_id, f"rank/{group_rank}")


def _clip(reason: str) -> str:
    return reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 3] + "..."


def _store_call(group: WeightsGroup, call: Callable, *args: object):
    """One operation on the group's store; a failing store breaks the group."""
    try:
        return call(*args)
    except RuntimeError as exc:  # torch's DistStoreError
        group.broken = f"its store failed: {exc}"
        raise ConnectionError(f"weights group {group.name!r}: its store failed ({exc})") from None


def _claim(group: WeightsGroup, key: str, frame: bytes) -> bytes:
    """Set `key` to `frame` unless it is set already; returns what it holds now."""
    return _store_call(group, group.store.compare_set, key, "", frame)


def _decode(held: bytes) -> Message | None:
    try:
        return decode(held)
    except ProtocolError:
        return None


# --- engine rank ---


def join_stream(group: WeightsGroup, session_id: str, deadline: float) -> None:
    """Tell the publisher this rank is ready for `session_id` and wait for its word.

    Raises:
        PushCancelledError: the publisher cancelled the push (the reason names why).
        TimeoutError: no word by `deadline` (the group is then broken).
        ConnectionError, ProtocolError: the store or the group failed.
    """
    ready = RankReady(session_id=session_id, group_rank=group.group_rank).encode()
    held = _claim(group, _rank_key(session_id, group.group_rank), ready)
    if held != ready:  # the publisher cancelled before this rank came
        _raise_cancelled(_decode(held), session_id)
    try:
        word = recv_word(group, 0, deadline, HANDSHAKE_TAG)
        if isinstance(word, StreamStart) and word.session_id == session_id:
            return
        _raise_cancelled(word, session_id)
    except ProtocolError as exc:  # the publisher's words and this rank's are out of step
        group.broken = str(exc)
        raise


def _raise_cancelled(word: Message | None, session_id: str) -> None:
    if isinstance(word, UpdateAbort) and word.session_id == session_id:
        raise PushCancelledError(f"by the publisher: {word.reason}")
    raise ProtocolError(
        f"hand-shake of session {session_id}: the publisher's word is a {type(word).__name__}"
    )


def refuse_stream(group: WeightsGroup, session_id: str, reason: str) -> None:
    """Tell the publisher this rank cannot take part in `session_id` (best effort: when the
    store cannot be reached, the engine's answer tells the publisher instead)."""
    refusal = RankRefusal(session_id=session_id, group_rank=group.group_rank, reason=_clip(reason))
    frame = refusal.encode()
    with contextlib.suppress(ConnectionError):
        if _claim(group, _rank_key(session_id, group.group_rank), frame) == frame:
            _store_call(group, group.store.set, _key(session_id, "refused"), frame)


# --- publisher ---


def start_stream(
    group: WeightsGroup,
    session_id: str,
    deadline: float,
    *,
    abandoned: Callable[[], str | None],
    describe_rank: Callable[[int], str],
) -> None:
    """Wait until every engine rank is ready for `session_id`, then tell them to start.

    Args:
        abandoned: why the push cannot complete (an engine answered already), or None.
        describe_rank: a group rank as messages name it (its engine).

    Raises:
        PushCancelledError: an engine or a rank refused; the ranks that were ready were told why.
        TimeoutError: not every rank was ready by `deadline`; likewise.
        ConnectionError: the store or the group failed (the group is then broken).
    """
    _forget_old_sessions(group, session_id)
    ranks = group.receiving_ranks
    try:
        _await_ranks(group, session_id, deadline, abandoned, describe_rank)
    except BaseException as exc:
        reason = exc.reason if isinstance(exc, PushCancelledError) else str(exc) or repr(exc)
        _cancel(group, session_id, ranks, reason, deadline)
        raise
    send_word(group, StreamStart(session_id=session_id), ranks, deadline, HANDSHAKE_TAG)


def _forget_old_sessions(group: WeightsGroup, session_id: str) -> None:
    group.handshakes.append(session_id)
    while len(group.handshakes) > KEPT_SESSIONS:
        old = group.handshakes.popleft()
        keys = [_rank_key(old, rank) for rank in group.receiving_ranks]
        for key in [*keys, _key(old, "refused")]:
            _store_call(group, group.store.delete_key, key)


def _await_ranks(
    group: WeightsGroup,
    session_id: str,
    deadline: float,
    abandoned: Callable[[], str | None],
    describe_rank: Callable[[int], str],
) -> None:
    """Poll the store until every rank claimed its key (then check each said ready), a rank
    refused, the push was abandoned or `deadline` passed."""
    keys = {rank: _rank_key(session_id, rank) for rank in group.receiving_ranks}
    refused = _key(session_id, "refused")
    pause = POLL_FIRST_S

    def check(*wanted: str) -> bool:
        return _store_call(group, group.store.check, list(wanted))

    def refusal(held: bytes) -> str:
        refusal = _decode(held)
        if not isinstance(refusal, RankRefusal):
            raise ProtocolError(f"a refusal in the hand-shake is a {type(refusal).__name__}")
        reason = f"{describe_rank(refusal.group_rank)} refused it: {refusal.reason}"
        group.broken = group.broken or reason  # that rank's side of the group is unusable
        return reason

    while True:
        reason = abandoned()
        if reason is None and check(refused):
            reason = refusal(_store_call(group, group.store.get, refused))
        if reason is not None:
            raise PushCancelledError(reason)
        if check(*keys.values()):
            break
        if time.monotonic() >= deadline:
            missing = [describe_rank(rank) for rank, key in keys.items() if not check(key)]
            raise TimeoutError(f"timed out waiting for {', '.join(missing)} to join the push")
        time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
        pause = min(2 * pause, POLL_LONGEST_S)
    held_keys = _store_call(group, group.store.multi_get, list(keys.values()))
    for rank, held in zip(keys, held_keys, strict=True):
        if isinstance(_decode(held), RankRefusal):
            raise PushCancelledError(refusal(held))
        if _decode(held) != RankReady(session_id=session_id, group_rank=rank):
            raise ProtocolError(f"{describe_rank(rank)} answered the hand-shake wrongly")


def _cancel(
    group: WeightsGroup, session_id: str, ranks: Sequence[int], reason: str, deadline: float
) -> None:
    """Close every rank's key still free; tell every rank that said ready why."""
    abort = UpdateAbort(session_id=session_id, reason=_clip(reason))
    frame = abort.encode()
    ready = [
        rank
        for rank in ranks
        if _decode(_claim(group, _rank_key(session_id, rank), frame))
        == RankReady(session_id=session_id, group_rank=rank)
    ]
    if ready:
        grace = max(deadline, time.monotonic() + CANCEL_GRACE_S)
        send_word(group, abort, ready, grace, HANDSHAKE_TAG)
