"""Building a model and filling it: from a Hugging Face directory or the seeded `tiny` weights."""

import contextlib
import logging
from collections.abc import Iterator

import torch

from weightbus.core.checkpoint import iter_safetensors
from weightbus.core.digest import tensor_digest
from weightbus.core.meta import dtype_name
from weightbus.engines.reference.models.config import ModelConfig, tiny_config
from weightbus.engines.reference.models.llama import LlamaForCausalLM, hf_weight_shapes

logger = logging.getLogger(__name__)

TINY = "tiny"


def resolve_config(model: str) -> ModelConfig:
    """Config of a `--model` value: `tiny` or a Hugging Face directory.

    Raises:
        FileNotFoundError: the directory has no config.json.
        ValueError: the config is not supported (the message names the field).
    """
    return tiny_config() if model == TINY else ModelConfig.from_hf_dir(model)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def create_model(config: ModelConfig, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """An unloaded model for this process's tensor-parallel rank, parameters in `dtype`."""
    with _default_dtype(dtype):
        return LlamaForCausalLM(config).eval()


def random_hf_weights(config: ModelConfig, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded random full tensors under Hugging Face names (the `tiny` model's weights).

    The same seed gives the same model at every tensor-parallel size. Scales keep activations
    near unit size and make the next-token distribution peaked, so greedy decoding has clear
    winners.
    """
    generator = torch.Generator().manual_seed(seed)
    for name, shape in hf_weight_shapes(config).items():
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
    weights = random_hf_weights(model.config, seed) if source == TINY else iter_safetensors(source)
    loaded = model.load_weights(weights)
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
    expected = hf_weight_shapes(config)
    weights = random_hf_weights(config, seed) if source == TINY else iter_safetensors(source)
    return [
        (name, dtype_name(dtype), tuple(t.shape), tensor_digest(t.to(dtype)))
        for name, t in weights
        if name in expected
    ]
