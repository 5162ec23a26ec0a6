"""Next-token choice (greedy, temperature, top-p) and logprobs for a batch of sequences."""

from dataclasses import dataclass

import torch

from weightbus.engines.reference.engine.sequence import SamplingParams


@dataclass(frozen=True, slots=True)
class SampleResult:
    """Chosen token per sequence and its log-probability under the model (before temperature).

    `top_token_ids`/`top_logprobs` hold the requested number of best alternatives (empty lists
    when a sequence asked for none).
    """

    token_ids: list[int]
    logprobs: list[float]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]


def _outside_nucleus(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    # keep the smallest prefix whose mass reaches top_p, and always the top token (a top_p
    # below float32's resolution compares with 0.0 and would drop every token)
    outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
    outside[..., 0] = False
    return outside


def _sample_row(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        # logits / temperature overflowed (a temperature near 0, whose limit is greedy), or
        # the logits themselves are not finite: no distribution to draw from
        return int(logits.argmax())
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        sorted_probs[_outside_nucleus(sorted_probs, params.top_p)] = 0.0
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws from, as probabilities in vocabulary order.

    The same transform as sampling: softmax of `logits / temperature`, then the top-p nucleus,
    renormalized. Where that has no finite distribution (greedy, a temperature near 0, logits
    that are not finite) it is its limit: all mass on the argmax.

    Args:
        logits: float32 `[num_rows, vocab_size]` of one sequence.
        params: the sequence's sampling parameters.

    Returns:
        float32 `[num_rows, vocab_size]`, each row summing to 1.
    """
    one_hot = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if params.greedy:
        return one_hot
    probs = torch.softmax(logits / params.temperature, dim=-1)
    finite = torch.isfinite(probs).all(-1, keepdim=True)
    probs = torch.where(finite, probs, one_hot)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        sorted_probs[_outside_nucleus(sorted_probs, params.top_p)] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs /= probs.sum(-1, keepdim=True)
    return probs


def token_logprobs(
    logits: torch.Tensor, token_ids: list[int], num_logprobs: list[int | None]
) -> SampleResult:
    """Logprobs of chosen tokens under the raw distribution, with the best alternatives.

    Args:
        logits: float32 `[num_rows, vocab_size]`, one row per chosen token.
        token_ids: the token chosen at each row.
        num_logprobs: alternatives each row asks for (None or 0: none).

    Returns:
        `token_ids` with their logprobs and the requested top alternatives.
    """
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs[torch.arange(len(token_ids)), torch.tensor(token_ids)].tolist()
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    max_k = max((k or 0 for k in num_logprobs), default=0)
    top = logprobs.topk(max_k, dim=-1) if max_k else None
    for i, num in enumerate(num_logprobs):
        k = num or 0
        top_ids.append(top.indices[i, :k].tolist() if top is not None else [])
        top_lps.append(top.values[i, :k].tolist() if top is not None else [])
    return SampleResult(token_ids, chosen, top_ids, top_lps)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> SampleResult:
    """Pick one token per row of `logits`.

    Args:
        logits: float32 `[num_seqs, vocab_size]`.
        params: sampling parameters of each row.
        generators: each row's generator (None for greedy rows).

    Returns:
        Chosen tokens with their logprobs and the requested top alternatives.
    """
    greedy = logits.argmax(dim=-1)  # first maximum, like transformers' greedy search
    token_ids = [
        int(greedy[i]) if p.greedy else _sample_row(logits[i], p, generators[i])
        for i, p in enumerate(params)
    ]
    return token_logprobs(logits, token_ids, [p.num_logprobs for p in params])
