"""The acceptance rules of speculative decoding, checked exactly (no sampling noise).

The sampled rule is checked by enumeration: for a small vocabulary, every draft proposal
sequence and every acceptance outcome is weighed with the probabilities `rejection` computes,
which gives the exact distribution of the tokens one step emits. Completing each output with
tokens drawn from the model itself must give the model's own distribution over sequences:
speculative decoding changes how fast tokens come, never which.
"""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightbus.engines.reference.engine.rejection import (
    accept_greedy,
    accept_sampled,
    acceptance_probs,
    final_token_probs,
    num_accepted,
    residual_probs,
)
from weightbus.engines.reference.engine.sampler import sample, sampling_probs
from weightbus.engines.reference.engine.sequence import SamplingParams

# --- greedy ---


@pytest.mark.parametrize(
    ("target", "proposals", "emitted"),
    [
        ([4, 5, 6, 7], [4, 5, 6], [4, 5, 6, 7]),  # all kept, then the bonus token
        ([4, 5, 6, 7], [1, 5, 6], [4]),  # first rejected: the model's token
        ([4, 5, 6, 7], [4, 1, 6], [4, 5]),  # a later proposal equal by chance is not kept
        ([4, 5, 6, 7], [4, 5, 1], [4, 5, 6]),
        ([9], [], [9]),  # nothing proposed: a plain greedy step
    ],
)
def test_accept_greedy(target: list[int], proposals: list[int], emitted: list[int]) -> None:
    assert accept_greedy(target, proposals) == emitted


@pytest.mark.parametrize(
    ("acceptance", "uniforms", "kept"),
    [
        ([1.0, 1.0, 1.0], [0.99, 0.5, 0.0], 3),
        ([0.5, 1.0, 1.0], [0.5, 0.0, 0.0], 0),  # uniform == acceptance rejects: P = 0.5 exactly
        ([0.5, 0.2, 1.0], [0.4, 0.3, 0.0], 1),
        ([0.0], [0.0], 0),
        ([], [], 0),
    ],
)
def test_num_accepted(acceptance: list[float], uniforms: list[float], kept: int) -> None:
    assert num_accepted(torch.tensor(acceptance), torch.tensor(uniforms)) == kept


def test_residual_of_equal_distributions_is_the_target() -> None:
    p = torch.tensor([0.25, 0.75])
    assert torch.equal(residual_probs(p, p.clone()), p)


# --- sampled: exact distributions ---

# a distribution per context (a tuple of earlier tokens), for contexts up to the step's length
Tree = dict[tuple[int, ...], torch.Tensor]


def _tree(draw: st.DrawFn, vocab_size: int, depth: int) -> Tree:
    # integer weights 0..4: zeros make supports differ (like top-p), one token always possible
    tree = {}
    for length in range(depth + 1):
        for context in itertools.product(range(vocab_size), repeat=length):
            weights = draw(st.lists(st.integers(0, 4), min_size=vocab_size, max_size=vocab_size))
            weights[draw(st.integers(0, vocab_size - 1))] += 1
            row = torch.tensor(weights, dtype=torch.float64)
            tree[context] = row / row.sum()
    return tree


@st.composite
def model_and_draft(draw: st.DrawFn) -> tuple[Tree, Tree, int, int]:
    vocab_size = draw(st.integers(2, 5))
    num_proposals = draw(st.integers(1, 2))
    target = _tree(draw, vocab_size, num_proposals)
    draft = _tree(draw, vocab_size, num_proposals - 1)
    return target, draft, vocab_size, num_proposals


def step_distribution(
    target: Tree, draft: Tree, vocab_size: int, num_proposals: int
) -> dict[tuple[int, ...], float]:
    """Exact distribution of the tokens one sampled speculative step emits."""
    out: dict[tuple[int, ...], float] = {}
    for proposals in itertools.product(range(vocab_size), repeat=num_proposals):
        contexts = [proposals[:i] for i in range(num_proposals + 1)]
        pairs = zip(contexts[:-1], proposals, strict=True)
        p_proposals = math.prod(float(draft[c][x]) for c, x in pairs)
        if p_proposals == 0:
            continue
        target_probs = torch.stack([target[c] for c in contexts])
        draft_probs = torch.stack([draft[c] for c in contexts[:-1]])
        acceptance = acceptance_probs(target_probs, draft_probs, list(proposals)).tolist()
        for kept in range(num_proposals + 1):
            p_kept = math.prod(acceptance[:kept])
            if kept < num_proposals:
                p_kept *= 1 - acceptance[kept]
            final = final_token_probs(target_probs, draft_probs, kept)
            for token in range(vocab_size):
                emitted = (*proposals[:kept], token)
                out[emitted] = out.get(emitted, 0.0) + p_proposals * p_kept * float(final[token])
    return out


def completed(
    emitted: dict[tuple[int, ...], float], target: Tree, vocab_size: int, length: int
) -> dict[tuple[int, ...], float]:
    """Each emitted prefix continued with tokens of the model itself, up to `length` tokens."""
    out: dict[tuple[int, ...], float] = {}
    for sequence in itertools.product(range(vocab_size), repeat=length):
        total = 0.0
        for prefix, p_prefix in emitted.items():
            if sequence[: len(prefix)] != prefix:
                continue
            rest = range(len(prefix), length)
            total += p_prefix * math.prod(float(target[sequence[:j]][sequence[j]]) for j in rest)
        out[sequence] = total
    return out


@settings(max_examples=60, deadline=None)
@given(model_and_draft())
def test_sampled_step_follows_the_model(case: tuple[Tree, Tree, int, int]) -> None:
    target, draft, vocab_size, num_proposals = case
    emitted = step_distribution(target, draft, vocab_size, num_proposals)
    assert math.isclose(sum(emitted.values()), 1.0, abs_tol=1e-9)
    # the first token alone: P(y) = p(y)
    first = [sum(p for e, p in emitted.items() if e[0] == y) for y in range(vocab_size)]
    assert first == pytest.approx(target[()].tolist(), abs=1e-9)
    # the whole step, continued by the model: the model's distribution over sequences
    length = num_proposals + 1
    expected = {
        seq: math.prod(float(target[seq[:j]][seq[j]]) for j in range(length))
        for seq in itertools.product(range(vocab_size), repeat=length)
    }
    assert completed(emitted, target, vocab_size, length) == pytest.approx(expected, abs=1e-9)


def test_identical_draft_is_always_accepted() -> None:
    probs = torch.softmax(torch.randn(4, 7, generator=torch.Generator().manual_seed(0)), -1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(20):
        proposals = torch.multinomial(probs[:3], 1, generator=generator)[:, 0].tolist()
        emitted = accept_sampled(probs, probs[:3], proposals, generator)
        assert emitted[:3] == proposals
        assert len(emitted) == 4


def test_accept_sampled_draws_uniforms_then_the_final_token() -> None:
    target = torch.tensor([[0.1, 0.9], [0.5, 0.5], [0.3, 0.7]])
    draft = torch.tensor([[0.8, 0.2], [0.5, 0.5]])
    proposals = [0, 1]
    emitted = accept_sampled(target, draft, proposals, torch.Generator().manual_seed(5))
    generator = torch.Generator().manual_seed(5)
    uniforms = torch.rand(2, generator=generator)
    kept = num_accepted(acceptance_probs(target, draft, proposals), uniforms)
    final = torch.multinomial(final_token_probs(target, draft, kept), 1, generator=generator)
    assert emitted == [*proposals[:kept], int(final)]


# --- the distribution both the sampler and the acceptance use ---


@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5, 1e-9])
def test_sampling_probs_is_what_sample_draws_from(top_p: float) -> None:
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(3)) * 3
    params = SamplingParams(max_tokens=1, temperature=0.7, top_p=top_p, seed=0)
    probs = sampling_probs(logits, params)[0]
    assert float(probs.sum()) == pytest.approx(1.0)
    generator = torch.Generator().manual_seed(0)
    drawn = {sample(logits, [params], [generator]).token_ids[0] for _ in range(200)}
    assert drawn <= set(probs.nonzero()[:, 0].tolist())
    # inside the nucleus, the ratios are those of softmax(logits / temperature)
    softmax = torch.softmax(logits[0] / 0.7, -1)
    kept = probs > 0
    assert (probs[kept] / softmax[kept]).tolist() == pytest.approx(
        [float(1 / softmax[kept].sum())] * int(kept.sum()), rel=1e-5
    )


def test_sampling_probs_of_greedy_and_overflow_is_the_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [1e30, -1e30, 0.0]])
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    tiny_temperature = SamplingParams(max_tokens=1, temperature=1e-40)
    one_hot = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert torch.equal(sampling_probs(logits, greedy), one_hot)
    assert torch.equal(sampling_probs(logits, tiny_temperature), one_hot)
