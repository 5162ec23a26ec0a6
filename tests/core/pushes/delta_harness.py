"""Helpers of the delta-push tests: bf16 engines, versions that change a fraction of each
tensor, and the check that a delta left the engines as a whole push would."""

import contextlib
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from engine_harness import ServedEngine
from update_harness import engine_greedy

from weightbus import Publisher
from weightbus.engines.reference.models.config import tiny_config
from weightbus.engines.reference.models.loader import random_hf_weights

if TYPE_CHECKING:
    from process_pool import SharedProcesses


@contextlib.contextmanager
def bf16_engines(
    log_dir: Path, shared: "SharedProcesses | None" = None
) -> Iterator[dict[str, ServedEngine]]:
    """bf16 tiny-model engines `tp2` and `tp1`: from `shared` (the `shared_processes` fixture:
    the same engines for every module, left running on exit) when given, else started here
    and stopped on exit. Every test's first push into them is whole (a new Publisher has no
    delta base), so what an earlier module left does not matter."""
    if shared is not None:
        yield {
            name: shared.tiny_engine("--tp", str(tp), "--dtype", "bfloat16", log_dir=log_dir)
            for name, tp in (("tp2", 2), ("tp1", 1))
        }
        return
    started: dict[str, ServedEngine] = {}
    try:
        for name, tp in (("tp2", 2), ("tp1", 1)):
            started[name] = ServedEngine(
                "--tp", str(tp), "--dtype", "bfloat16", log_path=log_dir / f"{name}.log"
            )
        yield started
    finally:
        for engine in started.values():
            engine.stop()


def initial_weights(seed: int) -> dict[str, torch.Tensor]:
    return {n: t.to(torch.bfloat16) for n, t in random_hf_weights(tiny_config(), seed=seed)}


def next_version(
    weights: dict[str, torch.Tensor], seed: int, fraction: float = 0.02, frozen: str = "embed"
) -> dict[str, torch.Tensor]:
    """The next version: `fraction` of each tensor's elements nudged, tensors whose name
    contains `frozen` left alone, and the final norm changed everywhere (a tensor sent whole)."""
    generator = torch.Generator().manual_seed(seed)
    new = {}
    for name, old in weights.items():
        tensor = old.clone()
        flat = tensor.view(-1)
        if name == "model.norm.weight":
            flat.add_(0.25)
        elif frozen not in name and fraction > 0:
            count = max(1, int(fraction * flat.numel()))
            picked = torch.randperm(flat.numel(), generator=generator)[:count]
            flat[picked] += torch.randn(count, generator=generator).to(flat.dtype)
        new[name] = tensor
    return new


def served_fingerprints(publisher: Publisher) -> set[str | None]:
    return {state.fingerprint for state in publisher.engine_weights()}


def assert_whole_push_serves_the_same(
    engines: dict[str, ServedEngine], members, weights, transport: str = "shm"
) -> None:
    """The engines' greedy logprobs after the deltas equal theirs after the same version
    arrived whole."""
    after_deltas = {name: engine_greedy(engines[name])["logprobs"] for name in members}
    urls = [engines[name].url for name in members]
    with Publisher(urls, transport=transport) as whole:
        result = whole.push(weights, version=f"whole-{secrets.token_hex(3)}")
        assert served_fingerprints(whole) == {result.fingerprint}
    for name in members:
        assert engine_greedy(engines[name])["logprobs"] == after_deltas[name], name
