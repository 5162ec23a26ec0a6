"""Trainer layouts of one small model, as each rank's boxes, and engine slice maps (TP 1, 2)."""

import torch

from weightbus.core.meta import TensorMeta
from weightbus.core.plan.shard import ShardCopy
from weightbus.core.trainer.boxes import Box, matrix_shape
from weightbus.core.trainer.holdings import Holding

# a column-parallel matrix (3 digest blocks), a row-parallel one, a vector, bf16 embeddings
SHAPES = {
    "col.weight": ((300, 256), torch.float32),
    "row.weight": ((256, 300), torch.float32),
    "norm.weight": ((256,), torch.float32),
    "embed.weight": ((1000, 96), torch.bfloat16),
}


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=generator).to(dtype)
        for name, (shape, dtype) in SHAPES.items()
    }


def _chunks(size: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk's (FSDP's) split of `size`: ceil-sized parts, the last ones short or empty."""
    step = -(-size // parts)
    return [(min(i * step, size), min((i + 1) * step, size)) for i in range(parts)]


def _rows(name: str, start: int, stop: int) -> Box:
    whole = Box.whole(SHAPES[name][0])
    return Box(start, stop, 0, whole.col_stop)


def _cols(name: str, start: int, stop: int, rows: tuple[int, int] | None = None) -> Box:
    whole = Box.whole(SHAPES[name][0])
    row_start, row_stop = rows or (0, whole.row_stop)
    return Box(row_start, row_stop, start, stop)


def fsdp(parts: int) -> list[dict[str, Box]]:
    """FSDP2: every tensor `Shard(0)` over `parts` ranks (uneven)."""
    return [
        {
            name: _rows(name, *_chunks(matrix_shape(shape)[0], parts)[rank])
            for name, (shape, _) in SHAPES.items()
            if _chunks(matrix_shape(shape)[0], parts)[rank][0]
            < _chunks(matrix_shape(shape)[0], parts)[rank][1]
        }
        for rank in range(parts)
    ]


def fsdp_tp() -> list[dict[str, Box]]:
    """A 2x2 (dp, tp) mesh: colwise `(Shard(0), Shard(0))`, rowwise `(Shard(0), Shard(1))`,
    the vector and embeddings `(Shard(0), Replicate)`: rank = 2 * dp + tp."""
    boxes = []
    for dp in range(2):
        for tp in range(2):
            col_tp = _chunks(300, 2)[tp]
            col_dp = _chunks(col_tp[1] - col_tp[0], 2)[dp]
            boxes.append(
                {
                    "col.weight": _rows("col.weight", col_tp[0] + col_dp[0], col_tp[0] + col_dp[1]),
                    "row.weight": _cols(
                        "row.weight", *_chunks(300, 2)[tp], rows=_chunks(256, 2)[dp]
                    ),
                    "norm.weight": _rows("norm.weight", *_chunks(256, 2)[dp]),
                    "embed.weight": _rows("embed.weight", *_chunks(1000, 2)[dp]),
                }
            )
    return boxes


def megatron_tp(parts: int) -> list[dict[str, Box]]:
    """Megatron TP: column-parallel rows, row-parallel columns, vocab-parallel embeddings, the
    norm replicated."""
    return [
        {
            "col.weight": _rows("col.weight", *_chunks(300, parts)[rank]),
            "row.weight": _cols("row.weight", *_chunks(300, parts)[rank]),
            "norm.weight": Box.whole(SHAPES["norm.weight"][0]),
            "embed.weight": _rows("embed.weight", *_chunks(1000, parts)[rank]),
        }
        for rank in range(parts)
    ]


def pipeline() -> list[dict[str, Box]]:
    """Two stages, each holding its own tensors whole."""
    whole = {name: Box.whole(shape) for name, (shape, _) in SHAPES.items()}
    return [
        {name: whole[name] for name in ("embed.weight", "col.weight")},
        {name: whole[name] for name in ("row.weight", "norm.weight")},
    ]


def replicated(parts: int) -> list[dict[str, Box]]:
    return [{name: Box.whole(shape) for name, (shape, _) in SHAPES.items()} for _ in range(parts)]


LAYOUTS = {
    "fsdp-3-uneven": fsdp(3),
    "fsdp-x-tp-2x2": fsdp_tp(),
    "megatron-tp-2": megatron_tp(2),
    "pipeline-2": pipeline(),
    "replicated-2": replicated(2),
}


def holdings(full: dict[str, torch.Tensor], boxes: dict[str, Box]) -> list[Holding]:
    """A rank's holdings of `boxes` (contiguous copies of the boxes of `full`; a whole box in
    the tensor's own shape, as a process holding it whole holds it)."""
    result = []
    for name, box in boxes.items():
        tensor = full[name]
        rows, cols = matrix_shape(tuple(tensor.shape))
        local = tensor.reshape(rows, cols)[
            box.row_start : box.row_stop, box.col_start : box.col_stop
        ]
        meta = TensorMeta(name, tensor.dtype, tuple(tensor.shape))
        whole = box == Box.whole(tuple(tensor.shape))
        result.append(Holding(meta, box, tensor.clone() if whole else local.contiguous()))
    return result


def engine_slices(tp: int) -> list[dict[str, list[ShardCopy]]]:
    """What each rank of a reference-style engine of `tp` ranks takes of each tensor."""
    if tp == 1:
        return [{name: [ShardCopy.whole(shape)] for name, (shape, _) in SHAPES.items()}]
    slices = []
    for rank in range(tp):
        col, row, vocab = 300 // tp, 300 // tp, 1000 // tp
        slices.append(
            {
                "col.weight": [ShardCopy(0, rank * col, 0, 0, col)],
                "row.weight": [ShardCopy(1, rank * row, 1, 0, row)],
                "norm.weight": [ShardCopy.whole((256,))],
                "embed.weight": [ShardCopy(0, rank * vocab, 0, 0, vocab)],
            }
        )
    return slices
