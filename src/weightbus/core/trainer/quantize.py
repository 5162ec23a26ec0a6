"""Block-FP8 quantization where the tensor lives: each trainer rank quantizes its own shards.

A rank's box of a matrix must cover whole blocks: its fp8 values and scales are then exactly
those of the whole matrix's quantization (each block is quantized alone). The scales are a
tensor of their own, sharded like the matrix in block units.
"""

import math

import torch

from weightbus.core.fp8 import FP8_DTYPE, SCALE_SUFFIX, Fp8Block, quantize, quantizes
from weightbus.core.meta import TensorMeta
from weightbus.core.trainer.boxes import Box
from weightbus.core.trainer.holdings import Holding


def quantized_holdings(holdings: list[Holding], spec: Fp8Block) -> list[Holding]:
    """This rank's holdings as a block-FP8 engine serves them: each matrix `quantizes` picks
    becomes its fp8 box followed by its scales' box; the others pass as they are.

    Raises:
        ValueError: a box does not cover whole blocks (named, with the rows and columns held).
        NonFiniteWeightsError: a box to quantize holds NaN or inf (named).
    """
    result = []
    for holding in holdings:
        meta = holding.meta
        if meta.dtype == FP8_DTYPE or not quantizes(meta.name, meta.shape):
            result.append(holding)
            continue
        box = holding.box
        _check_block_edges(holding, spec)
        fp8, scale_inv = quantize(meta.name, holding.matrix(), spec)
        result.append(Holding(TensorMeta(meta.name, FP8_DTYPE, meta.shape), box, fp8))
        scales = TensorMeta(meta.name + SCALE_SUFFIX, torch.float32, spec.scale_shape(meta.shape))
        result.append(Holding(scales, _block_box(box, spec), scale_inv))
    return result


def _block_box(box: Box, spec: Fp8Block) -> Box:
    rows, cols = spec.block
    return Box(
        box.row_start // rows,
        math.ceil(box.row_stop / rows),
        box.col_start // cols,
        math.ceil(box.col_stop / cols),
    )


def _check_block_edges(holding: Holding, spec: Fp8Block) -> None:
    box, (rows, cols) = holding.box, holding.meta.shape
    block_rows, block_cols = spec.block
    on_edges = (
        box.row_start % block_rows == 0
        and (box.row_stop % block_rows == 0 or box.row_stop == rows)
        and box.col_start % block_cols == 0
        and (box.col_stop % block_cols == 0 or box.col_stop == cols)
    )
    if not on_edges:
        raise ValueError(
            f"fp8-block: tensor {holding.name!r}: this rank holds rows "
            f"{box.row_start}:{box.row_stop} and columns {box.col_start}:{box.col_stop} of "
            f"{tuple(holding.meta.shape)}, not whole {block_rows}x{block_cols} blocks: each "
            "rank quantizes its own shard, so shards must split on block edges (or push the "
            "gathered model from one process)"
        )
