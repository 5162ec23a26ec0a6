"""`weightbus bench engine`: tokens/s of the reference engine, served as a user serves it.

For each TP size it starts `weightbus serve --port 0` in a subprocess, then for each batch size
sends that many concurrent greedy requests (fixed prompt and completion lengths, EOS ignored)
and reports generated tokens per second of wall time.
"""

import argparse
import logging
import threading
import time
from collections.abc import Sequence

import httpx
import torch

from weightbus.apps.launch import start_engine, stop_engine
from weightbus.apps.progress import StepsProgress


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="'tiny' or a Hugging Face directory")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="TP sizes")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="batch sizes")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds; the best is kept")
    parser.add_argument(
        "--draft",
        action="store_true",
        help="speculative decoding over the demo's training run: engines without a draft, "
        "with a draft pushed every step, and with the step-0 draft kept (first --tp only)",
    )
    parser.add_argument(
        "--num-speculative-tokens", type=int, default=3, dest="num_spec", help="with --draft"
    )
    parser.add_argument("--steps", type=int, default=10, help="RL steps with --draft")
    parser.add_argument("--lr", type=float, default=3e-3, help="the policy's lr with --draft")


def _round(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """Send every prompt at once; return (completion tokens, seconds)."""
    counts = [0] * len(prompts)
    barrier = threading.Barrier(len(prompts) + 1)

    def send(i: int) -> None:
        body = {
            "prompt": prompts[i],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        with httpx.Client(base_url=url, timeout=600) as client:
            barrier.wait(timeout=60)
            response = client.post("/v1/completions", json=body)
            response.raise_for_status()
            counts[i] = response.json()["usage"]["completion_tokens"]

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    barrier.wait(timeout=60)
    start = time.perf_counter()
    for thread in threads:
        thread.join(timeout=600)
    return sum(counts), time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    if args.draft:
        from weightbus.apps.bench.speculative import run_speculation

        return run_speculation(args)
    generator = torch.Generator().manual_seed(0)
    rows = []
    with StepsProgress(len(args.tp) * len(args.batch), label="bench engine") as progress:
        for tp in args.tp:
            rows += _rows_at(tp, args, generator, progress)
    print(
        f"weightbus bench engine: model={args.model} prompt={args.prompt_tokens} tokens, "
        f"{args.max_tokens} generated per request, greedy, best of {args.rounds}"
    )
    print(f"{'tp':>3} {'batch':>6} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'ms/step':>8}")
    for tp, batch, tokens, seconds in rows:
        print(
            f"{tp:>3} {batch:>6} {tokens:>7} {seconds:>8.2f} {tokens / seconds:>9.1f} "
            f"{1000 * seconds / args.max_tokens:>8.1f}"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `bench/engine_throughput.py`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _rows_at(
    tp: int, args: argparse.Namespace, generator: torch.Generator, progress: StepsProgress
) -> list[tuple]:
    """Start an engine at `tp`; each batch size's best round: (tp, batch, tokens, seconds)."""
    rows = []
    proc, url = start_engine(args.model, tp)
    try:
        _round(url, [[1, 2, 3]], 4)  # warm-up
        for batch in args.batch:
            progress.step(f"tp {tp}, batch {batch}")
            shape = (batch, args.prompt_tokens)
            prompts = torch.randint(0, 256, shape, generator=generator).tolist()
            best = min(
                (_round(url, prompts, args.max_tokens) for _ in range(args.rounds)),
                key=lambda r: r[1],
            )
            rows.append((tp, batch, *best))
    finally:
        stop_engine(proc)
    return rows
