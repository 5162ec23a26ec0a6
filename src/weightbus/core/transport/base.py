"""The transport seam: a `BucketSink` on the leader of the trainer group, a `RankSender` on
every trainer rank, a `BucketSource` on each engine rank.

A push session runs in three phases on the leader of the trainer group: `sink.prepare` makes
the session readable and returns the `SourceDescription` engines open (`for_engine` adapts it
to each); the leader asks every engine to update from it; `sink.stream` sends the rest.

The sink talks to the engine ranks; the bytes are written by every trainer rank's `RankSender`
(`weightbus.core.transport.sending`), each reporting its bytes and digests.

Each engine rank opens the description with `open_source` and reads `begin()`, `batches()`
(each valid until its `release()`), then `end()`. Transports never parse model names.

A transport that needs set-up across engines before its first push (the `dist` weights group)
does it in `sink.setup(engines, ...)`, reaching each engine through the narrow `EngineLink`.
"""

import functools
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import msgspec
import torch

from weightbus.core.digest import fingerprint_of_metas
from weightbus.core.plan import Plan
from weightbus.core.transport.sending import Sending
from weightbus.core.wire import UpdateBegin, UpdateEnd, WireMeta

# Called with the bytes handed over so far, e.g. to draw a progress bar.
Progress = Callable[[int], None]


def no_progress(nbytes: int) -> None:
    """Default progress callback: report nothing."""


class SourceDescription(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of a transport's description of one session: what its sink returns from `prepare`
    and what every engine rank opens. Each transport declares one subclass (its fields, types
    and ranges); `weightbus.core.transport.decode_description` is the only parser."""


DEFAULT_SETUP_TIMEOUT_S = 60.0


class RankSetupRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of a transport's rank set-up requests (the registry's `setup_request`), with what
    an engine needs to run one without knowing the transport (hooks a transport may override).

    Attributes:
        teardown: this kind of request undoes a set-up (the engine's `/v1/teardown_transport`
            takes it, `/v1/setup_transport` the others).
        change: what the request changes, as a noun ("another <change> is in progress").
        busy: why an update is refused while the request runs.
    """

    teardown: ClassVar[bool] = False
    change: ClassVar[str] = "transport set-up"
    busy: ClassVar[str] = "a transport is being set up or torn down"

    def wait_s(self) -> float:
        """How long the ranks may take (the engine gives up a few seconds later)."""
        return DEFAULT_SETUP_TIMEOUT_S

    def refusal(self, tp_size: int) -> str | None:
        """Why an engine of `tp_size` ranks cannot run this request (a 400), or None."""
        del tp_size
        return None

    def done_message(self, tp_size: int) -> str:
        """What an engine of `tp_size` ranks answers once every rank ran the request."""
        return f"{'torn down' if self.teardown else 'set up'} on {tp_size} ranks"

    def stalled_message(self, waited_s: float) -> str:
        """Why a rank gave up on the request after `waited_s` seconds without an end."""
        return f"the {self.change} did not return within {waited_s:g} s"


class EngineRequestError(RuntimeError):
    """An engine refused or failed a request; the message is the reason."""


class EngineLink(Protocol):
    """What a sink's `setup` may ask of one engine (publisher-side engine targets provide it)."""

    url: str

    def tp_size(self, timeout_s: float) -> int:
        """The engine's number of ranks."""

    def setup_transport(self, transport: str, info: msgspec.Struct, timeout_s: float) -> None:
        """Have every rank of the engine run the transport's set-up with `info`.

        Raises:
            EngineRequestError: the engine refused or failed.
        """

    def teardown_transport(self, transport: str, info: msgspec.Struct, timeout_s: float) -> None:
        """Undo `setup_transport` on every rank of the engine.

        Raises:
            EngineRequestError: the engine refused or failed.
        """


class ByteCounter:
    """Bytes added up by any thread (a sink's workers, a routed push's child sinks)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._total += nbytes

    @property
    def total(self) -> int:
        with self._lock:
            return self._total


@dataclass(frozen=True, slots=True, kw_only=True)
class PushSession:
    """What a sink needs to know about one push (publisher side).

    `digests` fills while the session runs, from the trainer ranks' reports; `fingerprint`
    needs them all. `sent_bytes` counts the tensor bytes the sink handed to its transport
    (`count_sent`; never padding or message frames), summed over every receiver it sent to
    separately (a `dist` broadcast counts each entry once).
    """

    session_id: str
    version: str
    step: int | None
    plan: Plan
    digests: dict[str, str] = field(default_factory=dict)
    receivers: int = 1  # engines asked to receive this session (each with all its ranks)
    engines: tuple[str, ...] = ()  # their URLs, in push order (when the publisher names them)
    verify: bool = True  # receivers check digests ("full"): sinks send what they need
    # filled (by the Publisher) once an engine has answered mid-stream: it will read no more,
    # so a sink waiting on its ranks stops at once instead of at its timeout
    abandon_reasons: list[str] = field(default_factory=list)
    answered: set[str] = field(default_factory=set)  # the URLs of the engines that answered
    # engines the stream failed because of (answered mid-stream, or did not join in time): the
    # others were waiting, and were told to abort
    at_fault: set[str] = field(default_factory=set)
    # when every engine rank had joined (`mark_joined`, by sinks whose ranks join)
    joined: list[float] = field(default_factory=list, compare=False, repr=False)
    sent: ByteCounter = field(default_factory=ByteCounter, compare=False, repr=False)

    def count_sent(self, nbytes: int) -> None:
        """Add `nbytes` tensor bytes handed to the transport (any thread)."""
        self.sent.add(nbytes)

    def mark_joined(self) -> None:
        """Every engine rank joined the session now (`joined_at`)."""
        self.joined.append(time.perf_counter())

    @property
    def joined_at(self) -> float | None:
        """When every engine rank had joined (`time.perf_counter()`; None: not marked): the
        Publisher counts the time until then as the order's, not the stream's."""
        return self.joined[-1] if self.joined else None

    @property
    def sent_bytes(self) -> int:
        """Tensor bytes handed to the transport so far in this push."""
        return self.sent.total

    def abandon(self, reason: str, url: str | None = None) -> None:
        """Record why the stream cannot complete (any thread); `url`: the engine that answered."""
        if url is not None:
            self.answered.add(url)
        self.abandon_reasons.append(reason)

    @property
    def abandoned(self) -> str | None:
        """The first reason the stream cannot complete, or None."""
        return self.abandon_reasons[0] if self.abandon_reasons else None

    @property
    def fingerprint(self) -> str:
        """The version's fingerprint (every tensor must be digested).

        Raises:
            RuntimeError: some tensor has no digest yet.
        """
        missing = [meta.name for meta in self.plan.metas if meta.name not in self.digests]
        if missing:
            raise RuntimeError(f"no digest yet for {len(missing)} tensors, e.g. {missing[0]!r}")
        return fingerprint_of_metas(self.plan.metas, self.digests)

    def begin_message(self) -> UpdateBegin:
        return UpdateBegin(
            session_id=self.session_id,
            version=self.version,
            step=self.step,
            plan_hash=self.plan.plan_hash,
            bucket_bytes=self.plan.bucket_bytes,
            tensors=[WireMeta.of(meta) for meta in self.plan.metas],
        )

    def end_message(self) -> UpdateEnd:
        return UpdateEnd(
            session_id=self.session_id,
            version=self.version,
            num_buckets=self.plan.num_buckets,
            fingerprint=self.fingerprint,
        )


@dataclass(frozen=True, slots=True)
class EngineRoute:
    """How one engine of a push receives it: the transport named in its order, the description
    it opens and the `verify` level its ranks run."""

    transport: str
    source: SourceDescription
    verify: str


@dataclass(slots=True, kw_only=True)
class ReceivedBatch:
    """Whole tensors delivered together, with the digests the publisher sent for them.

    The tensors may alias transport memory: use them before `release()`. `placed` lists
    tensors the publisher already wrote into this rank's parameters (direct mode) with the
    region each filled (None where this rank holds no slice of it), `placed_digests` the
    digests of those regions' bytes. `nbytes`: the tensor bytes that reached this rank
    through the transport for this batch.
    """

    tensors: list[tuple[str, torch.Tensor]]
    digests: dict[str, str]
    nbytes: int
    release: Callable[[], None] = field(default=lambda: None)
    placed: list[tuple[str, torch.Tensor | None]] = field(default_factory=list)
    placed_digests: dict[str, str] = field(default_factory=dict)


class BucketSink(ABC):
    """The leader's side of a transport. One sink serves many pushes; `close()` frees it.

    `carries_any_tensors`: a session may carry tensors that are not the engines' parameters
    (a delta's payload). `copies_locally`: it moves bytes at memory-copy speed on one host,
    where comparing with the last version costs more than it saves.
    `refuses_nonfinite_in_stream`: its copies refuse NaN/inf as they go, so a push may skip its
    pre-pass. `key`: names this sink's senders on every trainer rank.
    """

    name: str
    carries_any_tensors: bool = True
    copies_locally: bool = False
    refuses_nonfinite_in_stream: bool = False

    @functools.cached_property
    def key(self) -> str:
        return f"{self.name}-{secrets.token_hex(4)}"

    def everyone(self, sending: Sending, order: Any, hooks: Any = None) -> list:
        """Every trainer rank runs `order` with its sender of this sink (`Sending.everyone`)."""
        return sending.everyone(self.key, self.name, order, hooks)

    @property
    def mode(self) -> str:
        """How the last session travelled (sinks with several modes name theirs)."""
        return self.name

    def keys(self) -> list[str]:
        """The keys of this sink and of any it holds (each trainer rank has a sender of each)."""
        return [self.key]

    def carries_any_tensors_from(self, ranks: int) -> bool:
        """`carries_any_tensors` for a session sent by a group of `ranks` trainer ranks."""
        del ranks
        return self.carries_any_tensors

    def setup(
        self, engines: Sequence[EngineLink], steps: Sending | None = None, **options: Any
    ) -> Any:
        """Set the transport up across `engines` (and, through `steps`, the trainer ranks)
        before pushing (most transports need none).

        Raises:
            ValueError: this transport has no set-up.
        """
        raise ValueError(f"transport {self.name!r} needs no set-up")

    def teardown(self, timeout_s: float) -> None:  # noqa: B027 (optional: most need none)
        """Undo `setup` on the engines and here (a no-op when there was none)."""

    def setup_on_push(self, steps: Sending | None) -> dict[str, Any] | None:
        """The options of a set-up a push must do first when none was done, or None."""
        del steps
        return None

    def setup_broken(self) -> str | None:
        """Why the set-up must be done again before the next push, or None."""
        return None

    def teardown_engine(self, engine: EngineLink, timeout_s: float) -> None:  # noqa: B027
        """Undo `setup` on one engine that leaves (a no-op when there is no set-up).

        Raises:
            EngineRequestError: the engine refused or did not answer.
        """

    def sibling_options(
        self, sink_options: dict[str, Any], setup_options: dict[str, Any] | None
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Sink and set-up options of a second sink working beside this one (a joining
        engine's catch-up push); by default the same."""
        return sink_options, setup_options

    @abstractmethod
    def prepare(
        self, session: PushSession, sending: Sending, progress: Progress = no_progress
    ) -> SourceDescription:
        """Make the session readable; return the description engines open (`progress`: the
        bytes handed over so far)."""

    def for_engine(self, description: SourceDescription, engine_index: int) -> SourceDescription:
        """The description engine number `engine_index` opens (by default the same for all)."""
        return description

    def route(self, description: SourceDescription, engine_index: int, verify: str) -> EngineRoute:
        """How engine number `engine_index` receives the push (asked after `prepare`); a sink
        that sends each engine over another transport answers per engine."""
        return EngineRoute(
            self.name, self.for_engine(description, engine_index), self.receiver_verify(verify)
        )

    def engine_answered(self, session: PushSession, url: str, reason: str) -> None:
        """Engine `url` answered mid-stream: it reads no more (by default, stop the stream)."""
        session.abandon(reason, url)

    @abstractmethod
    def stream(
        self,
        session: PushSession,
        sending: Sending,
        timeout_s: float,
        progress: Progress = no_progress,
    ) -> None:
        """Send whatever `prepare` did not; return when receivers have everything.

        Raises:
            TimeoutError: receivers did not take the data within `timeout_s`.
            NonFiniteWeightsError: `sending.refuse_nonfinite` and a tensor holds NaN or inf
                (the engine ranks were told to abort).
            TrainerRankError: a trainer rank failed, died or did not report (named).
        """

    def receiver_verify(self, verify: str) -> str:
        """The `verify` level engines run the prepared session with (asked after `prepare`;
        "none" from a sink that delivers only slices and checks the bytes itself)."""
        return verify

    @abstractmethod
    def close(self) -> None:
        """Free every resource of the sink (files, shared memory, sockets)."""


class BucketSource(ABC):
    """Receiver side of a transport, for one session on one rank: built as
    `Source(description, rank=..., tp_size=...)` with the sink's `for_engine` description."""

    @abstractmethod
    def begin(self, timeout_s: float) -> UpdateBegin:
        """The session header.

        Raises:
            TimeoutError: nothing arrived within `timeout_s`.
            ValueError: the session cannot be read (its message names what is wrong).
        """

    @abstractmethod
    def batches(self, timeout_s: float) -> Iterator[ReceivedBatch]:
        """Batches of whole tensors in stream order; each must be released before the next
        two are requested (transports may reuse their memory)."""

    @abstractmethod
    def end(self, timeout_s: float) -> UpdateEnd:
        """The publisher's closing message, after the last batch."""

    def close(self) -> None:  # noqa: B027 (optional hook: most sources have nothing to free)
        """Free this rank's resources of the session."""
