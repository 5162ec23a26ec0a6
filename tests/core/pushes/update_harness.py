"""Helpers of the live-update tests: HF training steps, reference decoding, engine checks."""

import contextlib
import copy
import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import msgspec
import torch
from engine_harness import NUM_GREEDY_TOKENS, PROMPT, VOCAB_SIZE, ServedEngine

from weightbus.core.publisher.targets import HttpEngineTarget

KiB = 1024


def trained_copy(model: torch.nn.Module, seed: int, lr: float = 0.05) -> torch.nn.Module:
    """A copy of `model` after one SGD step on a language-modelling loss over random tokens."""
    trained = copy.deepcopy(model).train()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB_SIZE, (2, 16), generator=generator)
    optimizer = torch.optim.SGD(trained.parameters(), lr=lr)
    trained(ids, labels=ids).loss.backward()
    optimizer.step()
    return trained.eval()


def hf_greedy(
    model: torch.nn.Module, prompt: list[int] = PROMPT, num_tokens: int = NUM_GREEDY_TOKENS
) -> tuple[list[int], list[float]]:
    """`num_tokens` greedy tokens after `prompt` and each token's logprob, from transformers."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=num_tokens,
            do_sample=False,
            pad_token_id=0,
            attention_mask=torch.ones_like(ids),
        )
        tokens = out[0, len(prompt) :].tolist()
        logprobs = model(out).logits[0].float().log_softmax(-1)
    positions = range(len(prompt) - 1, len(prompt) - 1 + len(tokens))
    return tokens, [float(logprobs[p, t]) for p, t in zip(positions, tokens, strict=True)]


def engine_greedy(engine: ServedEngine, prompt: list[int] = PROMPT) -> dict:
    """The engine's greedy completion of `prompt` (the first choice)."""
    response = engine.complete(
        prompt=prompt, max_tokens=NUM_GREEDY_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def weights_state(engine: ServedEngine, token: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = engine.client.get("/v1/weights", headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


@contextlib.contextmanager
def targets_and_reference(log_dir: Path, seed: int) -> Iterator[dict[str, ServedEngine]]:
    """Tiny-model engines: `tp2` and `tp1` to push into, and `reference_tp2`, started with the
    tiny weights of `seed` (what the targets should serve after receiving them). All are
    stopped on exit, including those started before a failing one."""
    flags = {
        "tp2": ("--tp", "2"),
        "tp1": ("--tp", "1"),
        "reference_tp2": ("--tp", "2", "--seed", str(seed)),
    }
    started: dict[str, ServedEngine] = {}
    try:
        for name, args in flags.items():
            started[name] = ServedEngine(*args, log_path=log_dir / f"{name}.log")
        yield started
    finally:
        for engine in started.values():
            engine.stop()


def flip_a_byte_of(session: Path, name: str) -> None:
    """Flip one byte of tensor `name` in the safetensors file of a disk session holding it."""
    for shard in session.glob("*.safetensors"):
        data = bytearray(shard.read_bytes())
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
        if name in header:
            start, _ = header[name]["data_offsets"]
            data[8 + length + start] ^= 0x40
            shard.write_bytes(bytes(data))
            return
    raise AssertionError(f"{name} is in no shard of {session}")


class ByteFlippingTarget(HttpEngineTarget):
    """An engine that reads a copy of each disk session with one byte of tensor `name`
    flipped."""

    def __init__(self, url: str, name: str) -> None:
        super().__init__(url)
        self.name = name

    def update(self, order):
        session = Path(order.source["path"])
        corrupted = session.with_name(session.name + "-corrupted")
        shutil.copytree(session, corrupted)
        flip_a_byte_of(corrupted, self.name)
        return super().update(
            msgspec.structs.replace(order, source={**order.source, "path": str(corrupted)})
        )
