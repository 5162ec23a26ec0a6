"""A layer whose parameter every rank holds whole (norms, routers): its slice map and loader."""

import torch
from torch import nn

from weightbus.core.plan.shard import ShardCopy, check_full_shape


class Replicated:
    """Mixin of a layer with one replicated parameter, `weight`: the whole tensor on every rank."""

    def shard_copy(
        self, param: nn.Parameter, full_shape: tuple[int, ...], shard_id: None = None
    ) -> ShardCopy:
        """Replicated: the whole tensor.

        Raises:
            ValueError: `full_shape` is not the parameter's.
        """
        check_full_shape(full_shape, tuple(param.shape))
        return ShardCopy.whole(tuple(param.shape))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        self.shard_copy(param, tuple(loaded.shape)).apply(param.data, loaded)
