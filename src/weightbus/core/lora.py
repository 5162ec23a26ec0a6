"""LoRA adapters on the trainer side: the adapter's tensors and config as `peft` holds them.

An adapter push (`Publisher.push(peft_model, adapter=lora_config, ...)`) sends the adapter's
`lora_A` / `lora_B` matrices only, under the names `peft` saves them with
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`: A is `(r, in_features)`,
B `(out_features, r)`), and an `AdapterSpec` (rank, alpha, targets, the base's fingerprint) in
the order. Nothing here imports `peft`: a `LoraConfig` is read by its attributes, so a dict
as `adapter_config.json` holds it works too.

`peft` options an engine cannot serve as plain `base + scaling * B @ A` on the targeted
projections are refused by name: DoRA, LoRA biases, `fan_in_fan_out`, per-module ranks or
alphas, `modules_to_save`, layer subsets.
"""

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from weightbus.core.wire.adapter import LORA_TARGETS, PEFT_PREFIX, AdapterSpec

_LORA_PARTS = ("lora_A", "lora_B")
# peft options that change the computation, and the value an engine serving plain LoRA needs
_UNSUPPORTED = {
    "use_dora": (False, "DoRA (use_dora)"),
    "bias": ("none", "LoRA biases (bias)"),
    "lora_bias": (False, "LoRA biases (lora_bias)"),
    "fan_in_fan_out": (False, "fan_in_fan_out"),
    "rank_pattern": ({}, "per-module ranks (rank_pattern)"),
    "alpha_pattern": ({}, "per-module alphas (alpha_pattern)"),
    "modules_to_save": (None, "modules_to_save"),
    "layers_to_transform": (None, "a layer subset (layers_to_transform)"),
}


def _config_value(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


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
    for name, (plain, what) in _UNSUPPORTED.items():
        value = _config_value(config, name, plain)
        if value is not None and value != plain and value != type(plain)():
            raise ValueError(f"adapter: {what} is not supported (got {value!r})")
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


def adapter_name_map(adapter_name: str = "default") -> Callable[[str], str | None]:
    """A `name_map` keeping only the `adapter_name` adapter's matrices, under peft's saved
    names (what a sharded trainer rank's adapter push sends)."""
    return lambda name: _saved_name(name, adapter_name)


def adapter_tensors(
    weights: nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    adapter_name: str = "default",
) -> dict[str, torch.Tensor]:
    """The adapter's matrices under peft's saved names, detached.

    Args:
        weights: a `PeftModel` (its `adapter_name` adapter's `lora_A` / `lora_B` are taken,
            the base's weights left), or an adapter's state dict (as `get_peft_model_state_dict`
            returns it or `adapter_model.safetensors` holds it).

    Raises:
        ValueError: a state dict holding something else than LoRA matrices (named), or none.
    """
    from_module = isinstance(weights, nn.Module)
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
