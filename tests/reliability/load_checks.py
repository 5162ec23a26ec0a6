"""Checks of a load run's answers: nothing lost, truthful version spans, transformers agrees."""

import torch
from load_harness import NUM_TOP_LOGPROBS, Exchange, LoadRun, VersionBook
from transformers import DynamicCache

# float32 engine (TP 2) vs transformers on the same weights: fused projections, the TP split
# sums and the KV cache round differently at ~1e-6; logprobs of a 101-token vocabulary stay
# within 1e-4 (as in tests/core/pushes/test_update_e2e.py).
LOGPROB_ATOL = 1e-4
# A greedy token may differ from transformers' argmax only where the two best logprobs are
# within the rounding difference of both sides.
GREEDY_TIE_ATOL = 2 * LOGPROB_ATOL


def abort_reason(version: str) -> str:
    """The documented reason of a request ended by an update in pause mode `abort`."""
    return f"weights update to {version!r} (pause_mode abort)"


def assert_nothing_lost(run: LoadRun) -> None:
    """Every request sent got exactly one HTTP 200 answer, and every push committed."""
    assert run.push_error is None, run.push_error
    assert len(run.pushes) == run.size.num_updates
    assert len(run.exchanges) == run.num_sent >= run.size.num_completions
    failed = [e for e in run.exchanges if e.error is not None or e.status_code != 200]
    assert not failed, [(e.body, e.status_code, e.error, e.answer) for e in failed[:5]]
    assert all(len(e.answer["choices"]) == 1 for e in run.exchanges)


def choice_of(exchange: Exchange) -> dict:
    return exchange.answer["choices"][0]


def assert_finish(exchange: Exchange, pause_mode: str, book: VersionBook) -> None:
    """`length` with every token asked for, or (pause mode `abort` only) `abort` with the
    reason naming the version committed right after the one that generated the tokens."""
    choice, max_tokens = choice_of(exchange), exchange.body["max_tokens"]
    if choice["finish_reason"] == "length":
        assert len(choice["token_ids"]) == max_tokens
        assert choice["abort_reason"] is None
        return
    assert pause_mode == "abort", choice
    assert choice["finish_reason"] == "abort"
    assert 0 < len(choice["token_ids"]) < max_tokens  # it was running: it has a token
    (span,) = choice["weight_versions"]
    assert choice["abort_reason"] == abort_reason(book.order[book.index(span["version"]) + 1])


def assert_spans(exchange: Exchange, pause_mode: str, book: VersionBook) -> None:
    """The spans cover every token in order, name committed versions in commit order, and
    name one version unless the pause mode is `in_place`."""
    choice = choice_of(exchange)
    spans = choice["weight_versions"]
    assert [s["start"] for s in spans] == [0] + [s["end"] for s in spans[:-1]]
    assert spans[-1]["end"] == len(choice["token_ids"])
    assert all(s["start"] < s["end"] for s in spans)
    indices = [book.index(s["version"]) for s in spans]
    assert indices == sorted(set(indices)), spans
    assert choice["weight_version"] == spans[-1]["version"]
    if pause_mode != "in_place":
        assert len(spans) == 1, spans


def assert_clients_see_versions_in_order(run: LoadRun) -> None:
    """A client's next completion never starts under an older version than its last ended."""
    last_index: dict[int, int] = {}
    for exchange in run.exchanges:  # in answer order, so in order per client
        spans = choice_of(exchange)["weight_versions"]
        first, last = (run.book.index(s["version"]) for s in (spans[0], spans[-1]))
        assert first >= last_index.get(exchange.client, 0), spans
        last_index[exchange.client] = last


def _reference_rows(
    book: VersionBook, prompt: list[int], tokens: list[int], spans: list[dict]
) -> torch.Tensor:
    """Logprobs over the vocabulary for each completion token, from transformers.

    The engine continues a sequence across an in-place update with its KV cache: the K/V of
    every position stay those of the version that computed them. So each span is
    teacher-forced with its own version's model, on top of the cache the earlier spans left.
    Token i comes from the logits of position len(prompt) + i - 1, whose input the engine fed
    in the step that produced token i (the whole prompt in token 0's step).
    """
    sequence, cache, rows = prompt + tokens, DynamicCache(), []
    with torch.no_grad():
        for span in spans:
            begin = 0 if span["start"] == 0 else len(prompt) + span["start"] - 1
            end = len(prompt) + span["end"] - 1
            logits = book.models[span["version"]](
                torch.tensor([sequence[begin:end]]), past_key_values=cache, use_cache=True
            ).logits[0]
            rows.append(logits[-(span["end"] - span["start"]) :].float().log_softmax(-1))
    return torch.cat(rows)


def _logprobs(
    exchange: Exchange, book: VersionBook, spans: list[dict]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of each completion token and of its reported alternatives: (token ids [n, 1+k],
    the engine's values, transformers' values, transformers' rows over the vocabulary), with
    transformers decoding each span with the weights of the version `spans` names."""
    choice = choice_of(exchange)
    logprobs = choice["logprobs"]
    assert all(len(ids) == NUM_TOP_LOGPROBS for ids in logprobs["top_token_ids"])
    ids = torch.tensor(
        [[t, *top] for t, top in zip(choice["token_ids"], logprobs["top_token_ids"], strict=True)]
    )
    engine = torch.tensor(
        [
            [lp, *top]
            for lp, top in zip(
                logprobs["token_logprobs"], logprobs["top_token_logprobs"], strict=True
            )
        ]
    )
    rows = _reference_rows(book, exchange.body["prompt"], choice["token_ids"], spans)
    return ids, engine, rows.gather(1, ids), rows


def assert_reproducible(exchange: Exchange, book: VersionBook) -> None:
    """transformers with the weights of each span's version gives the engine's logprobs (of
    each token and of its top alternatives), and for greedy requests the engine's tokens are
    transformers' greedy tokens."""
    _, engine, reference, rows = _logprobs(exchange, book, choice_of(exchange)["weight_versions"])
    torch.testing.assert_close(engine, reference, rtol=0, atol=LOGPROB_ATOL)
    if exchange.body["temperature"] == 0.0:
        best = rows.max(-1).values
        assert bool((best - reference[:, 0] <= GREEDY_TIE_ATOL).all()), exchange


def assert_other_attributions_disagree(exchange: Exchange, book: VersionBook) -> None:
    """Teeth of the span check, for a completion spanning versions: transformers disagrees with
    the engine on the later spans' logprobs when every token is attributed to the first span's
    version, and when each later span is recomputed from scratch with its own version (the
    engine keeps the K/V the older version computed for the earlier positions)."""
    spans = choice_of(exchange)["weight_versions"]
    num_tokens = spans[-1]["end"]

    def max_error(version: str, tokens: slice) -> float:
        whole = [{"version": version, "start": 0, "end": num_tokens}]
        _, engine, reference, _ = _logprobs(exchange, book, whole)
        return float((engine[tokens] - reference[tokens]).abs().max())

    assert max_error(spans[0]["version"], slice(spans[0]["end"], None)) > 10 * LOGPROB_ATOL
    for span in spans[1:]:
        assert max_error(span["version"], slice(span["start"], span["end"])) > 10 * LOGPROB_ATOL
