"""Turn what a trainer holds into the ordered `(hf_name, tensor)` list a push sends."""

import secrets
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from weightbus.core.meta import is_draft_name, metas_of
from weightbus.core.plan import Plan, plan_buckets
from weightbus.core.transport import PushSession

NameMap = Mapping[str, str | None] | Callable[[str], str | None]
Weights = torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def _rename(name_map: NameMap | None, name: str) -> str | None:
    if name_map is None:
        return name
    if callable(name_map):
        return name_map(name)
    return name_map.get(name, name)


def _memory_key(tensor: torch.Tensor) -> tuple | None:
    """Identity of the exact memory a tensor reads (None for empty tensors)."""
    if tensor.numel() == 0:
        return None
    return (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())


def normalize_weights(weights: Weights, name_map: NameMap | None = None) -> list[tuple[str, Any]]:
    """The `(name, tensor)` pairs to send, in order.

    Args:
        weights: an `nn.Module` (its state dict), a state dict, or `(name, tensor)` pairs.
        name_map: renames (a dict or a function); a name mapped to None is not sent.

    Returns:
        Detached tensors under their final names. A tensor that is the very same memory as an
        earlier one of the same model (tied embeddings in a state dict) is sent once, under its
        first name; a draft model's tensors (`draft.` names) are counted apart from the main
        model's.

    Raises:
        TypeError: a value is not a tensor.
        ValueError: two tensors end up with the same name.
    """
    if isinstance(weights, torch.nn.Module):
        pairs = weights.state_dict().items()
    elif isinstance(weights, Mapping):
        pairs = weights.items()
    else:
        pairs = weights
    result: list[tuple[str, torch.Tensor]] = []
    seen_memory: set[tuple] = set()
    for name, value in pairs:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(value).__name__}, not a tensor")
        new_name = _rename(name_map, name)
        if new_name is None:
            continue
        tensor = value.detach()
        # per model: a draft may share a tensor with the main model (e.g. the embeddings),
        # and each model loads its own copy
        key = _memory_key(tensor)
        if key is not None and (key := (is_draft_name(new_name), *key)) in seen_memory:
            continue
        seen_memory.add(key)
        result.append((new_name, tensor))
    metas_of(result)  # raises ValueError naming a duplicate name
    return result


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
