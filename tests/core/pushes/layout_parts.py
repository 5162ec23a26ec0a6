"""What the layout matrix's trainer ranks and its test share: the prompt, the adapter (seeded
LoRA matrices of q_proj / v_proj, peft's names) and the draft model's tensors."""

from pathlib import Path

import torch

from weightbus.core.checkpoint import iter_safetensors
from weightbus.core.meta import DRAFT_PREFIX

PROMPT = [3, 17, 42, 99, 0, 5, 64, 23]
LORA_RANK = 4
ADAPTER_CONFIG = {"r": LORA_RANK, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def adapter_state(config) -> dict[str, torch.Tensor]:
    """The adapter every rank pushes (the same seeded values on every rank)."""
    generator = torch.Generator().manual_seed(7)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    out = {"q_proj": config.num_attention_heads * head_dim,
           "v_proj": config.num_key_value_heads * head_dim}  # fmt: skip
    state = {}
    for layer in range(config.num_hidden_layers):
        for module, rows in out.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            shapes = {"lora_A": (LORA_RANK, config.hidden_size), "lora_B": (rows, LORA_RANK)}
            for part, shape in shapes.items():
                state[f"{prefix}.{part}.weight"] = 0.1 * torch.randn(shape, generator=generator)
    return state


def draft_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """The draft checkpoint's tensors under the names a push carries them (`draft.` + name)."""
    return {DRAFT_PREFIX + name: t for name, t in iter_safetensors(directory)}
