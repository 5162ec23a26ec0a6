"""Mixture-of-experts tensors under the names checkpoints and engines use: one per expert.

transformers 5 holds a layer's experts fused, as 3-D tensors: `mlp.experts.gate_up_proj`
`[experts, 2 * intermediate, hidden]` (each expert's gate rows, then its up rows) and
`mlp.experts.down_proj` `[experts, hidden, intermediate]`. Checkpoints, vLLM's loaders and the
reference engine name each expert's matrices apart (`mlp.experts.17.gate_proj.weight`). A push
sends the per-expert tensors, so an engine rank receives exactly the experts it holds; a fused
tensor is split into views of them (no copy), so a model's state dict and its checkpoint have
one fingerprint.
"""

import re
from collections.abc import Iterator

import torch

_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def expert_name(prefix: str, expert: int, projection: str) -> str:
    """The checkpoint name of one expert's matrix: `<prefix>.<expert>.<projection>.weight`."""
    return f"{prefix}.{expert}.{projection}.weight"


def is_fused_experts(name: str) -> bool:
    """Whether `name` is transformers 5's fused expert tensor of a layer."""
    return _FUSED.match(name) is not None


def split_fused_experts(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The per-expert `(name, view)` pairs of a fused expert tensor, by expert.

    Raises:
        ValueError: `tensor` is not 3-D, or a fused gate/up tensor has an odd middle dimension
            (the message names the tensor).
    """
    match = _FUSED.match(name)
    assert match is not None, name
    prefix, kind = match["prefix"], match["kind"]
    if tensor.dim() != 3:
        raise ValueError(
            f"fused expert tensor {name!r} must be [experts, rows, columns], got "
            f"{list(tensor.shape)}"
        )
    if kind == "down_proj":
        for expert in range(tensor.shape[0]):
            yield expert_name(prefix, expert, "down_proj"), tensor[expert]
        return
    rows = tensor.shape[1]
    if rows % 2:
        raise ValueError(f"fused expert tensor {name!r} holds gate and up rows: {rows} rows is odd")
    half = rows // 2
    for expert in range(tensor.shape[0]):
        yield expert_name(prefix, expert, "gate_proj"), tensor[expert, :half]
        yield expert_name(prefix, expert, "up_proj"), tensor[expert, half:]
