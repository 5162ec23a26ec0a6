"""Speculative steps in one process (TP 1): plans, KV bookkeeping, and greedy equivalence.

`generate` drives the scheduler, the model runner and `speculative` the way rank 0 of
`Worker.step` does, without processes; `test_speculative_server.py` runs the real engine.
"""

from dataclasses import dataclass, field

import pytest
import torch

from weightbus.engines.reference.engine.model_runner import DraftSource, ModelInput, ModelRunner
from weightbus.engines.reference.engine.sampler import SampleResult, sample
from weightbus.engines.reference.engine.scheduler import Scheduler
from weightbus.engines.reference.engine.sequence import SamplingParams, Sequence, SequenceStatus
from weightbus.engines.reference.engine.speculative import (
    SpecPlan,
    SpeculativeDecoder,
    emit,
    plan_step,
)
from weightbus.engines.reference.layers.attention import AttentionMetadata
from weightbus.engines.reference.models.config import tiny_config

MAX_MODEL_LEN = 64
EOS = 257  # tiny's
PROMPTS = [[256, 72, 101, 108], [256, 5], [256, 1, 2, 3, 4, 5, 6, 7, 8]]


def make_runner(draft_seed: int) -> ModelRunner:
    return ModelRunner(
        config=tiny_config(),
        source="tiny",
        dtype=torch.float32,
        max_num_seqs=4,
        max_model_len=MAX_MODEL_LEN,
        draft=DraftSource(tiny_config(), "tiny", draft_seed),
    )


@pytest.fixture(scope="module")
def same_draft() -> ModelRunner:
    return make_runner(draft_seed=0)  # the model's own weights: every proposal is its choice


@pytest.fixture(scope="module")
def other_draft() -> ModelRunner:
    return make_runner(draft_seed=1)


def make_scheduler(max_model_len: int = MAX_MODEL_LEN) -> Scheduler:
    return Scheduler(
        max_num_seqs=4,
        max_model_len=max_model_len,
        max_num_batched_tokens=256,
        vocab_size=tiny_config().vocab_size,
        eos_token_ids=(EOS,),
    )


@dataclass
class Run:
    """Tokens and logprobs per sequence, and the draft tokens proposed/accepted."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    plans: list[SpecPlan] = field(default_factory=list)


def _batch_input(batch: list[Sequence]) -> ModelInput:
    new = [seq.new_token_ids for seq in batch]
    meta = AttentionMetadata(
        slots=[seq.slot for seq in batch],
        start_positions=[seq.num_cached_tokens for seq in batch],
        num_new_tokens=[len(tokens) for tokens in new],
    )
    return ModelInput(torch.tensor([t for tokens in new for t in tokens]), meta)


def generate(runner: ModelRunner, params: list[SamplingParams], num_speculative_tokens: int) -> Run:
    """Run PROMPTS to completion as rank 0 of a TP-1 engine would."""
    scheduler = make_scheduler()
    seqs = [Sequence(str(i), p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True))]
    for seq in seqs:
        scheduler.add(seq)
    decoder = SpeculativeDecoder(runner, is_driver=True, tp_size=1)
    run = Run([[] for _ in seqs], [[] for _ in seqs])
    while scheduler.has_work():
        batch = scheduler.schedule()
        batch_input = _batch_input(batch)
        plan = plan_step(batch, num_speculative_tokens, scheduler)
        if plan is None:
            logits = runner.forward(batch_input)
            result = sample(logits, [s.params for s in batch], [s.generator for s in batch])
            scheduler.postprocess(batch, result.token_ids)
            counts = [1] * len(batch)
        else:
            run.plans.append(plan)
            proposals = decoder.propose(batch_input, plan, batch)
            logits = decoder.verify(batch_input, plan, proposals)
            outcome = decoder.accept(logits, batch_input, proposals, batch)
            result, counts = emit(outcome, plan, batch, scheduler)
            run.num_draft_tokens += sum(plan.num_proposals)
            run.num_accepted_tokens += sum(outcome.num_accepted)
        _record(run, batch, result, counts)
    return run


def _record(run: Run, batch: list[Sequence], result: SampleResult, counts: list[int]) -> None:
    row = 0
    for seq, count in zip(batch, counts, strict=True):
        index = int(seq.request_id)
        run.token_ids[index] += result.token_ids[row : row + count]
        run.logprobs[index] += result.logprobs[row : row + count]
        row += count


def greedy(max_tokens: int = 16) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)] * 3


def test_identical_draft_accepts_everything_and_matches_greedy(same_draft: ModelRunner) -> None:
    plain = generate(same_draft, greedy(), num_speculative_tokens=0)
    spec = generate(same_draft, greedy(), num_speculative_tokens=3)
    assert spec.token_ids == plain.token_ids
    assert [len(tokens) for tokens in spec.token_ids] == [16] * 3
    assert spec.num_accepted_tokens == spec.num_draft_tokens > 0
    # logprobs are the model's, as in a plain step (one pass over several tokens rounds apart)
    for spec_lps, plain_lps in zip(spec.logprobs, plain.logprobs, strict=True):
        assert spec_lps == pytest.approx(plain_lps, abs=1e-4)
    # after the prefill, steps bring 4 tokens while at least 4 are left
    assert len(spec.plans) < 16


def test_random_draft_matches_greedy(other_draft: ModelRunner) -> None:
    plain = generate(other_draft, greedy(), num_speculative_tokens=0)
    spec = generate(other_draft, greedy(), num_speculative_tokens=3)
    assert spec.token_ids == plain.token_ids
    assert 0 <= spec.num_accepted_tokens < spec.num_draft_tokens


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_never_generates_past_max_tokens(same_draft: ModelRunner, max_tokens: int) -> None:
    spec = generate(same_draft, greedy(max_tokens), num_speculative_tokens=3)
    assert [len(tokens) for tokens in spec.token_ids] == [max_tokens] * 3
    # a step proposes no more than it may emit, less one for the model's own token
    for plan in spec.plans:
        assert max(plan.num_proposals) <= max_tokens - 2


def test_seeded_sampling_repeats_and_stays_in_the_vocabulary(other_draft: ModelRunner) -> None:
    def run(seed: int) -> list[list[int]]:
        params = [
            SamplingParams(
                max_tokens=12, temperature=1.0, top_p=0.9, seed=seed + i, ignore_eos=True
            )
            for i in range(3)
        ]
        return generate(other_draft, params, num_speculative_tokens=3).token_ids

    first = run(1)
    assert first == run(1)
    assert first != run(2)
    assert all(0 <= t < tiny_config().vocab_size for tokens in first for t in tokens)
    assert [len(tokens) for tokens in first] == [12] * 3


def test_draft_cache_catches_up_lazily(same_draft: ModelRunner) -> None:
    spec = generate(same_draft, greedy(9), num_speculative_tokens=3)
    first, second = spec.plans[:2]
    # after the prefill (a plain step) the draft has nothing: it is fed prompt + first token
    assert first.draft_start_positions == [0, 0, 0]
    assert [len(t) for t in first.draft_token_ids] == [len(p) + 1 for p in PROMPTS]
    # all 3 proposals kept: the draft cached all but the last proposal, and lacks 2 tokens
    assert second.draft_start_positions == [len(p) + 3 for p in PROMPTS]
    assert [len(t) for t in second.draft_token_ids] == [2, 2, 2]


def test_plan_step_only_when_all_decode() -> None:
    scheduler = make_scheduler()
    a = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0))
    scheduler.add(a)
    assert plan_step(scheduler.schedule(), 3, scheduler) is None  # prefill
    scheduler.postprocess([a], [4])
    plan = plan_step(scheduler.schedule(), 3, scheduler)
    assert plan == SpecPlan([3], [0], [[1, 2, 3, 4]])
    b = Sequence("b", [5], SamplingParams(max_tokens=8, temperature=0.0))
    scheduler.add(b)
    assert plan_step(scheduler.schedule(), 3, scheduler) is None  # b prefills alongside


def test_plan_step_caps_by_context_length() -> None:
    scheduler = make_scheduler(max_model_len=8)
    a = Sequence("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=8, temperature=0.0))
    scheduler.add(a)
    scheduler.postprocess(scheduler.schedule(), [6])
    # 6 tokens of 8: two more at most, so one proposal
    assert plan_step(scheduler.schedule(), 3, scheduler).num_proposals == [1]
    scheduler.postprocess([a], [7])
    assert plan_step(scheduler.schedule(), 3, scheduler) is None  # one left: a plain step


def test_plan_round_trips() -> None:
    plan = SpecPlan([3, 0, 1], [0, 7, 5], [[1, 2, 3], [4], [5, 6]])
    assert SpecPlan.unpack(plan.pack(), 3) == plan


def test_append_tokens_stops_at_the_first_finish() -> None:
    scheduler = make_scheduler()
    a = Sequence("a", [1, 2], SamplingParams(max_tokens=8, temperature=0.0))
    scheduler.add(a)
    scheduler.schedule()
    assert scheduler.append_tokens(a, [3, EOS, 4]) == 2
    assert a.token_ids == [1, 2, 3, EOS]
    assert (a.status, a.finish_reason) == (SequenceStatus.FINISHED, "stop")
    assert a.num_cached_tokens == 3
    b = Sequence("b", [1, 2], SamplingParams(max_tokens=2, temperature=0.0))
    scheduler.add(b)
    scheduler.schedule()
    assert scheduler.append_tokens(b, [3, 4, 5]) == 2
    assert b.finish_reason == "length"
