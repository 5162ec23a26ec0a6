"""A plain receiving target: named tensors updated in place (a CPU mirror, a test model)."""

from collections.abc import Iterable, Mapping

import torch

from weightbus.meta import TensorMeta


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
