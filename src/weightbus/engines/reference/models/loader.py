"""Building a model and filling it: from a Hugging Face directory or the seeded `tiny` weights."""

import contextlib
import logging
from collections.abc import Iterator

import torch

from weightbus.core.checkpoint import iter_safetensors
from weightbus.core.digest import tensor_digest
from weightbus.core.fp8 import FP8_BLOCK_NAME, FP8_DTYPE, Fp8Block, quantize_weights, quantizes
from weightbus.core.meta import dtype_name
from weightbus.engines.reference.models.config import LoraShape, ModelConfig, tiny_config
from weightbus.engines.reference.models.experts import ExpertLayout, ExpertMap
from weightbus.engines.reference.models.llama import (
    LlamaForCausalLM,
    dense_weight_shapes,
    hf_weight_dtypes,
)

logger = logging.getLogger(__name__)

TINY = "tiny"


QUANTIZATIONS = (FP8_BLOCK_NAME,)


def lora_shape(
    rank: int, targets: tuple[str, ...] | list[str] = (), dtype: str = "float32"
) -> LoraShape | None:
    """The `--lora-rank` / `--lora-targets` / `--lora-dtype` flags as a `LoraShape` (None:
    rank 0, no LoRA; no targets: every projection)."""
    if rank == 0:
        return None
    if not targets:
        return LoraShape(rank, dtype=dtype)
    return LoraShape(rank, tuple(targets), dtype)


def expert_layout(
    expert_parallel: bool = False, placement: str = "linear", redundant_experts: int = 0
) -> ExpertLayout:
    """The `--expert-parallel` / `--expert-placement` / `--redundant-experts` flags as an
    `ExpertLayout`.

    Raises:
        ValueError: a bad flag or combination (the flag named).
    """
    return ExpertLayout(expert_parallel, placement, redundant_experts)


def resolve_config(
    model: str,
    quantization: str | None = None,
    lora: LoraShape | None = None,
    expert_layout: ExpertLayout | None = None,
) -> ModelConfig:
    """Config of a `--model` value: `tiny` or a Hugging Face directory.

    Args:
        model: `tiny` or the directory.
        quantization: `fp8-block` serves the decoder-layer matrices in block FP8 (128 x 128
            blocks unless the checkpoint's `quantization_config` says otherwise), quantizing
            an unquantized checkpoint as it loads. None: as the checkpoint is.
        lora: the LoRA adapters the engine serves (None: none).
        expert_layout: how a mixture-of-experts model holds its experts (None: split over
            the TP ranks).

    Raises:
        FileNotFoundError: the directory has no config.json.
        ValueError: the config is not supported, or the options do not fit it (the message
            names the field or the flag).
    """
    config = tiny_config() if model == TINY else ModelConfig.from_hf_dir(model)
    config.lora = lora
    config.expert_layout = expert_layout
    if lora is not None and (quantization is not None or config.quantization is not None):
        raise ValueError(
            "--lora-rank with block FP8: adapters apply to unquantized layers only (serve the "
            "model unquantized, or push the merged model quantized)"
        )
    if quantization is not None:
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
        if config.quantization is None:
            config.quantization = Fp8Block()
    config.validate_options()
    return config


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def create_model(
    config: ModelConfig, dtype: torch.dtype = torch.float32, expert_map: ExpertMap | None = None
) -> LlamaForCausalLM:
    """An unloaded model for this process's tensor-parallel rank, parameters in `dtype`.

    Args:
        config: architecture and serving options (`expert_layout` for an MoE model).
        dtype: parameter dtype.
        expert_map: where the experts start (None: the layout's initial map); a staging
            copy of a live model passes the live model's `expert_map`.
    """
    with _default_dtype(dtype):
        return LlamaForCausalLM(config, expert_map).eval()


def random_hf_weights(config: ModelConfig, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded random full tensors under Hugging Face names (the `tiny` model's weights).

    The same seed gives the same model at every tensor-parallel size. Scales keep activations
    near unit size and make the next-token distribution peaked, so greedy decoding has clear
    winners.
    """
    generator = torch.Generator().manual_seed(seed)
    for name, shape in dense_weight_shapes(config).items():
        noise = torch.randn(shape, generator=generator)
        if name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            tensor = 0.1 * noise
        elif name == "model.embed_tokens.weight":
            tensor = noise
        elif name == "lm_head.weight":
            tensor = 0.25 * noise
        else:
            tensor = noise / shape[1] ** 0.5
        yield name, tensor


def load_model(model: LlamaForCausalLM, source: str, seed: int = 0) -> None:
    """Load every expected weight of `model` from `tiny` (seeded) or a Hugging Face directory.

    Raises:
        ValueError: a tensor is unknown, has the wrong shape, or is missing (names listed).
        FileNotFoundError: see `weightbus.core.checkpoint.safetensors_files`.
    """
    dtype = model.model.norm.weight.dtype  # the serving dtype of every unquantized weight
    loaded = model.load_weights(_source_weights(source, model.config, seed, dtype))
    missing = [name for name in model.expected_weight_names() if name not in loaded]
    if missing:
        raise ValueError(f"checkpoint {source} lacks {len(missing)} tensors: {missing[:8]}")
    logger.info("loaded %d tensors from %s", len(loaded), source)


def weights_records(
    source: str, config: ModelConfig, seed: int, dtype: torch.dtype
) -> list[tuple[str, str, tuple[int, ...], str]]:
    """`(name, dtype, shape, digest)` of every weight `load_model` loads from `source`, as
    served (converted to `dtype`): `fingerprint_of_digests` of them is the model's fingerprint,
    the one a trainer holding the same weights in the serving dtype computes."""
    dtypes = hf_weight_dtypes(config, dtype)
    return [
        (name, dtype_name(dtypes[name]), tuple(t.shape), tensor_digest(t.to(dtypes[name])))
        for name, t in _source_weights(source, config, seed, dtype)
        if name in dtypes
    ]


def _source_weights(
    source: str, config: ModelConfig, seed: int, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of `source` as the model loads them: block-FP8 models quantize the matrices
    an unquantized checkpoint holds, from their values in the serving `dtype` (what a trainer
    holding them in that dtype quantizes in its push: the same fingerprint)."""
    weights = random_hf_weights(config, seed) if source == TINY else iter_safetensors(source)
    quant = config.quantization
    if quant is None:
        return weights
    served = (
        (name, t.to(dtype) if quantizes(name, tuple(t.shape)) and t.dtype != FP8_DTYPE else t)
        for name, t in weights
    )
    return quantize_weights(served, quant)
