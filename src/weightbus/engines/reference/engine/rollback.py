"""The version an engine can roll back to: what its staging memory still holds after a swap.

An atomic commit swaps the staging and live parameters, so the version it replaced stays in
memory, whole, until something writes there: the next push staging into it, an in-place push
(the live weights move on without it), or a release of the weights memory. `RollbackSlot`
keeps that version's entry while it is held, and says why not once it is gone.
"""

from weightbus.engines.reference.engine import messages

NOT_YET = "no version has been replaced since the engine started"


class RollbackSlot:
    """The rollback version of rank 0's weights, or why there is none."""

    def __init__(self) -> None:
        self.previous: messages.HistoryEntry | None = None
        self.unavailable = NOT_YET

    def hold(self, previous: messages.HistoryEntry) -> None:
        """A swap kept `previous` whole in the staging memory."""
        self.previous, self.unavailable = previous, ""

    def drop(self, reason: str) -> None:
        """The staging memory no longer holds the previous version (`reason` says why)."""
        self.previous, self.unavailable = None, reason

    def refusal(self, version: str | None, fingerprint: str | None) -> str | None:
        """Why a rollback to `version` / `fingerprint` (None: whatever is held) is refused."""
        previous = self.previous
        if previous is None:
            return f"no previous version is held: {self.unavailable}"
        if version is not None and version != previous.version:
            return f"the previous version held is {previous.version!r}, not {version!r}"
        if fingerprint is not None and fingerprint != previous.fingerprint:
            return (
                f"the previous version {previous.version!r} held has fingerprint "
                f"{previous.fingerprint}, not {fingerprint}"
            )
        return None
