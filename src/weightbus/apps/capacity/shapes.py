"""The tensors a trainer pushes for a model, from its Hugging Face config alone.

The model is built on the meta device through `transformers` (no weights, no memory), and its
parameters are named and shaped as in the model's checkpoint: transformers >= 5 fuses MoE experts
into 3-D tensors, which `revert_weight_conversion` splits back into the per-expert tensors
(`...mlp.experts.{e}.gate_proj.weight`) that trainers push and engines' `load_weights` take.
`fp8-block` turns every linear weight inside the decoder layers into `float8_e4m3fn` plus a
`weight_scale_inv` of one float32 per 128x128 block, as DeepSeek-V3 and Kimi-K2 checkpoints hold.
"""

import json
import logging
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from weightbus.core.fp8 import quantizes
from weightbus.core.meta import TensorMeta

log = logging.getLogger(__name__)

DTYPES = ("bfloat16", "float16", "float32", "fp8-block")
FP8_BLOCK = (128, 128)
_PRESETS = "weightbus.apps.capacity.configs"
# Config fields that make transformers load remote code or quantize at build time.
_DROPPED_FIELDS = ("auto_map", "quantization_config", "torch_dtype", "dtype")
# Kept in float32 whatever the model's dtype, as DeepSeek-V3 and Kimi-K2 checkpoints store it.
_FLOAT32_SUFFIXES = (".e_score_correction_bias",)


@dataclass(frozen=True, slots=True)
class ModelTensors:
    """A model's pushed tensors and the config facts the engine-side rules need."""

    name: str
    metas: tuple[TensorMeta, ...]
    config: dict[str, Any]

    @property
    def total_bytes(self) -> int:
        return sum(meta.nbytes for meta in self.metas)

    @property
    def num_params(self) -> int:
        return sum(meta.numel for meta in self.metas if not meta.name.endswith("_scale_inv"))


def preset_names() -> list[str]:
    """The model configs shipped with weightbus (`--model NAME`)."""
    folder = resources.files(_PRESETS)
    return sorted(
        p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json")
    )


def load_config(model: str | Path) -> tuple[str, dict[str, Any]]:
    """`(name, config dict)` of a `config.json`, a directory holding one, or a preset name.

    Raises:
        FileNotFoundError: none of those exists (the message lists the presets).
        ValueError: the file is not a JSON object.
    """
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        name = path.parent.name if path.name == "config.json" else path.stem
        source, text = str(path), path.read_text()
    elif str(model) in preset_names():
        name = source = str(model)
        text = resources.files(_PRESETS).joinpath(f"{model}.json").read_text()
    else:
        raise FileNotFoundError(
            f"no config.json at {model!r} and no preset of that name; presets: "
            f"{', '.join(preset_names())}"
        )
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(  # noqa: TRY004 - bad file content, not a bad argument type
            f"{source}: a config must be a JSON object, got {type(config).__name__}"
        )
    return name, config


def model_tensors(model: str | Path, dtype: str | None = None) -> ModelTensors:
    """The tensors a push of `model` carries, in checkpoint order, without any weights.

    Args:
        model: a `config.json`, a directory holding one, or a preset name.
        dtype: `bfloat16`, `float16`, `float32` or `fp8-block`; default: `fp8-block` when the
            config says the checkpoint is block-quantized FP8, else the config's dtype.

    Raises:
        ValueError: an unknown dtype, or a config transformers cannot build.
    """
    name, config = load_config(model)
    dtype = dtype or _default_dtype(config)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    base = (
        torch.float32
        if dtype == "float32"
        else torch.float16
        if dtype == "float16"
        else torch.bfloat16
    )
    named = _checkpoint_shapes(config, base)
    metas = [
        TensorMeta(n, torch.float32 if n.endswith(_FLOAT32_SUFFIXES) else base, shape)
        for n, shape in named
    ]
    if dtype == "fp8-block":
        metas = fp8_block(metas)
    return ModelTensors(name=name, metas=tuple(metas), config=config)


def _default_dtype(config: dict[str, Any]) -> str:
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") == "fp8" and quant.get("weight_block_size"):
        return "fp8-block"
    declared = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return declared if declared in DTYPES else "bfloat16"


def fp8_block(metas: list[TensorMeta]) -> list[TensorMeta]:
    """Block-quantized FP8: each decoder-layer linear weight becomes `float8_e4m3fn`, followed
    by its `weight_scale_inv` (float32, one per 128x128 block); routers, norms, embeddings and
    the output head stay as they are."""
    result: list[TensorMeta] = []
    for meta in metas:
        if not _quantized(meta):
            result.append(meta)
            continue
        rows, cols = meta.shape
        scales = (math.ceil(rows / FP8_BLOCK[0]), math.ceil(cols / FP8_BLOCK[1]))
        result.append(TensorMeta(meta.name, torch.float8_e4m3fn, meta.shape))
        result.append(TensorMeta(f"{meta.name}_scale_inv", torch.float32, scales))
    return result


def _quantized(meta: TensorMeta) -> bool:
    """Every matrix inside the decoder layers (all of them linear weights) but the routers:
    the rule a quantizing push applies (`weightbus.core.fp8.quantizes`)."""
    return quantizes(meta.name, meta.shape)


def _checkpoint_shapes(config: dict[str, Any], dtype: torch.dtype) -> list[tuple[str, tuple]]:
    """`(name, shape)` of every pushed tensor, checkpoint names, tied tensors once."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ImportError(
            "weightbus plan builds models from their config with transformers: "
            "pip install 'weightbus[plan]'"
        ) from None

    fields = {k: v for k, v in config.items() if k not in _DROPPED_FIELDS}
    model_type = _model_type(fields)
    fields.pop("model_type", None)
    try:
        hf_config = AutoConfig.for_model(model_type, **fields)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    except Exception as exc:  # any failure of a third-party build from user input
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise ValueError(f"transformers cannot build model_type {model_type!r}: {reason}") from exc
    state = dict(model.named_parameters())  # tied parameters once, as pushes send them
    persistent = model.state_dict().keys()
    state.update((n, b) for n, b in model.named_buffers() if n in persistent)
    return [(n, tuple(t.shape)) for n, t in _revert_fused(model, state).items()]


def _model_type(config: dict[str, Any]) -> str:
    """The transformers model type; a remote-code type (e.g. `kimi_k2`) falls back to the
    architecture it declares (`DeepseekV3ForCausalLM` -> `deepseek_v3`)."""
    from transformers import CONFIG_MAPPING

    declared = config.get("model_type")
    if declared in CONFIG_MAPPING:
        return declared
    for architecture in config.get("architectures") or []:
        stem = architecture.removesuffix("ForCausalLM").lower()
        for model_type in CONFIG_MAPPING:
            if model_type.replace("_", "") == stem:
                log.debug("model_type %r: using %r from architectures", declared, model_type)
                return model_type
    raise ValueError(
        f"unknown model_type {declared!r} (architectures {config.get('architectures')}); "
        "transformers knows neither"
    )


def _revert_fused(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict:
    """Checkpoint names and shapes: undo transformers' load-time fusions (transformers >= 5);
    older versions already name parameters as checkpoints do."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return state
    return revert_weight_conversion(model, state)
