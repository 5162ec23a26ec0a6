"""`weightbus bench engine --draft`: speculative decoding over the demo's training run.

Three engines serve the demo's policy, same TP, same requests: `plain` (no draft), `in step`
(a one-layer draft distilled on the policy's rollouts after every step and pushed with it, one
version) and `frozen` (the same draft as it was at step 0: its pushes carry the policy only,
`keep_draft=True`). Every RL step samples the same seeded rollouts from each engine in turn and
reports each one's tokens/s and, for the drafted ones, the share of draft tokens accepted
(`/metrics`). The `in step` engine's rollouts train the policy. A greedy batch-1 round before
the first step and after the last gives each engine's latency-bound tokens/s.
"""

import argparse
import logging
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from weightbus.apps.demo.draft import DraftRun
from weightbus.apps.demo.rollout import RolloutClient
from weightbus.apps.demo.task import prompts
from weightbus.apps.demo.trainer import Trainer, tiny_hf_config
from weightbus.apps.launch import start_engine, stop_engines
from weightbus.core.publisher import Publisher
from weightbus.engines.reference.models.config import tiny_config

ENGINES = ("plain", "in step", "frozen")
GREEDY_TOKENS = 64


@dataclass(slots=True)
class _Engine:
    """One engine of the comparison: its client, its publisher and how it is pushed."""

    name: str
    client: RolloutClient
    publisher: Publisher
    drafted: bool
    keep_draft: bool = False
    rows: list[tuple[float, float | None]] = field(default_factory=list)  # (tok/s, accepted)

    def sample(self, step_prompts: list[list[int]], samples: int, seed: int) -> list:
        """Seeded rollouts; records tokens/s and the accepted share of draft tokens."""
        before = self.client.draft_tokens() if self.drafted else None
        tick = time.perf_counter()
        rollouts = self.client.sample(step_prompts, samples, seed=seed)
        seconds = time.perf_counter() - tick
        accepted = None if before is None else self.client.acceptance_since(before)
        self.rows.append((sum(len(r.token_ids) for r in rollouts) / seconds, accepted))
        return rollouts


def _greedy_tokens_per_s(engine: _Engine, prompt: list[int]) -> float:
    """One greedy completion at batch 1 (EOS ignored): tokens per second."""
    tick = time.perf_counter()
    token_ids = engine.client.greedy(prompt, GREEDY_TOKENS)
    return len(token_ids) / (time.perf_counter() - tick)


def _start(args: argparse.Namespace, model_dir: Path, draft_dir: Path) -> dict:
    """The three engines (processes and URLs), plain first, started side by side."""
    flags = ["--draft-model", str(draft_dir), "--num-speculative-tokens", str(args.num_spec)]
    with ThreadPoolExecutor(max_workers=len(ENGINES)) as pool:
        futures = {
            name: pool.submit(
                start_engine, str(model_dir), args.tp[0], extra=[] if name == "plain" else flags
            )
            for name in ENGINES
        }
    started, errors = {}, []
    for name, future in futures.items():
        try:
            started[name] = future.result()
        except RuntimeError as exc:
            errors.append(exc)
    if errors:
        stop_engines([proc for proc, _ in started.values()])
        raise errors[0]
    return started


def run_speculation(args: argparse.Namespace) -> int:
    """The comparison; prints one row per step and the greedy batch-1 figures."""
    torch.set_num_threads(1)  # the engines need the cores more than the tiny trainer
    logging.getLogger("weightbus.core.publisher").setLevel(logging.WARNING)  # a line per push
    trainer = Trainer(tiny_hf_config(), seed=0, lr=args.lr)
    draft = DraftRun(tiny_config(), seed=1, temperature=1.0, num_speculative_tokens=args.num_spec)
    draft.warm_up(trainer.model, prompts(4), args.max_tokens)
    with tempfile.TemporaryDirectory(prefix="weightbus-bench-spec-") as tmp:
        trainer.save(Path(tmp))
        draft.trainer.save(Path(tmp) / "draft")
        started = _start(args, Path(tmp), Path(tmp) / "draft")
        engines = [
            _Engine(
                name,
                RolloutClient(url, max_tokens=args.max_tokens, temperature=1.0),
                Publisher([url], transport="shm"),
                drafted=name != "plain",
                keep_draft=name == "frozen",
            )
            for name, (_, url) in started.items()
        ]
        try:
            _report(args, _measure(args, trainer, draft, engines))
        finally:
            for engine in engines:
                engine.publisher.close()
                engine.client.close()
            stop_engines([proc for proc, _ in started.values()])
    return 0


def _measure(
    args: argparse.Namespace, trainer: Trainer, draft: DraftRun, engines: list[_Engine]
) -> dict:
    greedy_prompt = prompts(1)[0]
    for engine in engines:  # warm-up: the first request of a process pays one-off costs
        engine.client.greedy(greedy_prompt, 4)
    greedy = {e.name: [_greedy_tokens_per_s(e, greedy_prompt)] for e in engines}
    rewards = []
    for step in range(1, args.steps + 1):
        rollouts = {e.name: e.sample(prompts(4), 8, seed=step * 1000) for e in engines}
        reward, _ = trainer.step(rollouts["in step"], 8)
        rewards.append(reward)
        draft.after_update(trainer.model, rollouts["in step"])
        policy = dict(trainer.model.state_dict())
        for engine in engines:
            weights = {**policy, **draft.trainer.weights()} if engine.name == "in step" else policy
            engine.publisher.push(weights, version=f"step-{step}", keep_draft=engine.keep_draft)
    for engine in engines:
        greedy[engine.name].append(_greedy_tokens_per_s(engine, greedy_prompt))
    return {"greedy": greedy, "rewards": rewards, "engines": engines}


def _report(args: argparse.Namespace, measured: dict) -> None:
    engines: list[_Engine] = measured["engines"]
    print(
        f"weightbus bench engine --draft: demo policy (4 layers) and a 1-layer draft, TP "
        f"{args.tp[0]}, {args.num_spec} draft tokens per step, 32 rollouts of "
        f"{args.max_tokens} tokens per RL step (temperature 1)"
    )
    print(f"{'step':>4} {'reward':>7}" + "".join(f" {n + ' tok/s':>15}" for n in ENGINES) + (
        f" {'accepted in step':>17} {'accepted frozen':>16}"
    ))  # fmt: skip
    for index, reward in enumerate(measured["rewards"]):
        rows = [engine.rows[index] for engine in engines]
        accepted = [_share(row[1]) for row in rows[1:]]
        throughput = "".join(f" {row[0]:>15.0f}" for row in rows)
        print(f"{index + 1:>4} {reward:>7.3f}{throughput} {accepted[0]:>17} {accepted[1]:>16}")
    greedy = measured["greedy"]
    print("greedy, batch 1, tokens/s (before step 1 -> after the last step):")
    for name in ENGINES:
        before, after = greedy[name]
        speedup = after / greedy["plain"][1]
        print(f"  {name:<8} {before:7.0f} -> {after:7.0f}   ({speedup:.2f}x plain)")


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
