"""LoRA adapters on the trainer side: the adapter's tensors and config as `peft` holds them.

An adapter push (`Publisher.push(peft_model, adapter=lora_config, ...)`) sends the adapter's
`lora_A` / `lora_B` matrices only, under the names `peft` saves them with
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`: A is `(r, in_features)`,
B `(out_features, r)`), and an `AdapterSpec` (rank, alpha, targets, the base's fingerprint) in
the order. Nothing here imports `peft`: a `LoraConfig` is read by its attributes, so a dict
as `adapter_config.json` holds it works too.

A config is read through an allowlist: the fields that describe a plain
`base + (B (A x)) * scaling` on the targeted projections (or only how peft initialises or
records the adapter) may hold anything; every other peft option must be off (None, False,
empty), else it is refused by name: DoRA, LoRA biases, `fan_in_fan_out`, per-module ranks or
alphas, `modules_to_save`, layer subsets, aLoRA, trainable tokens, ... change what the model
computes, and an engine serving the plain form would serve another model.
"""

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from weightbus.core.wire.adapter import LORA_TARGETS, PEFT_PREFIX, AdapterSpec

_LORA_PARTS = ("lora_A", "lora_B")
# peft config fields an engine serving plain LoRA reads (the spec's), or that only say how peft
# initialises, trains or records the adapter: they may hold anything
_PLAIN_FIELDS = frozenset(
    {
        "r", "lora_alpha", "target_modules", "use_rslora", "peft_type", "task_type",
        "inference_mode", "lora_dropout", "init_lora_weights", "peft_version", "revision",
        "base_model_name_or_path", "auto_mapping", "megatron_core", "qalora_group_size",
        "loftq_config", "eva_config", "corda_config", "lora_ga_config", "ensure_weight_tying",
    }
)  # fmt: skip
# every other field must be off; these are named in the refusal
_FIELD_NAMES = {
    "use_dora": "DoRA (use_dora)",
    "bias": "LoRA biases (bias)",
    "lora_bias": "LoRA biases (lora_bias)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layers_to_transform": "a layer subset (layers_to_transform)",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
}
_OFF = (None, False, "", "none", {}, [], (), set())  # peft: set() on MoE models


def _config_value(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _fields(config: Any) -> dict[str, Any]:
    """A peft config's fields (a `LoraConfig`'s `to_dict()`, or the dict itself)."""
    return dict(config) if isinstance(config, Mapping) else dict(config.to_dict())


def _refuse_unserved_options(config: Any) -> None:
    """Raise ValueError naming the first peft option that is on and changes the computation."""
    for name, value in _fields(config).items():
        if name in _PLAIN_FIELDS or any(value == off for off in _OFF if type(value) is type(off)):
            continue
        what = _FIELD_NAMES.get(name, name)
        raise ValueError(f"adapter: {what} is not supported (got {value!r})")


def _targets(config: Any) -> list[str]:
    targets = _config_value(config, "target_modules")
    if targets == "all-linear":
        return sorted(LORA_TARGETS)
    if isinstance(targets, str) or not targets:
        raise ValueError(
            f"adapter: target_modules must list projections among {', '.join(LORA_TARGETS)} "
            f"(got {targets!r}; a regex is not supported)"
        )
    # peft expands "all-linear" into full module paths: the projection is the last part (a
    # subset of layers is refused by the engine, which names the missing tensors)
    names = sorted({target.rsplit(".", 1)[-1] for target in targets})
    unknown = [name for name in names if name not in LORA_TARGETS]
    if unknown:
        raise ValueError(
            f"adapter: target_modules {unknown} are not decoder projections an engine adapts "
            f"({', '.join(LORA_TARGETS)})"
        )
    return names


def adapter_spec(config: Any, base_fingerprint: str, *, active: bool = True) -> AdapterSpec:
    """The order's description of an adapter with peft config `config` (a `LoraConfig` or
    its dict) trained on the base model `base_fingerprint`.

    Raises:
        ValueError: a peft option the engines cannot serve, or targets they do not adapt.
    """
    _refuse_unserved_options(config)
    if re.fullmatch("[0-9a-f]{32}", str(base_fingerprint)) is None:
        raise ValueError(
            f"adapter: base_fingerprint must be a fingerprint (32 hex digits), got "
            f"{base_fingerprint!r}"
        )
    peft_type = _config_value(config, "peft_type", "LORA")
    if peft_type not in (None, "LORA"):  # peft's PeftType is a str enum
        raise ValueError(f"adapter: peft_type {peft_type!r} is not LoRA")
    return AdapterSpec(
        base_fingerprint=base_fingerprint,
        r=int(_config_value(config, "r")),
        lora_alpha=float(_config_value(config, "lora_alpha")),
        target_modules=_targets(config),
        use_rslora=bool(_config_value(config, "use_rslora", False)),
        active=active,
    )


def _saved_name(name: str, adapter_name: str) -> str | None:
    """`name` as peft saves it (`...q_proj.lora_A.weight`), or None if not an adapter matrix."""
    parts = name.split(".")
    for part in _LORA_PARTS:
        if part not in parts:
            continue
        at = parts.index(part)
        if parts[at + 1 : at + 2] == [adapter_name]:
            del parts[at + 1]
        if parts[at + 1 :] != ["weight"]:
            return None
        saved = ".".join(parts)
        return saved if saved.startswith(PEFT_PREFIX) else PEFT_PREFIX + saved
    return None


def adapter_tensors(
    weights: nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    adapter_name: str | None = None,
) -> dict[str, torch.Tensor]:
    """The adapter's matrices under peft's saved names, detached.

    Args:
        weights: a `PeftModel` (its `adapter_name` adapter's `lora_A` / `lora_B` are taken,
            the base's weights left), or an adapter's state dict (as `get_peft_model_state_dict`
            returns it or `adapter_model.safetensors` holds it).
        adapter_name: the peft adapter (None: a `PeftModel`'s active one, else "default").

    Raises:
        ValueError: a state dict holding something else than LoRA matrices (named), or none.
    """
    from_module = isinstance(weights, nn.Module)
    if adapter_name is None:
        adapter_name = getattr(weights, "active_adapter", None) or "default"
    items = weights.state_dict().items() if from_module else dict(weights).items()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in items:
        saved = _saved_name(name, adapter_name)
        if saved is None:
            if from_module:
                continue
            raise ValueError(
                f"adapter: {name!r} is not a LoRA matrix (an adapter push carries lora_A and "
                "lora_B weights only; push the base model without adapter=)"
            )
        tensors[saved] = tensor.detach()
    if not tensors:
        raise ValueError(f"adapter: no lora_A / lora_B matrices of adapter {adapter_name!r}")
    return tensors


def base_weights(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's tensors of a `PeftModel` under Hugging Face names (no adapter matrices,
    `base_layer` unwrapped): what `Publisher.fingerprint` and a base push take."""
    tensors = {}
    for name, tensor in peft_model.state_dict().items():
        if any(f".{part}." in name for part in _LORA_PARTS):
            continue
        hf_name = name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
        tensors[hf_name] = tensor.detach()
    return tensors


def check_adapter(tensors: Mapping[str, torch.Tensor], spec: AdapterSpec) -> None:
    """Refuse tensors that do not match `spec`: a module outside its targets, or a rank that
    is not `spec.r` (each named).

    Raises:
        ValueError: the tensors and the config disagree.
    """
    errors = []
    for name, tensor in tensors.items():
        parts = name.split(".")
        module, part = parts[-3], parts[-2]
        if module not in spec.target_modules:
            errors.append(f"{name}: {module} is not among target_modules")
        elif tensor.dim() != 2:
            errors.append(f"{name}: {tensor.dim()}-d, a LoRA matrix is 2-d")
        elif tensor.shape[0 if part == "lora_A" else 1] != spec.r:
            errors.append(f"{name}: shape {tuple(tensor.shape)} is not of rank {spec.r}")
    if errors:
        raise ValueError("adapter: " + "; ".join(errors))
