"""A push's phases: the Publisher's steps and the engine's own, reported in `PushResult.phases`
(plan, order, pause, stream, verify, commit, resume, acks), none negative, adding up to no
more than the push's seconds."""

import secrets

import pytest

from weightbus import Publisher
from weightbus.core.publisher.phases import PHASES, StepTimes, phase_breakdown
from weightbus.core.wire.phases import EnginePhases
from weightbus.engines.reference.models.config import tiny_config
from weightbus.engines.reference.models.loader import random_hf_weights


def _check(phases: dict[str, float], seconds: float) -> None:
    assert set(PHASES) <= set(phases)
    assert all(value >= 0 for value in phases.values()), phases
    assert sum(phases.values()) <= seconds, (phases, seconds)


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "in_place"])
def test_a_real_push_reports_every_phase(engine, atomic):
    weights = list(random_hf_weights(tiny_config(), 11))
    with Publisher([engine.url], transport="shm", timeout_s=60) as pub:
        result = pub.push(weights, version=f"phases-{secrets.token_hex(4)}", atomic=atomic)
    _check(result.phases, result.seconds)
    reported = result.engines[0].engine_phases
    assert reported is not None  # the reference engine answers with its phases
    assert reported.paused_first is not atomic
    if atomic:  # the engine measured its swap
        assert reported.commit_s > 0
    assert result.phases["stream_s"] > 0
    assert result.phases["order_s"] > 0


def test_engine_phases_fit_the_windows_they_happened_in():
    steps = StepTimes(plan_s=0.1, order_s=0.2, stream_s=1.0, joined_s=0.3, collect_s=0.5)
    engine = EnginePhases(verify_s=0.2, pause_s=0.1, commit_s=0.1, resume_s=0.5)
    phases = phase_breakdown(steps, [engine, None])
    assert phases["order_s"] == pytest.approx(0.5)  # the wait for the ranks to join
    assert phases["stream_s"] == pytest.approx(0.7)
    # the engine's phases fill the wait after the stream (0.5 s), in order, and no more
    assert [phases[k] for k in ("verify_s", "pause_s", "commit_s")] == pytest.approx(
        [0.2, 0.1, 0.1]
    )
    assert phases["resume_s"] == pytest.approx(0.1)
    assert phases["acks_s"] == pytest.approx(0.0)
    assert sum(phases.values()) == pytest.approx(0.1 + 0.2 + 1.0 + 0.5)
    in_place = EnginePhases(verify_s=0.1, pause_s=0.3, resume_s=0.1, paused_first=True)
    phases = phase_breakdown(steps, [in_place])
    assert phases["pause_s"] == pytest.approx(0.3)  # before the load: in the order's window
    assert phases["order_s"] == pytest.approx(0.2)
    assert phases["acks_s"] == pytest.approx(0.3)
    staged, swapped = EnginePhases(verify_s=0.1), EnginePhases(pause_s=0.05, commit_s=0.05)
    two_phase = StepTimes(stream_s=1.0, collect_s=0.3, commit_s=0.2)
    phases = phase_breakdown(two_phase, [staged], [swapped])
    assert phases["verify_s"] == pytest.approx(0.1)
    assert phases["commit_s"] == pytest.approx(0.05)
    assert phases["acks_s"] == pytest.approx(0.2 + 0.1)
