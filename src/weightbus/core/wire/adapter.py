"""A LoRA adapter push's description: the adapter's shape and scale, and the base it belongs to.

It travels in the update order, like a delta's description: the engine refuses an adapter for
a base it does not serve (409, naming both fingerprints) or of a shape it was not started for
before a byte moves. The stream carries the adapter's tensors under their PEFT names
(`base_model.model.<module>.lora_A.weight`, `.lora_B.weight`).

What an engine serves with an adapter is identified by `served_fingerprint`: the base's
fingerprint, the adapter tensors' fingerprint and the scale that applies them, hashed together,
so two engines serving the same base and adapter report the same fingerprint, and the base
alone (no adapter) reports the base's own.
"""

import math
from typing import Annotated

import msgspec
import xxhash

from weightbus.core.wire.messages import Hex128

# The projections of a Llama-family decoder layer an adapter may target (PEFT module names).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
MAX_LORA_RANK = 4096
# peft saves an adapter's tensors under the wrapped model's names
PEFT_PREFIX = "base_model.model."
_IDENTITY_FORMAT = 1

LoraRank = Annotated[int, msgspec.Meta(ge=1, le=MAX_LORA_RANK)]
LoraAlpha = Annotated[float, msgspec.Meta(gt=0, le=1e6)]
Target = Annotated[str, msgspec.Meta(pattern="^(" + "|".join(LORA_TARGETS) + ")$")]


class AdapterSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A push of a LoRA adapter's tensors onto the base model `base_fingerprint`.

    Attributes:
        base_fingerprint: the base model the adapter was trained on; an engine serving
            another base refuses the push (409) before receiving.
        r: the adapter's rank (PEFT `r`).
        lora_alpha: PEFT `lora_alpha`; the update is `scaling * B @ A`.
        target_modules: the projections adapted in every decoder layer, sorted.
        use_rslora: scaling is `lora_alpha / sqrt(r)` (else `lora_alpha / r`).
        active: False: the engine stops applying an adapter and serves the base alone (the
            push's tensors are zeros of the adapter's shapes: `Publisher.remove_adapter`).
    """

    base_fingerprint: Hex128
    r: LoraRank
    lora_alpha: LoraAlpha
    target_modules: Annotated[list[Target], msgspec.Meta(min_length=1, max_length=7)]
    use_rslora: bool = False
    active: bool = True

    def __post_init__(self) -> None:
        if list(self.target_modules) != sorted(set(self.target_modules)):
            raise ValueError("adapter: target_modules must be sorted and distinct")

    @property
    def scaling(self) -> float:
        """What `B @ A` is multiplied by (PEFT's `scaling`)."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def describe(self) -> str:
        """One line: rank, alpha and targets (for logs and errors)."""
        rslora = ", rsLoRA" if self.use_rslora else ""
        return (
            f"rank {self.r}, alpha {self.lora_alpha:g}{rslora} on {', '.join(self.target_modules)}"
        )


def served_fingerprint(spec: AdapterSpec, adapter_fingerprint: str) -> str:
    """The fingerprint of what an engine serves after the push: the base's own when `spec`
    removes the adapter, else xxh3-128 over the base's fingerprint, the adapter tensors'
    fingerprint and everything that scales them."""
    if not spec.active:
        return spec.base_fingerprint
    record = [
        _IDENTITY_FORMAT,
        spec.base_fingerprint,
        adapter_fingerprint,
        spec.r,
        spec.lora_alpha,
        spec.use_rslora,
        list(spec.target_modules),
    ]
    return xxhash.xxh3_128_hexdigest(msgspec.msgpack.encode(record))


def is_adapter_name(name: str) -> bool:
    """Whether a pushed tensor is an adapter's (peft's names), not the base model's."""
    return name.startswith(PEFT_PREFIX)


def hf_module(layer: int, projection: str) -> str:
    """The Hugging Face module of decoder layer `layer`'s `projection`."""
    block = "mlp" if projection in _MLP else "self_attn"
    return f"model.layers.{layer}.{block}.{projection}"


def adapter_names(layer: int, projection: str) -> tuple[str, str]:
    """The pushed names of the A and B of decoder layer `layer`'s `projection`."""
    module = PEFT_PREFIX + hf_module(layer, projection)
    return f"{module}.lora_A.weight", f"{module}.lora_B.weight"
