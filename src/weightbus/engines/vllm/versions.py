"""What one vLLM worker holds of weightbus versions: the one vLLM serves, one staged for a
two-phase commit, the previous one a rollback can load again, and in which staging buffers.

With one set of buffers (the default) every push overwrites the copy of the served version:
a delta applies to it in place, and no previous version is kept. With two sets
(`VllmInitInfo.keep_previous`) a push lands in the set that does not hold the served version,
so the served version's copy stays: a delta starts from a copy of it (made by applying the
delta that made the served copy again, when the other set holds its base: `catch_up`), and
after the swap it is the previous version a rollback loads. Only buffers whose every tensor is
verified are held (`StagingBuffers.held`); buffers a push started to overwrite hold nothing
until it verified.
"""

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from weightbus.core.meta import TensorMeta
from weightbus.core.wire.delta import DELTA_BASE_REFUSAL
from weightbus.core.wire.messages import SliceSpec
from weightbus.engines.vllm.staging import AppliedDelta, HeldVersion, StagingBuffers

NO_PREVIOUS_ONE_SET = (
    "this vLLM server keeps one staging copy, the served version's (start weightbus's backend "
    "with keep_previous to hold the previous version too)"
)
NO_PREVIOUS_YET = "no earlier weightbus version was served by this vLLM server since it started"
NO_PREVIOUS_OVERWRITTEN = (
    "the copy of the previous version was overwritten by a push that was refused, aborted or is "
    "staged"
)
NOT_SERVED = "vLLM serves no weightbus version it loaded whole (none yet, or a load failed)"


@dataclass(frozen=True, slots=True)
class Staged:
    """A verified version waiting for its commit in buffers `index` until `deadline`
    (`time.monotonic()`).

    Attributes:
        owned: a push wrote the buffers (a staged rollback stages the previous version's own
            buffers, which still hold it if the rollback is dropped).
        only_changed: the commit loads only the blocks whose digest differs from the served
            version's (a rollback, a delta, `skip_unchanged`).
    """

    index: int
    held: HeldVersion
    deadline: float
    owned: bool = True
    only_changed: bool = False


class WorkerVersions:
    """The versions one worker holds, and the staging buffers that hold them.

    Args:
        keep_previous: two sets of buffers (twice the staging memory) so the previous version
            stays held for a rollback.
    """

    def __init__(self, *, keep_previous: bool = False) -> None:
        self.slices: dict[str, SliceSpec] = {}
        self.sets = [StagingBuffers() for _ in range(2 if keep_previous else 1)]
        self.served: HeldVersion | None = None  # what vLLM's parameters hold, by weightbus
        self.served_index: int | None = None  # the buffers that hold the served version
        self.staged: Staged | None = None
        # a weightbus load started once: vLLM's parameters are no longer those it started with
        self.touched = False

    @property
    def keeps_previous(self) -> bool:
        return len(self.sets) == 2

    def resize(self, *, keep_previous: bool) -> None:
        """Keep one or two sets of buffers (the served version's copy stays)."""
        if keep_previous == self.keeps_previous:
            return
        if keep_previous:
            self.sets.append(StagingBuffers(self.slices))
            return
        keep = self.served_index or 0
        for index, buffers in enumerate(self.sets):
            if index != keep:
                buffers.release()
        self.sets = [self.sets[keep]]
        self.served_index = 0 if self.served_index is not None else None
        self.staged = None

    def use_slices(self, slices: dict[str, SliceSpec]) -> None:
        """Hold only this worker's part of the tensors in `slices` from now on."""
        self.slices = slices
        for buffers in self.sets:
            buffers.slices = slices

    # receiving
    def receiving(
        self, base_fingerprint: str | None, metas: Mapping[str, TensorMeta]
    ) -> StagingBuffers:
        """The buffers a push of the tensors `metas` will receive into, laid out for them; what
        they hold is kept until `begin_receive` (a source that cannot be opened loses nothing).

        Raises:
            ValueError: a delta whose base is not served or not held (the publisher then pushes
                the whole version); nothing changed.
        """
        buffers = self.sets[self._free_index()]
        if base_fingerprint is not None:
            self._check_base(base_fingerprint)
        buffers.prepare(metas)
        return buffers

    def begin_receive(
        self, buffers: StagingBuffers, base_fingerprint: str | None, whole: Sequence[str] = ()
    ) -> None:
        """`buffers` (from `receiving`) hold nothing from now on; for a delta
        (`base_fingerprint`, carrying tensors `whole` whole), the base it applies to, and they
        record the delta (`StagingBuffers.applied`). A version staged and not decided is
        dropped (the new push replaces it)."""
        self.drop_staged()
        buffers.applied = None
        if base_fingerprint is not None:
            assert self.served_index is not None
            source = self.sets[self.served_index]
            if source is not buffers:
                buffers.catch_up(source)
            buffers.applied = AppliedDelta(base_fingerprint, list(whole), [])
        buffers.held = None

    def _free_index(self) -> int:
        if not self.keeps_previous or self.served_index is None:
            return 0
        return 1 - self.served_index

    def _check_base(self, base_fingerprint: str) -> None:
        served = self.served
        if served is None or served.fingerprint != base_fingerprint:
            serves = "no weightbus version" if served is None else repr(served.version)
            raise ValueError(
                f"{DELTA_BASE_REFUSAL} {base_fingerprint} is not served by this worker "
                f"(it serves {serves})"
            )
        if self.delta_base() != base_fingerprint:
            raise ValueError(
                f"{DELTA_BASE_REFUSAL} {base_fingerprint} is served but its staging copy was "
                "overwritten by a push that was refused, aborted or is staged: this worker no "
                "longer holds a copy of it"
            )

    def stage(
        self,
        buffers: StagingBuffers,
        held: HeldVersion,
        timeout_s: float,
        *,
        owned: bool = True,
        only_changed: bool = False,
    ) -> None:
        """`buffers` verified `held`: wait for the commit for at most `timeout_s`."""
        buffers.held = held
        deadline = time.monotonic() + timeout_s
        index = self.sets.index(buffers)
        self.staged = Staged(index, held, deadline, owned=owned, only_changed=only_changed)

    # deciding
    def find_staged(self, version: str, fingerprint: str | None) -> Staged:
        """The staged version a commit loads (still staged: `drop_staged` after the decision).

        Raises:
            ValueError: nothing of that version (and fingerprint) is staged, or it expired.
        """
        staged = self.staged
        if staged is None:
            raise ValueError(f"nothing is staged to commit as version {version!r}")
        held = staged.held
        if held.version != version or fingerprint not in (None, held.fingerprint):
            raise ValueError(
                f"the staged version is {held.version!r} ({held.fingerprint}), not {version!r} "
                f"({fingerprint})"
            )
        if time.monotonic() > staged.deadline:
            raise ValueError(
                f"version {version!r} was staged but no commit came within its timeout: discarded"
            )
        return staged

    def buffers_of(self, staged: Staged) -> StagingBuffers:
        return self.sets[staged.index]

    def drop_staged(self) -> None:
        """Forget the staged version (committed, aborted, refused, expired or replaced): buffers
        a push wrote no longer hold a version; a staged rollback's still hold the previous one."""
        staged, self.staged = self.staged, None
        if staged is not None and staged.owned:
            self.sets[staged.index].held = None

    def discard(self, version: str) -> HeldVersion:
        """Drop the staged `version` (an abort); returns what was staged.

        Raises:
            ValueError: nothing of that version is staged.
        """
        staged = self.staged
        if staged is None or staged.held.version != version:
            raise ValueError(f"nothing is staged as version {version!r}")
        self.drop_staged()
        return staged.held

    def loaded(self, buffers: StagingBuffers, held: HeldVersion) -> None:
        """vLLM's parameters now hold `held`, from `buffers`."""
        buffers.held = held
        self.served, self.served_index = held, self.sets.index(buffers)

    def untrusted(self) -> None:
        """A load starts (or failed midway): nothing is known of what vLLM's parameters hold
        until it `loaded`."""
        self.served = self.served_index = None
        self.touched = True

    def delta_base(self) -> str | None:
        """The fingerprint a delta may apply to: the served version's, while a copy of it is
        held (None: none)."""
        if self.served is None or self.served_index is None:
            return None
        held = self.sets[self.served_index].held
        return held.fingerprint if held == self.served else None

    # rolling back
    def previous(self) -> tuple[StagingBuffers | None, str]:
        """The buffers that hold the previous version (None: none, and why)."""
        if self.served is None:
            return None, NOT_SERVED
        if not self.keeps_previous:
            return None, NO_PREVIOUS_ONE_SET
        index = self._free_index()
        buffers = self.sets[index]
        if buffers.held is None:
            return None, NO_PREVIOUS_OVERWRITTEN if buffers.nbytes else NO_PREVIOUS_YET
        staged = self.staged
        if staged is not None and staged.index == index and staged.owned:
            return None, f"version {staged.held.version!r} is staged in its place"
        return buffers, ""

    def find_previous(
        self, version: str, fingerprint: str | None
    ) -> tuple[StagingBuffers, HeldVersion]:
        """The previous version, checked to be `version` (and `fingerprint`).

        Raises:
            ValueError: no previous version is held, or another one.
        """
        buffers, why = self.previous()
        if buffers is None:
            raise ValueError(f"no previous version is held: {why}")
        held = buffers.held
        assert held is not None
        if held.version != version or fingerprint not in (None, held.fingerprint):
            raise ValueError(
                f"the previous version held is {held.version!r} ({held.fingerprint}), not "
                f"{version!r} ({fingerprint})"
            )
        return buffers, held

    def report(self) -> dict:
        """What the control plane reads of this worker (`weightbus_state`)."""
        buffers, why = self.previous()
        staged = self.staged
        live = staged is not None and time.monotonic() <= staged.deadline
        return {
            "served": None if self.served is None else self.served.summary(),
            "delta_base": self.delta_base(),
            "staged": staged.held.summary() if live and staged is not None else None,
            "previous": None if buffers is None or buffers.held is None else buffers.held.summary(),
            "previous_unavailable": why,
            "staging_bytes": sum(buffers.nbytes for buffers in self.sets),
            "touched": self.touched,
        }
