"""Prefix caching's bookkeeping on rank 0: matches, KV copies, eviction, epochs; no processes."""

from weightbus.engines.reference.engine.prefix_cache import PrefixCache, common_prefix
from weightbus.engines.reference.engine.scheduler import Scheduler
from weightbus.engines.reference.engine.sequence import SamplingParams, Sequence, SequenceStatus

BLOCK = 4
PROMPT = list(range(1, 11))  # 10 tokens: 2 whole blocks fit in its first 9
OTHER = list(range(20, 30))


def make_scheduler(max_num_seqs: int = 3) -> Scheduler:
    return Scheduler(
        max_num_seqs=max_num_seqs,
        max_model_len=64,
        max_num_batched_tokens=256,
        vocab_size=64,
        eos_token_ids=(0,),
        prefix_cache=PrefixCache(block_size=BLOCK),
    )


def seq(request_id: str, prompt: list[int], max_tokens: int = 2, **params: object) -> Sequence:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    return Sequence(request_id, prompt, sampling)


def step(scheduler: Scheduler) -> list[Sequence]:
    """Schedule and append token 50 to every sequence (a forward pass, as far as books go)."""
    batch = scheduler.schedule()
    scheduler.postprocess(batch, [50] * len(batch))
    return batch


def test_common_prefix_counts_whole_blocks_up_to_the_limit() -> None:
    assert common_prefix(PROMPT, PROMPT, 9, BLOCK) == 8
    assert common_prefix(PROMPT, PROMPT, 7, BLOCK) == 4
    assert common_prefix(PROMPT, [*PROMPT[:6], 99], 9, BLOCK) == 4
    assert common_prefix(PROMPT, OTHER, 9, BLOCK) == 0


def test_a_running_sequence_lends_its_prompt_blocks() -> None:
    scheduler = make_scheduler()
    a = seq("a", PROMPT, max_tokens=4)
    scheduler.add(a)
    step(scheduler)
    assert scheduler.kv_copies == []
    b = seq("b", PROMPT)
    scheduler.add(b)
    assert scheduler.schedule() == [a, b]
    assert scheduler.kv_copies == [(b.slot, a.slot, 8)]
    assert b.num_cached_tokens == 8
    assert b.new_token_ids == PROMPT[8:]  # the last prompt token is always computed
    cache = scheduler.prefix_cache
    assert (cache.num_queries, cache.num_hits) == (20, 8)
    assert cache.unreported() == (20, 8)
    assert cache.unreported() == (0, 0)


def test_a_group_arriving_together_prefills_once() -> None:
    scheduler = make_scheduler()
    group = [seq(f"g{i}", PROMPT) for i in range(3)]
    for s in group:
        scheduler.add(s)
    assert scheduler.schedule() == group[:1]  # the others wait one step for its prefix
    scheduler.postprocess(group[:1], [50])
    assert scheduler.schedule() == group
    assert scheduler.kv_copies == [(s.slot, group[0].slot, 8) for s in group[1:]]


def test_finished_slots_are_retained_then_evicted_least_recently_used_first() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    a, b = seq("a", PROMPT, max_tokens=1), seq("b", OTHER, max_tokens=1)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    assert a.status is b.status is SequenceStatus.FINISHED
    cache = scheduler.prefix_cache
    assert list(cache.retained) == [a.slot, b.slot]
    assert cache.retained[a.slot] == PROMPT  # the tokens its KV holds
    assert scheduler.free_slots == []
    # no slot free: the one holding its own prefix is taken as it is (nothing to copy)
    c = seq("c", PROMPT)
    scheduler.add(c)
    assert scheduler.schedule() == [c]
    assert (c.slot, c.num_cached_tokens, scheduler.kv_copies) == (a.slot, 8, [])
    # a new prompt evicts the least recently used retained slot
    d = seq("d", [40] * 10)
    scheduler.add(d)
    assert scheduler.schedule() == [c, d]
    assert (d.slot, d.num_cached_tokens) == (b.slot, 0)
    assert len(cache) == 0


def test_a_retained_slot_is_copied_into_a_free_one() -> None:
    scheduler = make_scheduler()
    a = seq("a", PROMPT, max_tokens=1)
    scheduler.add(a)
    step(scheduler)
    b = seq("b", [*PROMPT, 7, 7])
    scheduler.add(b)
    assert scheduler.schedule() == [b]
    assert b.slot != a.slot
    assert scheduler.kv_copies == [(b.slot, a.slot, 8)]
    assert list(scheduler.prefix_cache.retained) == [a.slot]  # still there for others


def test_new_weights_drop_the_cache_and_running_sequences_stop_lending() -> None:
    scheduler = make_scheduler()
    done, running = seq("done", PROMPT, max_tokens=1), seq("running", OTHER, max_tokens=8)
    scheduler.add(done)
    scheduler.add(running)
    step(scheduler)
    assert len(scheduler.prefix_cache) == 1
    scheduler.drop_cached(new_epoch=True)
    assert len(scheduler.prefix_cache) == 0
    assert sorted(scheduler.free_slots) == sorted({0, 1, 2} - {running.slot})
    again, other_again = seq("again", PROMPT), seq("other_again", OTHER)
    scheduler.add(again)
    scheduler.add(other_again)
    assert scheduler.schedule() == [running, again, other_again]
    assert again.num_cached_tokens == other_again.num_cached_tokens == 0
    assert scheduler.kv_copies == []
    # the old epoch's sequence is not retained when it finishes
    scheduler.abort("running")
    assert running.slot not in scheduler.prefix_cache.retained


def test_no_lookup_for_prompt_logprobs_nor_across_a_swap() -> None:
    scheduler = make_scheduler()
    a = seq("a", PROMPT, max_tokens=1)
    scheduler.add(a)
    step(scheduler)
    scored = seq("scored", PROMPT, prompt_logprobs=True)
    scheduler.add(scored)
    assert scheduler.schedule() == [scored]
    assert scored.num_cached_tokens == 0
    swapped = seq("swapped", PROMPT)
    scheduler.add(swapped)
    scheduler.schedule(use_cache=False)  # the weights change before this step's forward
    assert swapped.num_cached_tokens == 0
    assert scheduler.prefix_cache.num_queries == len(PROMPT)  # a's own lookup only


def test_recompute_running_restarts_their_kv() -> None:
    scheduler = make_scheduler()
    a = seq("a", PROMPT, max_tokens=8)
    scheduler.add(a)
    step(scheduler)
    b = seq("b", OTHER)
    scheduler.add(b)
    scheduler.schedule(use_cache=False)  # the step that swaps the weights
    scheduler.drop_cached(new_epoch=True)
    scheduler.recompute_running()
    scheduler.postprocess([a, b], [51, 51])
    assert scheduler.schedule() == [a, b]
    assert a.new_token_ids == [*PROMPT, 50, 51]  # its whole KV again
    assert a.kv_epoch == scheduler.prefix_cache.epoch
    assert b.new_token_ids == [51]  # computed on the new weights already


def test_the_serve_flag_defaults_on_and_reaches_the_workers() -> None:
    from weightbus.apps.cli import build_parser
    from weightbus.engines.reference.server.launcher import ServeConfig, worker_config

    parser = build_parser()
    assert parser.parse_args(["serve"]).enable_prefix_caching is True
    assert parser.parse_args(["serve", "--no-enable-prefix-caching"]).enable_prefix_caching is False
    config = ServeConfig(enable_prefix_caching=False)
    worker = worker_config(config, 0, 64, ("127.0.0.1", 1), "/nonexistent", parent_pid=1)
    assert worker.enable_prefix_caching is False
