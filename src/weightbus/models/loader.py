"""Building a model and filling it: from a Hugging Face directory or the seeded `tiny` weights."""

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import msgspec
import torch
from safetensors import safe_open

from weightbus.digest import fingerprint
from weightbus.models.config import ModelConfig, tiny_config
from weightbus.models.llama import LlamaForCausalLM, hf_weight_shapes

logger = logging.getLogger(__name__)

TINY = "tiny"
INDEX_FILE = "model.safetensors.index.json"


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


class _Index(msgspec.Struct):
    """What weightbus reads of `model.safetensors.index.json` (other keys are ignored)."""

    weight_map: dict[str, str]


def _indexed_files(index: Path) -> list[str]:
    try:
        weight_map = msgspec.json.decode(index.read_bytes(), type=_Index).weight_map
    except (msgspec.MsgspecError, UnicodeDecodeError) as exc:
        raise ValueError(f"{index} is not a safetensors index: {exc}") from None
    names = sorted(set(weight_map.values()))
    outside = [name for name in names if name != Path(name).name or name in ("", ".", "..")]
    if outside:
        raise ValueError(f"{index} names files outside its directory: {outside}")
    return names


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint files of a directory: those of the index when present, else all.

    Raises:
        FileNotFoundError: no safetensors file (or one the index names is missing).
        ValueError: the index is malformed or names files outside the directory.
    """
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        files = [model_dir / name for name in _indexed_files(index)]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{INDEX_FILE} names missing files: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}")
    return files


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, tensor)` of every tensor in a Hugging Face directory, one file open at a time."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


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
        FileNotFoundError: see `safetensors_files`.
    """
    weights = random_hf_weights(model.config, seed) if source == TINY else iter_safetensors(source)
    loaded = model.load_weights(weights)
    missing = [name for name in model.expected_weight_names() if name not in loaded]
    if missing:
        raise ValueError(f"checkpoint {source} lacks {len(missing)} tensors: {missing[:8]}")
    logger.info("loaded %d tensors from %s", len(loaded), source)


def weights_fingerprint(source: str, config: ModelConfig, seed: int, dtype: torch.dtype) -> str:
    """Fingerprint of the weights `load_model` loads, as served (converted to `dtype`).

    A trainer holding the same weights in the serving dtype computes the same value.
    """
    expected = hf_weight_shapes(config)
    weights = random_hf_weights(config, seed) if source == TINY else iter_safetensors(source)
    return fingerprint((name, t.to(dtype)) for name, t in weights if name in expected)
