"""The weights an engine serves: its model and, with speculative decoding, a draft model.

Both are one version: a push carries the main model's tensors under their Hugging Face names
and the draft's under `draft.` + its own names (`DRAFT_PREFIX`), and one fingerprint covers
them all. `ServedModels` is what every weights path (loading, slice maps, staging, swaps,
shared-memory arenas) works on, so a draft needs nothing of its own there. Its parameters
are the main model's, then the draft's (`draft.`-prefixed parameter names).
"""

from collections.abc import Iterable

import torch
from torch import nn

from weightbus.core.meta import DRAFT_PREFIX, dtype_from_name, is_draft_name
from weightbus.core.plan.shard import ShardCopy
from weightbus.core.wire.adapter import is_adapter_name
from weightbus.engines.reference.layers.lora import LoraState
from weightbus.engines.reference.models.llama import (
    LlamaForCausalLM,
    adapter_weight_shapes,
    hf_weight_dtypes,
    hf_weight_shapes,
)


class ServedModels(nn.Module):
    """The main model and an optional draft, loaded and swapped as one set of weights.

    Args:
        main: the model completions come from.
        draft: the model that proposes tokens for the main one to verify (None: no draft).
    """

    def __init__(self, main: LlamaForCausalLM, draft: LlamaForCausalLM | None = None) -> None:
        super().__init__()
        self.main = main
        self.draft = draft

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every pushed tensor's name and full (unsharded) shape: the main model's, then the
        draft's under `draft.`."""
        shapes = hf_weight_shapes(self.main.config)
        if self.draft is not None:
            for name, shape in hf_weight_shapes(self.draft.config).items():
                shapes[DRAFT_PREFIX + name] = shape
        return shapes | adapter_weight_shapes(self.main.config)

    def weight_dtypes(self, dtype: torch.dtype) -> dict[str, torch.dtype]:
        """Every pushed tensor's served dtype, in `weight_shapes` order: `dtype` but block-FP8
        matrices and their scales."""
        dtypes = hf_weight_dtypes(self.main.config, dtype)
        if self.draft is not None:
            for name, draft_dtype in hf_weight_dtypes(self.draft.config, dtype).items():
                dtypes[DRAFT_PREFIX + name] = draft_dtype
        lora = self.main.config.lora
        adapter_dtype = None if lora is None else dtype_from_name(lora.dtype)
        return dtypes | dict.fromkeys(adapter_weight_shapes(self.main.config), adapter_dtype)

    def shard_copies(self) -> list[tuple[str, str, ShardCopy]]:
        """This rank's slice map over both models: `(pushed name, parameter name, ShardCopy)`,
        parameter names as in `named_parameters()`."""
        copies = [(hf, "main." + param, copy) for hf, param, copy in self.main.shard_copies()]
        if self.draft is not None:
            copies += [
                (DRAFT_PREFIX + hf, "draft." + param, copy)
                for hf, param, copy in self.draft.shard_copies()
            ]
        adapter = self.main.adapter_shard_copies()
        return copies + [(name, "main." + param, copy) for name, param, copy in adapter]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load pushed tensors (any subset, any order) into the model they name.

        Raises:
            ValueError: an unknown name (a `draft.` name when no draft is served) or a wrong
                shape; the message names the tensor.
        """
        main: list[tuple[str, torch.Tensor]] = []
        draft: list[tuple[str, torch.Tensor]] = []
        adapter: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            if is_adapter_name(name):
                adapter.append((name, tensor))
            elif not is_draft_name(name):
                main.append((name, tensor))
            elif self.draft is None:
                raise ValueError(f"unknown tensor {name!r}: this engine serves no draft model")
            else:
                draft.append((name.removeprefix(DRAFT_PREFIX), tensor))
        loaded = self.main.load_weights(main) | self.main.load_adapter(adapter)
        if draft:
            loaded |= {DRAFT_PREFIX + name for name in self.draft.load_weights(draft)}
        return loaded

    @property
    def lora_state(self) -> LoraState:
        """Whether the main model applies its adapter, and the scale."""
        return self.main.lora_state

    def base_parameters(self) -> list[nn.Parameter]:
        """Every parameter but the adapter's (what an adapter push keeps)."""
        return [p for name, p in self.named_parameters() if ".lora." not in name]

    def draft_parameters(self) -> list[nn.Parameter]:
        """The draft's parameters (empty without a draft)."""
        return [] if self.draft is None else list(self.draft.parameters())
