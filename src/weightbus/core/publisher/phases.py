"""A push's breakdown by phase: where each second of `PushResult.seconds` went.

The Publisher times its own steps (`StepTimes`); the engines report theirs (`EnginePhases`:
verify, pause, commit, resume). `phase_breakdown` places the engine's phases in the windows of
the Publisher's steps in which they happened, so the phases do not overlap and add up to the
steps' time:

- `plan_s` (Publisher): the plan of the tensors (reused while unchanged) and the session;
- `prepare_s` (Publisher): the transport's preparation (`sink.prepare`);
- `order_s` (Publisher): from handing out the orders until every engine rank joined the
  session: the control round trip in (HTTP, the engine's step, its ranks opening the receive);
- `pause_s` (engine): waiting for the pause mode, before the swap (in place: before the load,
  so inside the order's window);
- `stream_s` (Publisher): the bytes, from every rank joined until the stream ended;
- `verify_s` (engine): its ranks' work after the last bytes (digests and values of what came
  last, the fingerprint);
- `commit_s` (engine): the swap on every engine rank;
- `resume_s` (engine): from the swap until the engine's answer left;
- `acks_s` (Publisher, less the engine's phases): the rest of the wait for the answers: the
  verdicts gathered across ranks, the step that acts on them, the answers' way back
  (two-phase: of both rounds).

With several engines the slowest engine's phases are placed (the one whose phases add up to
the most); transports whose ranks do not join a session report no `order_s` of their own (it
is then part of `stream_s`), and engines that report no phases leave the whole wait in
`acks_s`.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from weightbus.core.wire.phases import EnginePhases

# In the order a push goes through them.
PHASES = (
    "plan_s",
    "prepare_s",
    "order_s",
    "pause_s",
    "stream_s",
    "verify_s",
    "commit_s",
    "resume_s",
    "acks_s",
)


@dataclass(slots=True)
class StepTimes:
    """The Publisher's own steps of one push, in seconds (0: not run).

    Attributes:
        joined_s: of `stream_s`, the wait until every engine rank joined (0: the transport's
            ranks do not join, or they had before the stream began).
        collect_s: from the stream's end until every engine answered (two-phase: staged).
        commit_s: two-phase: the commit round.
    """

    plan_s: float = 0.0
    prepare_s: float = 0.0
    order_s: float = 0.0
    stream_s: float = 0.0
    joined_s: float = 0.0
    collect_s: float = 0.0
    commit_s: float = 0.0


def _slowest(phases: Sequence[EnginePhases | None]) -> EnginePhases:
    """The engine phases that add up to the most (none reported: all zero)."""
    reported = [p for p in phases if p is not None]
    if not reported:
        return EnginePhases()
    return max(reported, key=lambda p: p.verify_s + p.pause_s + p.commit_s + p.resume_s)


def _fit(parts: Sequence[float], window_s: float) -> tuple[list[float], float]:
    """Each part, in order, as much of it as is left of `window_s`; and what is left then."""
    fitted = []
    left = max(0.0, window_s)
    for part in parts:
        taken = min(max(0.0, part), left)
        fitted.append(taken)
        left -= taken
    return fitted, left


def phase_breakdown(
    steps: StepTimes,
    answered: Sequence[EnginePhases | None],
    committed: Sequence[EnginePhases | None] = (),
) -> dict[str, float]:
    """Every phase of `PHASES`, in seconds, from the Publisher's `steps` and the engines'
    phases in their answers (`answered`: the first round's, two-phase staged; `committed`:
    the commit round's).

    The phases add up to the steps' seconds: each engine phase is taken from the window of
    the step it happened in, at most what that window holds.
    """
    first, second = _slowest(answered), _slowest(committed)
    swap = second if committed else first
    joined_s = min(max(0.0, steps.joined_s), steps.stream_s)
    in_place_pause_s = first.pause_s if first.paused_first else 0.0
    (pause_before_s,), order_s = _fit([in_place_pause_s], steps.order_s + joined_s)
    swap_parts = [0.0 if swap.paused_first else swap.pause_s, swap.commit_s, swap.resume_s]
    if committed:
        (verify_s,), acks_s = _fit([first.verify_s], steps.collect_s)
        (pause_s, commit_s, resume_s), commit_acks_s = _fit(swap_parts, steps.commit_s)
        acks_s += commit_acks_s
    else:
        fitted, acks_s = _fit([first.verify_s, *swap_parts], steps.collect_s)
        verify_s, pause_s, commit_s, resume_s = fitted
    return {
        "plan_s": steps.plan_s,
        "prepare_s": steps.prepare_s,
        "order_s": order_s,
        "pause_s": pause_before_s + pause_s,
        "stream_s": steps.stream_s - joined_s,
        "verify_s": verify_s,
        "commit_s": commit_s,
        "resume_s": resume_s,
        "acks_s": acks_s,
    }
