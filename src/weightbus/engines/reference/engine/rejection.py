"""Which draft tokens a speculative step keeps: the acceptance rules, as pure functions.

Greedy: keep proposals while they equal the model's argmax, then the model's argmax.
Sampled (Leviathan et al. 2023, Chen et al. 2023): keep proposal `x_i` with probability
`min(1, p_i(x_i) / q_i(x_i))`; at the first rejection draw from `normalize(max(0, p_i - q_i))`;
when all are kept draw a bonus token from `p_K`. Each emitted token then follows the model's
own distribution `p` exactly, whatever the draft's `q`. `p` and `q` are the distributions the
sampler draws from (temperature and top-p applied: `sampler.sampling_probs`).

The draws are split from the rules (`num_accepted` takes the uniforms, `final_token_probs`
returns the distribution of the last token) so that tests can check the output distribution
exactly, by enumeration.
"""

import torch


def accept_greedy(target_token_ids: list[int], proposals: list[int]) -> list[int]:
    """Tokens a greedy speculative step emits.

    Args:
        target_token_ids: the model's argmax after the context and after each proposal
            (`len(proposals) + 1` entries).
        proposals: the draft's tokens.

    Returns:
        The proposals equal to the model's choice, up to the first that is not, then the
        model's token there (or its bonus token after the last proposal).
    """
    assert len(target_token_ids) == len(proposals) + 1
    for i, proposal in enumerate(proposals):
        if proposal != target_token_ids[i]:
            return [*proposals[:i], target_token_ids[i]]
    return [*proposals, target_token_ids[-1]]


def acceptance_probs(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, proposals: list[int]
) -> torch.Tensor:
    """Probability of keeping each proposal: `min(1, p_i(x_i) / q_i(x_i))`.

    Args:
        target_probs: the model's distributions `p_i`, `[num_proposals (+1), vocab_size]`.
        draft_probs: the draft's distributions `q_i`, `[num_proposals, vocab_size]`.
        proposals: the tokens `x_i` drawn from `q_i`.

    Returns:
        float32 `[num_proposals]`; 1 where `q_i(x_i)` is 0 and `p_i(x_i)` is not (a proposal
        the draft could not have drawn is never one the model rules out).
    """
    rows = torch.arange(len(proposals))
    index = torch.tensor(proposals, dtype=torch.long)
    p = target_probs[rows, index]
    q = draft_probs[rows, index]
    ratio = torch.where(q > 0, p / q.clamp(min=torch.finfo(q.dtype).tiny), (p > 0).to(p.dtype))
    return ratio.clamp(max=1.0)


def num_accepted(acceptance: torch.Tensor, uniforms: torch.Tensor) -> int:
    """Proposals kept: those before the first with `uniform >= acceptance`.

    Args:
        acceptance: `acceptance_probs` of each proposal.
        uniforms: one draw from U[0, 1) per proposal.

    Returns:
        A count from 0 to `len(acceptance)`.
    """
    rejected = (uniforms >= acceptance).nonzero()
    return int(rejected[0]) if len(rejected) else len(acceptance)


def residual_probs(target_row: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
    """Where to draw after a rejection: `normalize(max(0, p - q))`.

    Args:
        target_row: the model's distribution `p` at the rejected position.
        draft_row: the draft's distribution `q` there.

    Returns:
        The residual distribution; `p` itself when `p <= q` everywhere (then a rejection has
        probability 0, and only rounding can bring one about).
    """
    residual = (target_row - draft_row).clamp(min=0.0)
    mass = residual.sum()
    return residual / mass if mass > 0 else target_row


def final_token_probs(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, num_kept: int
) -> torch.Tensor:
    """Distribution of the token emitted after `num_kept` proposals.

    Args:
        target_probs: `p_0 .. p_K`, `[K + 1, vocab_size]`.
        draft_probs: `q_0 .. q_{K-1}`, `[K, vocab_size]`.
        num_kept: `num_accepted` of this step.

    Returns:
        The residual at the first rejection, or `p_K` (the bonus token) when all were kept.
    """
    if num_kept == len(draft_probs):
        return target_probs[num_kept]
    return residual_probs(target_probs[num_kept], draft_probs[num_kept])


def accept_sampled(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    proposals: list[int],
    generator: torch.Generator | None,
) -> list[int]:
    """Tokens a sampled speculative step emits (rejection sampling).

    Draws, in this order, from `generator`: one uniform per proposal, then the final token.

    Args:
        target_probs: the model's distributions `p_0 .. p_K`, `[K + 1, vocab_size]`.
        draft_probs: the draft's distributions `q_0 .. q_{K-1}` the proposals were drawn from.
        proposals: the draft's tokens `x_0 .. x_{K-1}`.
        generator: the sequence's generator.

    Returns:
        The kept proposals, then one token from `final_token_probs`.
    """
    uniforms = torch.rand(len(proposals), generator=generator)
    kept = num_accepted(acceptance_probs(target_probs, draft_probs, proposals), uniforms)
    final = torch.multinomial(
        final_token_probs(target_probs, draft_probs, kept), 1, generator=generator
    )
    return [*proposals[:kept], int(final)]
