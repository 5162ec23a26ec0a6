"""The engine-target seam: what the Publisher needs of "an engine I can push to".

A target is narrow on purpose (as checkpoint-engine reaches its engine through one callback):
it takes one update order and blocks until the engine committed it or refused, reads back the
version the engine serves, and relays a transport's set-up to its ranks. How the engine pauses
is part of the order (`pause_mode`); how it stages, loads and commits is the target's business.
The reference engine's HTTP API (`http.py`) is one implementation; another engine is one new
module implementing `EngineTarget`.

Targets that can stage a version and swap it in on a later word (`supports_two_phase`) take
part in fleet-wide two-phase pushes and rollbacks: `update` with `order.two_phase` returns once
the engine staged and verified the version (`EngineResult.staged`), then `commit` or `abort`.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Self

import msgspec

from weightbus.core.publisher.probe import LogprobProbe
from weightbus.core.transport.base import EngineRequestError
from weightbus.core.wire import PauseMode
from weightbus.core.wire.messages import SliceSpec
from weightbus.core.wire.order import UpdateOrder
from weightbus.core.wire.phases import EnginePhases


class PushOrder(UpdateOrder, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One engine's update order as the Publisher hands it to the engine's target: the
    `UpdateOrder` the engine is sent (`engine_fields()`), and what the Publisher knows of the
    push that no engine is sent.

    Attributes:
        probe: logprobs the engine must reproduce once it serves the version (targets with
            `scores_probes` only).
        carries_draft: the push carries a draft model's tensors (`draft.` names), set by the
            Publisher from the session's tensor names.
    """

    probe: LogprobProbe | None = None
    carries_draft: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class RollbackOrder:
    """Swap every engine back to the previous version it holds, expected to be `version` with
    `fingerprint`; two-phase like a push when `two_phase`."""

    version: str
    fingerprint: str | None
    pause_mode: PauseMode
    two_phase: bool
    timeout_s: float


@dataclass(frozen=True, slots=True)
class EngineResult:
    """What one engine reported after committing (`fingerprint` is None from targets that
    cannot report it: their ranks verified the pushed fingerprint instead), or with `staged`
    after staging a two-phase update.

    `rank_nbytes[r]`: the bytes that reached TP rank r through the transport in this push, as
    its source counted them (`ReceivedBatch.nbytes`); empty from targets that do not report
    them. `engine_phases`: where the update's time went on the engine (None from targets that
    do not report it): the Publisher places them in `PushResult.phases`.
    """

    url: str
    version: str
    fingerprint: str | None
    nbytes: int
    seconds: float
    phases: dict[str, float]
    staged: bool = False
    rank_nbytes: list[int] = field(default_factory=list)
    engine_phases: EnginePhases | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineWeights:
    """The version an engine serves, read back from it."""

    url: str
    version: str
    fingerprint: str | None
    status: str
    step: int | None = None
    history: list[dict] = field(default_factory=list)
    rollback: dict | None = None  # the previous version held for a rollback (its history item)
    rollback_unavailable: str = ""  # why there is none
    draft: dict | None = None  # the draft model served: `{"version", "fingerprint"}`


class EngineTarget(ABC):
    """An engine the Publisher pushes to. Every method is called from the Publisher's threads,
    at most one `update` at a time per target; each blocks for at most its `timeout_s`.

    Attributes:
        url: names the engine in results and errors.
        reports_fingerprint: `update` returns the fingerprint the engine committed; when False
            its ranks refuse any session whose fingerprint does not verify, and the Publisher
            records the pushed one.
        scores_probes: `update` checks an order's `probe` (`LogprobProbe`).
        supports_two_phase: `update` honours `order.two_phase`, and `commit`, `abort` and
            `rollback` work.
        stages_before_loading: an atomic update receives into staging memory and loads only
            once every rank verified it, so a stream that fails midway changes nothing the
            engine serves (the Publisher may then check NaN/inf in the stream's copies instead
            of in a pass before it). The reference engine serves on meanwhile; vLLM pauses
            while it receives, and resumes on its previous weights after a refusal.
        answers_peers: the engine answers its two-phase peers' question on a version left
            undecided (`POST /v1/weights/outcome`): the Publisher lists it in the other
            engines' `peers` (docs/fleet.md).
    """

    url: str
    reports_fingerprint: bool = True
    scores_probes: bool = False
    supports_two_phase: bool = False
    stages_before_loading: bool = False
    answers_peers: bool = False

    @abstractmethod
    def update(self, order: PushOrder) -> EngineResult:
        """Ask the engine to receive `order` and block until it committed.

        Raises:
            EngineRequestError: the engine refused, failed or did not answer (the reason).
        """

    @abstractmethod
    def weights(self, timeout_s: float) -> EngineWeights:
        """The version, fingerprint and status the engine serves now.

        Raises:
            EngineRequestError: the engine did not answer.
        """

    @abstractmethod
    def tp_size(self, timeout_s: float) -> int:
        """The engine's number of ranks (a transport's set-up sizes its group with it).

        Raises:
            EngineRequestError: the engine did not answer.
        """

    def slice_maps(self, timeout_s: float) -> list[list[SliceSpec]] | None:
        """Each rank's slice of every tensor, in rank order; None (the default) when the
        engine cannot apply a delta push.

        Raises:
            EngineRequestError: the engine did not answer.
        """
        return None

    def expert_map_hash(self, timeout_s: float) -> str | None:
        """The hash of the expert map a mixture-of-experts engine's slice maps follow (None,
        the default: a dense model, or an engine that does not say).

        Raises:
            EngineRequestError: the engine did not answer.
        """
        return None

    def delta_refusal(self, base_version: str, base_fingerprint: str, timeout_s: float) -> str:
        """Why the engine cannot apply a delta on the base `base_fingerprint` ("": it can).
        By default: unless it serves the base (`weights`).

        Raises:
            EngineRequestError: the engine did not answer.
        """
        if self.weights(timeout_s).fingerprint == base_fingerprint:
            return ""
        return f"engine {self.url} does not serve the base {base_version!r}"

    def setup_transport(self, transport: str, info: msgspec.Struct, timeout_s: float) -> None:
        """Have every rank run transport `transport`'s set-up (`info` is its request).

        Raises:
            EngineRequestError: the engine refused or failed; by default it has no set-up for
                any transport.
        """
        raise EngineRequestError(f"{type(self).__name__} cannot set up transport {transport!r}")

    def teardown_transport(self, transport: str, info: msgspec.Struct, timeout_s: float) -> None:
        """Undo `setup_transport` on every rank.

        Raises:
            EngineRequestError: the engine refused or failed.
        """
        raise EngineRequestError(f"{type(self).__name__} cannot set up transport {transport!r}")

    def commit(self, version: str, fingerprint: str | None, timeout_s: float) -> EngineResult:
        """Swap in the two-phase update (or rollback) of `version` the engine holds staged.

        Raises:
            EngineRequestError: nothing of that version is staged, or the engine did not answer.
        """
        raise EngineRequestError(f"{type(self).__name__} cannot commit a two-phase update")

    def abort(self, version: str, reason: str, timeout_s: float) -> None:
        """Discard the two-phase update of `version` (staged or still receiving).

        Raises:
            EngineRequestError: nothing of that version is pending, or no answer.
        """
        raise EngineRequestError(f"{type(self).__name__} cannot abort a two-phase update")

    def rollback(self, order: RollbackOrder) -> EngineResult:
        """Swap back to the previous version (staged with `order.two_phase`).

        Raises:
            EngineRequestError: the engine holds no such previous version (its reason), or it
                did not answer.
        """
        raise EngineRequestError(f"{type(self).__name__} cannot roll back")

    def close(self) -> None:  # noqa: B027 (optional hook: most targets hold nothing)
        """Free what the target holds (connections)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
