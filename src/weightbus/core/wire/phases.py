"""Where an engine's part of a push went: the phases it reports in its answer.

An engine measures these on its own clock and answers them with the update
(`EngineResult.engine_phases`); the Publisher places them in its own breakdown of the push
(`push_session.phase_breakdown`). Each is the length of one stretch of the engine's work on
the update, in seconds; the stretches do not overlap. A phase the engine does not have (an
in-place load swaps nothing) is 0.
"""

from typing import Annotated

import msgspec

Seconds = Annotated[float, msgspec.Meta(ge=0)]


class EnginePhases(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One engine's phases of an update (each a non-overlapping stretch of its time).

    Attributes:
        verify_s: its ranks' work after the publisher's last bytes arrived (checking the
            digests and values of what came last, and the fingerprint).
        pause_s: waiting for the update's pause mode (running requests to drain) before the
            swap, or before an in-place load (then before any byte arrived: `paused_first`).
        commit_s: swapping the staged version in on every rank (0 in place).
        resume_s: from the swap until the answer left (generation goes on meanwhile).
        paused_first: the pause came before the receive (an in-place load), not after it.
    """

    verify_s: Seconds = 0.0
    pause_s: Seconds = 0.0
    commit_s: Seconds = 0.0
    resume_s: Seconds = 0.0
    paused_first: bool = False
