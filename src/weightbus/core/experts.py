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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<projection>gate_proj|up_proj|down_proj)\.weight$"
)


def expert_name(prefix: str, expert: int, projection: str) -> str:
    """The checkpoint name of one expert's matrix: `<prefix>.<expert>.<projection>.weight`."""
    return f"{prefix}.{expert}.{projection}.weight"


def is_fused_experts(name: str) -> bool:
    """Whether `name` is transformers 5's fused expert tensor of a layer."""
    return _FUSED.match(name) is not None


def _parts(name: str, rows: int) -> tuple[str, list[tuple[str, int, int]]]:
    """A fused tensor's prefix and its projections per expert: `(projection, first row, stop)`.

    Raises:
        ValueError: a gate/up tensor with an odd number of rows.
    """
    match = _FUSED.match(name)
    assert match is not None, name
    if match["kind"] == "down_proj":
        return match["prefix"], [("down_proj", 0, rows)]
    if rows % 2:
        raise ValueError(f"fused expert tensor {name!r} holds gate and up rows: {rows} rows is odd")
    half = rows // 2
    return match["prefix"], [("gate_proj", 0, half), ("up_proj", half, rows)]


@dataclass(frozen=True, slots=True)
class ExpertBlock:
    """What a block of a fused expert tensor holds of one expert's matrix: `view` (of the
    block's memory) at `offset` (row, column) of the matrix `name` of `shape`."""

    name: str
    shape: tuple[int, int]
    offset: tuple[int, int]
    view: torch.Tensor


def fused_blocks(
    name: str, shape: tuple[int, ...], local: torch.Tensor, offset: tuple[int, ...]
) -> Iterator[ExpertBlock]:
    """What the block `local` at `offset` of fused tensor `name` (of `shape`) holds of each
    expert's matrices: a block of a sharded trainer (experts cut by `Shard(0)` or declared,
    each expert's rows or columns possibly cut by another mesh dimension). Matrices the block
    holds nothing of are left out; views, no copy.

    Raises:
        ValueError: not 3-D, a block outside the tensor, or an odd gate/up row count (each
            naming the tensor).
    """
    if len(shape) != 3:
        raise ValueError(
            f"fused expert tensor {name!r} must be [experts, rows, columns], got {list(shape)}"
        )
    if (
        local.dim() != 3
        or len(offset) != 3
        or any(o < 0 or o + n > full for o, n, full in zip(offset, local.shape, shape, strict=True))
    ):
        raise ValueError(
            f"fused expert tensor {name!r}: block {list(local.shape)} at {list(offset)} is "
            f"outside {list(shape)}"
        )
    prefix, parts = _parts(name, shape[1])
    first_expert, first_row, first_col = offset
    for index in range(local.shape[0]):
        block = local[index]
        for projection, part_start, part_stop in parts:
            start = max(first_row, part_start)
            stop = min(first_row + block.shape[0], part_stop)
            if start < stop:
                yield ExpertBlock(
                    expert_name(prefix, first_expert + index, projection),
                    (part_stop - part_start, shape[2]),
                    (start - part_start, first_col),
                    block[start - first_row : stop - first_row],
                )


def split_fused_experts(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The per-expert `(name, view)` pairs of a whole fused expert tensor, by expert.

    Raises:
        ValueError: `tensor` is not 3-D, or a fused gate/up tensor has an odd middle dimension
            (the message names the tensor).
    """
    shape = tuple(tensor.shape)
    for block in fused_blocks(name, shape, tensor, (0,) * len(shape)):
        yield block.name, block.view


def missing_experts(names: Iterable[str]) -> list[str]:
    """The per-expert tensors absent from `names` between the experts present: each layer's
    experts `0..n-1` (n = its highest index + 1) with all three projections (what a trainer
    group holds between its ranks must not leave a gap)."""
    seen: dict[str, set[tuple[int, str]]] = {}
    for name in names:
        match = _PER_EXPERT.match(name)
        if match is not None:
            seen.setdefault(match["prefix"], set()).add((int(match["expert"]), match["projection"]))
    return [
        expert_name(prefix, expert, projection)
        for prefix, held in seen.items()
        for expert in range(1 + max(index for index, _ in held))
        for projection in ("gate_proj", "up_proj", "down_proj")
        if (expert, projection) not in held
    ]
