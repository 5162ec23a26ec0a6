"""Block-FP8 quantization: the layout DeepSeek-V3 and Kimi-K2 checkpoints serve in.

A quantized matrix is `float8_e4m3fn` plus a float32 `<name>_scale_inv` holding one scale per
block of `block_rows x block_cols` elements (128 x 128 in those checkpoints); the value it
stands for is `fp8 * scale_inv`. Per block (the published definition, with vLLM's and
DeepGEMM's floor so an all-zero block keeps a finite scale):

    amax      = max(|w| over the block, 1e-4)
    scale_inv = amax / 448                        (448: float8_e4m3fn's largest value)
    fp8       = clamp(w / scale_inv, -448, 448) rounded to float8_e4m3fn

computed in float32. A matrix whose size is not a multiple of the block has partial blocks at
its end. Only matrices inside the decoder layers are quantized (`quantizes`): norms, routers,
embeddings, the output head and a draft model keep their dtype.

The publisher quantizes before the bytes leave (`Publisher(quantize=Fp8Block())`); the reference
engine serves the result (`weightbus serve --quantization fp8-block`); the planner sizes it.
"""

import copy
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from weightbus.core.experts import is_fused_experts, split_fused_experts
from weightbus.core.finite import NonFiniteWeightsError, describe_nonfinite
from weightbus.core.meta import is_draft_name

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-4
SCALE_SUFFIX = "_scale_inv"
# `quantize` works through this much float32 at a time (in cache; no copy of a whole matrix)
QUANTIZE_CHUNK_BYTES = 4 << 20
FP8_BLOCK_NAME = "fp8-block"
# Decoder-layer matrices that block-FP8 checkpoints keep unquantized (MoE routers).
UNQUANTIZED_SUFFIXES = (".mlp.gate.weight", ".shared_expert_gate.weight")


@dataclass(frozen=True, slots=True)
class Fp8Block:
    """Block-FP8 with blocks of `block_rows x block_cols` (Hugging Face's `weight_block_size`)."""

    block_rows: int = 128
    block_cols: int = 128

    def __post_init__(self) -> None:
        if self.block_rows < 1 or self.block_cols < 1:
            raise ValueError(f"fp8-block: block sizes must be >= 1, got {self.block}")

    @property
    def block(self) -> tuple[int, int]:
        return self.block_rows, self.block_cols

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The `_scale_inv` shape of a matrix of `shape`: one per (possibly partial) block."""
        rows, cols = shape
        return math.ceil(rows / self.block_rows), math.ceil(cols / self.block_cols)

    def hf_config(self) -> dict:
        """The `quantization_config` of a Hugging Face checkpoint holding these weights."""
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [self.block_rows, self.block_cols],
        }

    @classmethod
    def from_hf_config(cls, quant: dict) -> "Fp8Block":
        """Read a checkpoint's `quantization_config`.

        Raises:
            ValueError: not block FP8 (another method, or per-tensor FP8); names the field.
        """
        if quant.get("quant_method") != "fp8":
            raise ValueError(
                f"quantization_config.quant_method {quant.get('quant_method')!r} is not "
                "supported: only 'fp8' with weight_block_size (block FP8)"
            )
        for field, allowed in (("fmt", "e4m3"), ("activation_scheme", "dynamic")):
            if quant.get(field, allowed) != allowed:
                raise ValueError(
                    f"quantization_config.{field} {quant[field]!r} is not supported: only "
                    f"{allowed!r} (float8_e4m3fn weights, activations kept in the serving dtype)"
                )
        for field in ("modules_to_not_convert", "ignored_layers"):
            if quant.get(field):
                raise ValueError(
                    f"quantization_config.{field} is not supported: every decoder-layer matrix "
                    "is served quantized here"
                )
        size = quant.get("weight_block_size")
        if not (isinstance(size, list | tuple) and len(size) == 2):
            raise ValueError(
                f"quantization_config.weight_block_size {size!r}: only block FP8 is supported "
                "(two block sizes, e.g. [128, 128])"
            )
        return cls(int(size[0]), int(size[1]))


def fp8_spec(quantize: "Fp8Block | str | None") -> Fp8Block | None:
    """A publisher's `quantize` argument: None, an `Fp8Block`, or "fp8-block" (128 x 128).

    Raises:
        ValueError: anything else.
    """
    if quantize is None or isinstance(quantize, Fp8Block):
        return quantize
    if quantize == FP8_BLOCK_NAME:
        return Fp8Block()
    raise ValueError(f"quantize: {quantize!r} is not {FP8_BLOCK_NAME!r} nor an Fp8Block")


def describe(spec: Fp8Block) -> str:
    """How results name it: `fp8-block 128x128`."""
    return f"{FP8_BLOCK_NAME} {spec.block_rows}x{spec.block_cols}"


def quantizes(name: str, shape: tuple[int, ...]) -> bool:
    """Whether block-FP8 checkpoints hold this tensor quantized: every matrix inside the decoder
    layers (all of them linear weights) but routers, and none of a draft model's."""
    return (
        ".layers." in name
        and name.endswith(".weight")
        and len(shape) == 2
        and not name.endswith(UNQUANTIZED_SUFFIXES)
        and not is_draft_name(name)
    )


def quantize(name: str, weight: torch.Tensor, spec: Fp8Block) -> tuple[torch.Tensor, torch.Tensor]:
    """`(fp8, scale_inv)` of a matrix (see the module's definition).

    Raises:
        NonFiniteWeightsError: the matrix holds NaN or inf (float8_e4m3fn has no inf, and one
            NaN would make its block's scale NaN); names the tensor with the counts.
        ValueError: not a floating matrix.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"fp8-block: {name} is not a floating matrix ({weight.dtype}, "
            f"shape {tuple(weight.shape)})"
        )
    rows, cols = weight.shape
    scale_rows, scale_cols = spec.scale_shape((rows, cols))
    fp8 = torch.empty((rows, cols), dtype=FP8_DTYPE, device=weight.device)
    scale_inv = torch.empty((scale_rows, scale_cols), dtype=torch.float32, device=weight.device)
    # block rows at a time through one float32 work buffer of about QUANTIZE_CHUNK_BYTES (its
    # padding columns stay zero: |0| never raises a block's amax)
    padded_cols = scale_cols * spec.block_cols
    step = max(1, QUANTIZE_CHUNK_BYTES // (spec.block_rows * max(1, padded_cols) * 4))
    work = weight.new_zeros((step * spec.block_rows, padded_cols), dtype=torch.float32)
    for first in range(0, scale_rows, step):
        stop = min(first + step, scale_rows)
        _quantize_block_rows(weight, spec, work, (fp8, scale_inv), range(first, stop))
    if not bool(torch.isfinite(scale_inv).all()):  # a NaN/inf block: its scale is one
        found = describe_nonfinite([(name, weight)])
        raise NonFiniteWeightsError(f"fp8-block: {found[name]} cannot be quantized")
    return fp8, scale_inv


def _quantize_block_rows(
    weight: torch.Tensor,
    spec: Fp8Block,
    work: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor],
    block_rows: range,
) -> None:
    """Quantize `block_rows` of `weight` into `out` (`fp8`, `scale_inv`) through `work`
    (float32, zero beyond the matrix's columns)."""
    (fp8, scale_inv), first, stop = out, block_rows.start, block_rows.stop
    rows, cols = weight.shape
    low, high = first * spec.block_rows, min(stop * spec.block_rows, rows)
    chunk = work[: (stop - first) * spec.block_rows]
    if high - low < chunk.shape[0]:  # the last block row is partial: zeros below it
        chunk[high - low :].zero_()
    chunk[: high - low, :cols].copy_(weight[low:high])
    blocks = chunk.view(stop - first, spec.block_rows, -1, spec.block_cols)
    # max(max, -min): no |w| temporary; NaN and inf reach the scale (the caller's check)
    amax = torch.maximum(blocks.amax(dim=(1, 3)), blocks.amin(dim=(1, 3)).neg())
    scales = scale_inv[first:stop]
    torch.clamp(amax, min=MIN_AMAX, out=scales).div_(FP8_MAX)
    blocks.div_(scales[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    fp8[low:high] = chunk[: high - low, :cols]


def expand_scales(scale_inv: torch.Tensor, shape: tuple[int, int], spec: Fp8Block) -> torch.Tensor:
    """Each element's scale for a matrix of `shape` (float32, that shape)."""
    rows, cols = shape
    per_row = scale_inv.repeat_interleave(spec.block_rows, dim=0)[:rows]
    return per_row.repeat_interleave(spec.block_cols, dim=1)[:, :cols]


def dequantize(fp8: torch.Tensor, scale_inv: torch.Tensor, spec: Fp8Block) -> torch.Tensor:
    """The float32 matrix that `(fp8, scale_inv)` stands for.

    Raises:
        ValueError: `scale_inv` does not have one scale per block of `fp8`.
    """
    expected = spec.scale_shape(tuple(fp8.shape))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"fp8-block: scale_inv shape {tuple(scale_inv.shape)} is not one per "
            f"{spec.block} block of a {tuple(fp8.shape)} matrix ({expected})"
        )
    return fp8.float() * expand_scales(scale_inv.float(), tuple(fp8.shape), spec)


def quantize_weights(
    named: Iterable[tuple[str, torch.Tensor]], spec: Fp8Block
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors a block-FP8 engine serves: each matrix `quantizes` picks becomes its fp8
    tensor followed by `<name>_scale_inv`; already-FP8 tensors and every other tensor pass
    as they are."""
    for name, tensor in named:
        if tensor.dtype == FP8_DTYPE or not quantizes(name, tuple(tensor.shape)):
            yield name, tensor
            continue
        if tensor.element_size() == 1:
            raise ValueError(
                f"fp8-block: {name} is {tensor.dtype}, not float8_e4m3fn: only e4m3 block-FP8 "
                "checkpoints are read"
            )
        fp8, scale_inv = quantize(name, tensor, spec)
        yield name, fp8
        yield name + SCALE_SUFFIX, scale_inv


def dequantize_weights(
    named: Iterable[tuple[str, torch.Tensor]], spec: Fp8Block
) -> Iterator[tuple[str, torch.Tensor]]:
    """The inverse view of `quantize_weights`: each fp8 matrix dequantized to float32 with its
    scales, under its own name (the scales dropped); what a probe's reference model runs.

    Raises:
        ValueError: an fp8 matrix without its `_scale_inv`.
    """
    tensors = dict(named)
    for name, tensor in tensors.items():
        if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in tensors:
            continue
        if tensor.dtype != FP8_DTYPE:
            yield name, tensor
            continue
        scale_inv = tensors.get(name + SCALE_SUFFIX)
        if scale_inv is None:
            raise ValueError(f"fp8-block: {name} has no {name + SCALE_SUFFIX}")
        yield name, dequantize(tensor, scale_inv, spec)


def dequantized_state(
    named: Iterable[tuple[str, torch.Tensor]], spec: Fp8Block
) -> dict[str, torch.Tensor]:
    """A trainer's tensors as a block-FP8 engine serves them: each quantized matrix replaced by
    what its fp8 values and scales stand for (float32), the rest as given. Loaded into the
    trainer's model, it is the model to check an FP8 engine against (a logprob probe's)."""
    return dict(dequantize_weights(quantize_weights(named, spec), spec))


def dequantized_model(model: torch.nn.Module, spec: Fp8Block) -> torch.nn.Module:
    """A copy of `model` (in eval mode) holding the weights a block-FP8 engine serves after a
    push of it (`dequantized_state`); `model` itself is left as it is. Fused 3-D expert tensors
    (transformers 5) are quantized per expert, as a push sends them (`core/experts.py`)."""
    served = copy.deepcopy(model).eval()
    views: dict[str, torch.Tensor] = {}
    for name, tensor in served.state_dict().items():
        if is_fused_experts(name):
            views.update(split_fused_experts(name, tensor))
        else:
            views[name] = tensor
    with torch.no_grad():
        for name, value in dequantized_state(views.items(), spec).items():
            views[name].copy_(value)
    return served
