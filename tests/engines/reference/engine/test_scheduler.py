"""Continuous batching and sampling, without processes."""

import pytest
import torch

from weightbus.engines.reference.engine.sampler import sample
from weightbus.engines.reference.engine.scheduler import Scheduler
from weightbus.engines.reference.engine.sequence import SamplingParams, Sequence, SequenceStatus

EOS = 9


def make_scheduler(**overrides: int) -> Scheduler:
    settings = {"max_num_seqs": 2, "max_model_len": 32, "max_num_batched_tokens": 64}
    settings |= overrides
    return Scheduler(**settings, vocab_size=16, eos_token_ids=(EOS,))


def seq(request_id: str, prompt_len: int = 3, max_tokens: int = 4, **params: object) -> Sequence:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    return Sequence(request_id, [1 + i % 8 for i in range(prompt_len)], sampling)


def test_new_requests_join_between_decode_steps() -> None:
    scheduler = make_scheduler()
    a, b, c = seq("a", max_tokens=1), seq("b", max_tokens=3), seq("c")
    for s in (a, b, c):
        scheduler.add(s)
    batch = scheduler.schedule()
    assert batch == [a, b]  # two slots: c waits
    assert [s.new_token_ids for s in batch] == [[1, 2, 3], [1, 2, 3]]  # prefill
    scheduler.postprocess(batch, [5, 5])
    assert a.finish_reason == "length"
    assert a.status is SequenceStatus.FINISHED
    batch = scheduler.schedule()
    assert batch == [b, c]  # c takes a's slot while b decodes
    assert c.slot == a.slot
    assert [s.new_token_ids for s in batch] == [[5], [1, 2, 3]]
    assert [s.num_cached_tokens for s in batch] == [3, 0]


def test_token_budget_limits_prefills_but_admits_one_long_prompt() -> None:
    scheduler = make_scheduler(max_num_seqs=4, max_num_batched_tokens=8)
    long, short = seq("long", prompt_len=20), seq("short", prompt_len=3)
    scheduler.add(long)
    scheduler.add(short)
    assert scheduler.schedule() == [long]  # alone over budget, still admitted
    scheduler.postprocess([long], [5])
    assert scheduler.schedule() == [long, short]


def test_eos_stops_unless_ignored() -> None:
    scheduler = make_scheduler()
    stops, ignores = seq("stops"), seq("ignores", ignore_eos=True)
    scheduler.add(stops)
    scheduler.add(ignores)
    scheduler.postprocess(scheduler.schedule(), [EOS, EOS])
    assert stops.finish_reason == "stop"
    assert ignores.finish_reason is None
    assert scheduler.schedule() == [ignores]


def test_context_length_finishes_with_length() -> None:
    scheduler = make_scheduler(max_model_len=5)
    s = seq("s", prompt_len=3, max_tokens=100)
    scheduler.add(s)
    scheduler.postprocess(scheduler.schedule(), [4])
    scheduler.postprocess(scheduler.schedule(), [4])
    assert (len(s), s.finish_reason) == (5, "length")


def test_abort_frees_the_slot() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    a, b = seq("a"), seq("b")
    scheduler.add(a)
    scheduler.add(b)
    assert scheduler.schedule() == [a]
    assert scheduler.abort("a")
    assert a.finish_reason == "abort"
    assert scheduler.schedule() == [b]
    assert not scheduler.abort("missing")


@pytest.mark.parametrize(
    ("prompt", "match"), [([], "between 1"), ([1] * 32, "between 1"), ([16], r"\[0, 16\)")]
)
def test_add_rejects_bad_prompts(prompt: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_scheduler().add(Sequence("x", prompt, SamplingParams(max_tokens=1)))


def test_greedy_and_logprobs() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    params = [SamplingParams(max_tokens=1, temperature=0.0, num_logprobs=2)] * 2
    result = sample(logits, params, [None, None])
    assert result.token_ids == [1, 0]
    expected = torch.log_softmax(logits, dim=-1)
    assert result.logprobs == pytest.approx([expected[0, 1].item(), expected[1, 0].item()])
    assert result.top_token_ids[0] == [1, 2]
    assert result.top_logprobs[0] == pytest.approx(expected[0, [1, 2]].tolist())


def test_seeded_sampling_repeats_and_top_p_keeps_the_nucleus() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))

    def draw(seed: int, top_p: float) -> list[int]:
        s = Sequence(
            "x", [1], SamplingParams(max_tokens=1, temperature=1.0, top_p=top_p, seed=seed)
        )
        return [sample(logits, [s.params], [s.generator]).token_ids[0] for _ in range(20)]

    assert draw(7, 1.0) == draw(7, 1.0)
    assert draw(7, 1.0) != draw(8, 1.0)
    # a nucleus smaller than the top token's mass is the top token alone
    top_mass = torch.softmax(logits, -1).max().item()
    assert set(draw(7, top_mass / 2)) == {int(logits.argmax())}


@pytest.mark.parametrize(
    ("temperature", "top_p"),
    [
        (1.0, 1e-300),  # below float32's resolution: compared with 0.0, it dropped every token
        (5e-324, 1.0),  # logits / temperature overflow to inf: softmax is NaN
        (1e-40, 0.5),
    ],
)
def test_extreme_sampling_parameters_pick_the_top_token(temperature: float, top_p: float) -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    s = Sequence(
        "x", [1], SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p, seed=3)
    )
    assert sample(logits, [s.params], [s.generator]).token_ids == [int(logits.argmax())]


def test_non_finite_logits_do_not_stop_sampling() -> None:
    # e.g. a pushed version whose weights hold NaN: the engine must keep answering
    logits = torch.full((1, 50), float("nan"))
    s = Sequence("x", [1], SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, seed=3))
    (token,) = sample(logits, [s.params], [s.generator]).token_ids
    assert 0 <= token < 50
