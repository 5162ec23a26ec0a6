"""Helpers shared by tests."""

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from sessions import SessionFactory
from weightbus.core.meta import DTYPES_BY_NAME, TensorMeta
from weightbus.core.plan.bucket import byte_view
from weightbus.core.publisher import (
    EngineRequestError,
    EngineResult,
    EngineTarget,
    EngineWeights,
    UpdateOrder,
    normalize_weights,
)
from weightbus.core.receiver import Receiver
from weightbus.core.transport import Sending, open_source

# a small Llama whose matrices split over TP 2 (KV heads too) and TP 4 (KV heads replicated)
SMALL_LLAMA = {
    "vocab_size": 101,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
    "tie_word_embeddings": False,
}


def sending_of(weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, Any]) -> Sending:
    """What one process sends of `weights` (a group of one), as a sink driven by hand takes it."""
    return SessionFactory(1).sending(normalize_weights(weights))


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A tensor of random bit patterns (NaNs and infinities included for float dtypes)."""
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    numel = 1
    for dim in shape:
        numel *= dim
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def all_dtype_tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """One tensor of every supported dtype, with odd shapes."""
    return [
        (f"t.{name}", random_tensor((3, 5 + i), dtype, seed + i))
        for i, (name, dtype) in enumerate(DTYPES_BY_NAME.items())
    ]


def assert_bit_identical(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype, same shape, same bytes (NaN payloads included)."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.equal(byte_view(actual.contiguous()), byte_view(expected.contiguous()))


class TensorDictTarget:
    """Holds tensors by name and implements `load_weights` by copying in place.

    Args:
        tensors: the destination tensors; they are updated in place, never replaced.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = dict(tensors)

    def expected(self) -> dict[str, TensorMeta]:
        """Every tensor's name, dtype and shape."""
        return {name: TensorMeta.of(name, tensor) for name, tensor in self.tensors.items()}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy each `(name, tensor)` into the tensor of that name.

        Raises:
            KeyError: an unknown name.
            ValueError: a shape or dtype differs (the message names the tensor).
        """
        loaded = set()
        for name, tensor in weights:
            target = self.tensors.get(name)
            if target is None:
                raise KeyError(f"unknown tensor {name!r}")
            if target.shape != tensor.shape or target.dtype != tensor.dtype:
                raise ValueError(
                    f"tensor {name!r}: expected {target.dtype}{list(target.shape)}, "
                    f"got {tensor.dtype}{list(tensor.shape)}"
                )
            target.copy_(tensor)
            loaded.add(name)
        return loaded


class MirrorTarget(EngineTarget):
    """A CPU copy of the weights, updated in place by this process's Receiver."""

    def __init__(self, url: str, tensors: dict[str, torch.Tensor], *, refuse: str = "") -> None:
        self.url = url
        self.target = TensorDictTarget(tensors)
        self.refuse = refuse
        self.version, self.fingerprint = "initial", None

    def update(self, order: UpdateOrder) -> EngineResult:
        if self.refuse:
            raise EngineRequestError(self.refuse)
        receiver = Receiver(load_weights=self.target.load_weights, expected=self.target.expected())
        source = open_source(order.transport, order.source)
        result = receiver.receive(source, order)
        if not result.ok:
            raise EngineRequestError("; ".join(result.errors))
        self.version, self.fingerprint = order.version, result.fingerprint
        return EngineResult(self.url, order.version, result.fingerprint, result.nbytes, 0.0, {})

    def weights(self, timeout_s: float) -> EngineWeights:
        return EngineWeights(
            url=self.url, version=self.version, fingerprint=self.fingerprint, status="NORMAL"
        )

    def tp_size(self, timeout_s: float) -> int:
        return 1


def assert_demo_passed(record: dict, stdout: str, num_steps: int) -> None:
    """A `weightbus demo --json` record of `num_steps` steps in which every check passed: each
    push changed the weights, the engine served them, its logprobs matched the trainer's."""
    steps = record["steps"]
    assert record["failures"] == []
    assert [s["step"] for s in steps] == list(range(1, num_steps + 1))
    assert all(s["fingerprint_matched"] for s in steps)
    assert len({s["fingerprint"] for s in steps}) == num_steps  # each update changed weights
    # float32 engine and trainer: on-policy to rounding
    assert all(s["logprob_gap"] <= 1e-3 for s in steps)
    assert f"{num_steps}/{num_steps} matched the trainer's" in stdout


def receive_order(transport: str, **fields: Any) -> UpdateOrder:
    """An update order for a Receiver whose source the test opened itself (the Receiver reads
    the order's version, plan hash, verify level, timeout and delta; not its source). It allows
    non-finite values: the transports' tests carry random bit patterns (`random_tensor`), NaN
    payloads included, and check them bit-exactly."""
    return UpdateOrder(transport=transport, source={}, **{"allow_nonfinite": True, **fields})
