"""Turn what a trainer holds into the ordered `(hf_name, tensor)` list a push sends."""

import secrets
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from weightbus.core.meta import DRAFT_PREFIX, is_draft_name, metas_of
from weightbus.core.plan import Plan, plan_buckets
from weightbus.core.transport import PushSession

# (head, embeddings) a checkpoint may tie (Hugging Face `tie_word_embeddings`)
TIED_HEADS = (("lm_head.weight", "model.embed_tokens.weight"),)

NameMap = Mapping[str, str | None] | Callable[[str], str | None]
Weights = torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def rename(name_map: NameMap | None, name: str) -> str | None:
    if name_map is None:
        return name
    if callable(name_map):
        return name_map(name)
    return name_map.get(name, name)


def memory_key(tensor: torch.Tensor) -> tuple | None:
    """Identity of the exact memory a tensor reads (None for empty tensors)."""
    if tensor.numel() == 0:
        return None
    return (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())


def named_pairs(weights: Any) -> Iterable[tuple[str, Any]]:
    """`(name, value)` pairs of an `nn.Module` (its state dict), a mapping, or pairs."""
    if isinstance(weights, torch.nn.Module):
        return weights.state_dict().items()
    if isinstance(weights, Mapping):
        return weights.items()
    return weights


def normalize_weights(weights: Weights, name_map: NameMap | None = None) -> list[tuple[str, Any]]:
    """The `(name, tensor)` pairs to send, in order.

    Args:
        weights: an `nn.Module` (its state dict), a state dict, or `(name, tensor)` pairs.
        name_map: renames (a dict or a function); a name mapped to None is not sent.

    Returns:
        Detached tensors under their final names. A tensor that is the very same memory as an
        earlier one of the same model (tied embeddings in a state dict) is sent once, under its
        first name; a draft model's tensors (`draft.` names) are counted apart from the main
        model's. A tied LM head is recognised by its values too (`drop_tied_heads`), so a
        model, its state dict, a deepcopy and a tensor-by-tensor clone push the same tensors.

    Raises:
        TypeError: a value is not a tensor.
        ValueError: two tensors end up with the same name; a module whose config ties its
            embeddings holds a head that differs from them.
    """
    result: list[tuple[str, torch.Tensor]] = []
    seen_memory: set[tuple] = set()
    for name, value in named_pairs(weights):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(value).__name__}, not a tensor")
        new_name = rename(name_map, name)
        if new_name is None:
            continue
        tensor = value.detach()
        # per model: a draft may share a tensor with the main model (e.g. the embeddings),
        # and each model loads its own copy
        key = memory_key(tensor)
        if key is not None and (key := (is_draft_name(new_name), *key)) in seen_memory:
            continue
        seen_memory.add(key)
        result.append((new_name, tensor))
    metas_of(result)  # raises ValueError naming a duplicate name
    return drop_tied_heads(result, declared_tied=_declares_tie(weights))


def _declares_tie(weights: Weights) -> bool:
    config = getattr(weights, "config", None) if isinstance(weights, torch.nn.Module) else None
    return bool(getattr(config, "tie_word_embeddings", False))


def drop_tied_heads(
    pairs: list[tuple[str, torch.Tensor]], *, declared_tied: bool = False
) -> list[tuple[str, torch.Tensor]]:
    """`pairs` without a head that is tied to its embeddings (`TIED_HEADS`): one whose values
    equal the embeddings' (same dtype, shape and bits), as a clone of a tied model's state dict
    holds. An engine serving a tied checkpoint expects the embeddings alone (vLLM refuses the
    head); an untied model's head differs from its embeddings after any training.

    Raises:
        ValueError: `declared_tied` (the module's config ties them) and a head differs from its
            embeddings, naming both.
    """
    tensors = dict(pairs)
    dropped = set()
    for head, embeddings in TIED_HEADS:
        for prefix in ("", DRAFT_PREFIX):
            head_tensor = tensors.get(prefix + head)
            source = tensors.get(prefix + embeddings)
            if head_tensor is None or source is None:
                continue
            if _same_values(head_tensor, source):
                dropped.add(prefix + head)
            elif declared_tied:
                raise ValueError(
                    f"{prefix + head!r} differs from {prefix + embeddings!r}, but the model's "
                    "config ties them (tie_word_embeddings): untie the config or the tensors"
                )
    return [(name, tensor) for name, tensor in pairs if name not in dropped]


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    if (a.dtype, a.shape, a.device) != (b.dtype, b.shape, b.device):
        return False
    if memory_key(a) == memory_key(b):
        return True
    if a.dim() and not _same_bits(a[:1], b[:1]):  # an untied head: no full read per push
        return False
    return _same_bits(a, b)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_contiguous() and b.is_contiguous():  # bits: -0.0 and 0.0 differ
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return torch.equal(a, b)


class SessionFactory:
    """Builds push sessions, reusing the plan while the layout is unchanged."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self._plan: Plan | None = None

    def plan_for(self, weights: list[tuple[str, torch.Tensor]]) -> Plan:
        metas = tuple(metas_of(weights))
        if self._plan is None or self._plan.metas != metas:
            self._plan = plan_buckets(metas, self.bucket_bytes)
        return self._plan

    def session(
        self,
        weights: list[tuple[str, torch.Tensor]],
        version: str,
        step: int | None,
        receivers: int = 1,
        *,
        verify: bool = True,
        engines: tuple[str, ...] = (),
    ) -> PushSession:
        return PushSession(
            session_id=secrets.token_hex(16),
            version=version,
            step=step,
            plan=self.plan_for(weights),
            receivers=receivers,
            verify=verify,
            engines=engines,
        )

    def fingerprint(self, weights: list[tuple[str, torch.Tensor]]) -> str:
        """The fingerprint engines report after a push of `weights` (computed here)."""
        session = self.session(weights, "local", None)
        session.ensure_digests(dict(weights))
        return session.fingerprint
