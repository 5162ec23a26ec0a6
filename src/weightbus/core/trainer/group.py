"""The trainer side of a push is a group of ranks: one process holding every tensor is a group
of one (`TrainerGroup.local()`: no torch.distributed group, no server), a sharded trainer a
group of N (`TrainerGroup.of(process_group, ...)`).

Rank 0, the *leader*, talks to the engines; every rank sends what it holds. The ranks talk
through a `torch.distributed.TCPStore` the leader serves: it `announce`s, each rank `report`s.
Every wait has a deadline and names who did not answer (or failed, with why). Payloads are
msgspec structs (`ControlMessage`), never pickle. A group of one keeps its words in a dict.
"""

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from datetime import timedelta
from typing import TypeVar

import msgspec
import torch
import torch.distributed as dist

T = TypeVar("T")
# asked while waiting: why to stop (a message, or the error to raise), or None
Interrupt = Callable[[], "str | TrainerRankError | None"] | None
_STORE_CALL_S = 10.0  # a follower's store call with no bound of its own (values <= 4 MiB)
_POLL_S = 0.01  # how often an interruptible wait looks for the reports


class ControlMessage(msgspec.Struct, frozen=True, kw_only=True):
    """One word on the control store: `ok` with a typed `body`, or the failure's `error` (and
    the failure's type, `kind`: a refusal the leader raises as such, e.g.
    `NonFiniteWeightsError`)."""

    ok: bool = True
    error: str = ""
    kind: str = ""
    body: bytes = b""

    @classmethod
    def failed(cls, exc: BaseException) -> "ControlMessage":
        return cls(ok=False, error=f"{type(exc).__name__}: {exc}", kind=type(exc).__name__)


class TrainerRankError(ConnectionError):
    """A trainer rank failed, died, or did not answer in time (named in the message): a peer
    of the push is gone, as a broken connection would say.

    Attributes:
        kind: the type of the error the rank reported ("" when it reported none: dead, silent).
        reason: that error's message.
    """

    def __init__(self, message: str, *, kind: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.kind, self.reason = kind, reason


class _LocalStore:
    """The part of `TCPStore` a group uses, for a group of one: a dict in this process. A key
    that is not there never will be (no other rank can set it)."""

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self._values[key] = value

    def get(self, key: str) -> bytes:
        return self._values[key]

    def check(self, keys: Sequence[str]) -> bool:
        return all(key in self._values for key in keys)

    def wait(self, keys: Sequence[str], timeout: timedelta) -> None:
        del timeout
        if not self.check(keys):
            raise dist.DistStoreError("a group of one waits for no other rank")

    def delete_key(self, key: str) -> bool:
        return self._values.pop(key, None) is not None


class TrainerGroup:
    """The ranks that send one push together, as one of them sees it (`local()` or `of(...)`).

    Attributes:
        rank: this rank (0: the leader, which talks to the engines).
        world_size: the number of ranks.
    """

    def __init__(self, store: "dist.Store | _LocalStore", rank: int, world_size: int) -> None:
        self._store = store
        self.rank, self.world_size = rank, world_size
        self._sequence = 0
        self._written: dict[int, list[str]] = {}  # the keys this rank set, by push
        self._watched: str | None = None  # the step whose other ranks' failures end a wait
        # the ranks the leader waited for in vain in this push (dead or stuck)
        self.silent: set[int] = set()

    @classmethod
    def local(cls) -> "TrainerGroup":
        """The group of one: this process holds every tensor."""
        return cls(_LocalStore(), 0, 1)

    @classmethod
    def of(cls, group: dist.ProcessGroup | None, host: str, timeout_s: float) -> "TrainerGroup":
        """The group of every rank of `group` (None: the default process group), built by
        every rank: rank 0 serves the store at `host` (an address every rank reaches) and sends
        its port on `group`. A process group of one is the group of one (`local`: no store).

        Raises:
            TrainerRankError: the ranks could not form the store within `timeout_s`.
        """
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        if world_size == 1:
            return cls.local()
        timeout = timedelta(seconds=timeout_s)
        port = torch.zeros(1, dtype=torch.int64)
        store = None
        if rank == 0:
            store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
            port[0] = store.port
        work = dist.broadcast(port, group=group, group_src=0, async_op=True)
        if not work.wait(timeout):
            raise TrainerRankError(f"trainer rank 0 sent no control address within {timeout_s}s")
        if rank != 0:
            store = dist.TCPStore(host, int(port[0]), is_master=False, timeout=timeout)
            # every store call a rank makes without a bound of its own (set, get, the end of a
            # timed-out wait) waits at most this long: over a link that went dead it would
            # otherwise block for the whole timeout after each wait that already expired
            store.set_timeout(timedelta(seconds=min(timeout_s, _STORE_CALL_S)))
        return cls(store, rank, world_size)

    @contextlib.contextmanager
    def watching(self, step: str) -> Iterator[None]:
        """While this rank does its part of `step`, a wait on the others ends at once, with
        its error, when another rank reports it failed the step (on `<step>/done/<rank>`)."""
        self._watched = step
        try:
            yield
        finally:
            self._watched = None

    def _failed_peer(self) -> "TrainerRankError | None":
        """The first other rank that reported it failed the watched step, as an error."""
        for rank in range(self.world_size):
            key = f"{self._watched}/done/{rank}"
            if rank == self.rank or not self._store.check([key]):
                continue
            message = self._read(key)
            if not message.ok:
                return _failure(f"trainer rank {rank}", message)
        return None

    def _read(self, key: str) -> ControlMessage:
        return msgspec.msgpack.decode(self._store.get(key), type=ControlMessage)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def others(self) -> range:
        """The ranks other than the leader."""
        return range(1, self.world_size)

    def next_push(self) -> str:
        """The key prefix of the next push (every rank counts its pushes alike)."""
        self._sequence += 1
        self.silent = set()
        return f"push/{self._sequence}"

    def forget_earlier_pushes(self) -> None:
        """Delete the keys this rank set in earlier pushes (every rank read them once every
        rank reported on the current push; the store would otherwise keep them all)."""
        for sequence in [s for s in self._written if s < self._sequence]:
            for key in self._written.pop(sequence):
                self._store.delete_key(key)

    def _set(self, key: str, message: ControlMessage) -> None:
        self._store.set(key, msgspec.msgpack.encode(message))
        self._written.setdefault(self._sequence, []).append(key)

    def announce(self, key: str, message: ControlMessage) -> None:
        """Rank 0's word to every rank."""
        self._set(key, message)

    def report(self, key: str, message: ControlMessage) -> None:
        """This rank's answer to `key`."""
        self._set(f"{key}/{self.rank}", message)

    def answer(self, key: str, work: Callable[[], bytes]) -> None:
        """Run `work` and report its result on `key`, or its failure (then raise it)."""
        try:
            body = work()
        except Exception as exc:
            self.report(key, ControlMessage.failed(exc))
            raise
        self.report(key, ControlMessage(body=body))

    def await_announcement(self, key: str, what: str, deadline: float) -> ControlMessage:
        """Rank 0's word on `key`.

        Raises:
            TrainerRankError: none by `deadline`, or rank 0 is gone (the store's host), or it
                announced a failure.
        """
        (message,) = self._collect([key], what, deadline, lambda _: "trainer rank 0").values()
        return message

    def collect(
        self,
        key: str,
        what: str,
        deadline: float,
        ranks: Sequence[int] | None = None,
        interrupt: Interrupt = None,
    ) -> dict[int, ControlMessage]:
        """Every rank's report on `key` (or `ranks`' reports), by rank; `interrupt` (asked
        every `_POLL_S` while waiting) says why to stop waiting, or None.

        Raises:
            TrainerRankError: a rank did not report by `deadline` (each named), or reported a
                failure (the first by rank, with its reason), or `interrupt` gave a reason.
        """
        ranks = range(self.world_size) if ranks is None else ranks
        keys = [f"{key}/{rank}" for rank in ranks]
        if interrupt is None and self._watched is not None and self.world_size > 1:
            interrupt = self._failed_peer
        by_key = self._collect(
            keys, what, deadline, lambda k: f"trainer rank {k.rsplit('/', 1)[1]}", interrupt
        )
        return {rank: by_key[k] for rank, k in zip(ranks, keys, strict=True)}

    def failures(self, key: str, ranks: Sequence[int], deadline: float) -> dict[int, str | None]:
        """Rank 0, after a failed step: why each of `ranks` failed on `key` (its reported
        error, or None when it sent no report by `deadline`: dead or stuck); the ranks that
        reported success are left out."""
        keys = {rank: f"{key}/{rank}" for rank in ranks}
        timeout = timedelta(seconds=max(0.001, deadline - time.monotonic()))
        with contextlib.suppress(dist.DistError):  # some never reported: named below
            self._store.wait(list(keys.values()), timeout)
        found: dict[int, str | None] = {}
        for rank, k in keys.items():
            if not self._store.check([k]):
                found[rank] = None
                self._note_silent([k])
                continue
            message = self._read(k)
            if not message.ok:
                found[rank] = message.error
        return found

    def _collect(
        self, keys: list[str], what: str, deadline: float, who, interrupt: Interrupt = None
    ) -> dict[str, ControlMessage]:
        try:
            if interrupt is None or self.world_size == 1:
                self._wait(keys, what, deadline, who)
            else:
                self._poll(keys, what, deadline, who, interrupt)
        except dist.DistNetworkError as exc:  # the store's host is gone
            raise TrainerRankError(f"trainer rank 0 is unreachable ({what}): {exc}") from exc
        messages = {k: self._read(k) for k in keys}
        for k, message in messages.items():
            if not message.ok:
                raise _failure(who(k), message, f" ({what})")
        return messages

    def _wait(self, keys: list[str], what: str, deadline: float, who) -> None:
        try:
            self._store.wait(keys, timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except dist.DistStoreError:  # the wait timed out
            self._note_silent(keys)
            raise TrainerRankError(f"{self._missing(keys, who)} sent no {what} in time") from None

    def _poll(self, keys: list[str], what: str, deadline: float, who, interrupt) -> None:
        """Look for the reports every `_POLL_S` (no timed store waits: each that expires logs
        a c10d warning), asking `interrupt` in between."""
        while not self._store.check(keys):
            if time.monotonic() >= deadline:
                self._note_silent(keys)
                raise TrainerRankError(f"{self._missing(keys, who)} sent no {what} in time")
            if (reason := interrupt()) is not None:
                if isinstance(reason, TrainerRankError):
                    raise reason
                raise TrainerRankError(
                    f"stopped waiting for {self._missing(keys, who)} ({what}): {reason}"
                )
            time.sleep(_POLL_S)

    def _note_silent(self, keys: list[str]) -> None:
        """The leader: the ranks of `keys` (`<key>/<rank>`) whose report is still missing, into
        `silent` (its store is local: asking it does not block)."""
        if self.is_leader:
            self.silent.update(int(k.rsplit("/", 1)[1]) for k in keys if not self._store.check([k]))

    def _missing(self, keys: list[str], who) -> str:
        """Who did not report: asked of the store only when several could be missing (rank 0,
        whose store is local; a follower waits for one key, and asking a store it cannot reach
        would block again)."""
        if len(keys) == 1:
            return who(keys[0])
        return ", ".join(who(k) for k in keys if not self._store.check([k]))


def run_all(
    pool: ThreadPoolExecutor,
    work: Callable[[T], int],
    items: Sequence[T],
    deadline: float,
    what: str,
) -> int:
    """`work` on every item on `pool`, by `deadline`; the sum of what it returned.

    Raises:
        TimeoutError: not done by `deadline` (the rest is cancelled, running calls finish).
    """
    futures = [pool.submit(work, item) for item in items]
    done, pending = wait(futures, timeout=max(0.0, deadline - time.monotonic()))
    if pending:
        for future in pending:
            future.cancel()
        wait(pending)
        raise TimeoutError(f"{what} were not done in time")
    return sum(future.result() for future in done)


def _failure(who: str, message: ControlMessage, doing: str = "") -> TrainerRankError:
    """The error of a rank (`who`) that reported `message`, a failure (`doing`: of what)."""
    return TrainerRankError(
        f"{who} failed{doing}: {message.error}",
        kind=message.kind,
        reason=f"{message.error.partition(': ')[2]} on {who}",
    )
