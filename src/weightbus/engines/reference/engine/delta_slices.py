"""A rank's parameters as slices of full Hugging Face tensors: where a delta push writes.

The slice map is the rank's `shard_copies` (what `load_weights` does, as data). Parameters are
looked up at each call, so the writer follows the pointer swaps of atomic commits.
"""

from collections.abc import Iterable

import torch

from weightbus.core.delta import apply_to_slice
from weightbus.core.digest import EMPTY_SLICE_DIGEST, tensor_digest
from weightbus.core.plan.shard import ShardCopy
from weightbus.engines.reference.models.served import ServedModels


class ModelSlices:
    """`SliceWriter` (see `weightbus.core.receiver`) over one model's parameters.

    Args:
        model: the models written (live, or the staging copy).
        copies: the rank's slice map, `(hf_name, parameter name, ShardCopy)`.
    """

    def __init__(self, model: ServedModels, copies: list[tuple[str, str, ShardCopy]]) -> None:
        params = dict(model.named_parameters())
        shapes = model.weight_shapes()
        self._slices = {
            hf_name: (params[param_name], copy, shapes[hf_name])
            for hf_name, param_name, copy in copies
        }

    def _destination(self, name: str) -> torch.Tensor:
        param, copy, _ = self._slices[name]
        return copy.destination(param.data)

    def apply(self, name: str, indices: torch.Tensor, values: torch.Tensor) -> None:
        if name not in self._slices:
            return  # a tensor this rank holds no part of (another rank's expert)
        _, copy, full_shape = self._slices[name]
        with torch.no_grad():
            apply_to_slice(self._destination(name), full_shape, copy, indices, values)

    def digest(self, name: str) -> str:
        if name not in self._slices:
            return EMPTY_SLICE_DIGEST
        return tensor_digest(self._destination(name))


def copy_parameters(source: Iterable[torch.Tensor], destination: Iterable[torch.Tensor]) -> None:
    """Copy parameters onto their counterparts (a delta's base, or a kept draft, into the
    staging model before a push writes there)."""
    with torch.no_grad():
        for src, dst in zip(source, destination, strict=True):
            dst.data.copy_(src.data)
