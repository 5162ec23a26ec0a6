"""What a trainer gives a push, as the `(name, tensor)` list engines serve: `normalize_weights`.

Every path that names a version's tensors goes through it: a push from one process, every rank
of a sharded trainer (`weightbus.core.trainer.holdings`, whose sources may be DTensors and
declared shards), and `weightbus.fingerprint`, so the fingerprint a user computes on a model is
the one its push reports.
"""

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from weightbus.core.experts import is_fused_experts, split_fused_experts
from weightbus.core.meta import DRAFT_PREFIX, is_draft_name, metas_of

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


def named_pairs(weights: Any) -> Iterator[tuple[str, Any]]:
    """`(name, value)` pairs of an `nn.Module` (its state dict), a mapping, or pairs; a fused
    3-D expert tensor (transformers 5) as its experts' tensors (`experts.split_fused_experts`)."""
    if isinstance(weights, torch.nn.Module):
        pairs = weights.state_dict().items()
    elif isinstance(weights, Mapping):
        pairs = weights.items()
    else:
        pairs = weights
    for name, value in pairs:
        # a DTensor's experts are split by the trainer layouts (not here)
        if isinstance(value, torch.Tensor) and not is_dtensor(value) and is_fused_experts(name):
            yield from split_fused_experts(name, value)
        else:
            yield name, value


def is_dtensor(value: Any) -> bool:
    """Whether `value` is a DTensor (a sharded trainer's parameter)."""
    if not isinstance(value, torch.Tensor) or type(value) is torch.Tensor:
        return False  # a plain tensor: torch.distributed's tensor module is not loaded for it
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def named_sources(
    weights: Any,
    name_map: NameMap | None,
    *,
    memory_of: Callable[[Any], torch.Tensor | None],
    kinds: str = "a tensor",
) -> Iterator[tuple[str, Any]]:
    """`(final name, source)` pairs of `weights`, renamed, each memory once per model.

    `memory_of(value)` is the tensor whose memory a value reads, or None when the value is not
    a source (`kinds` names what is). A value that reads the very memory of an earlier one of
    the same model (tied embeddings in a state dict) is left out, its first name kept; a
    draft model's tensors (`draft.` names) are counted apart from the main model's: each model
    loads its own copy.

    Raises:
        TypeError: a value is not a source.
        ValueError: two values end up with the same name.
    """
    seen_memory: set[tuple] = set()
    seen_names: set[str] = set()
    for name, value in named_pairs(weights):
        memory = memory_of(value)
        if memory is None:
            raise TypeError(f"weight {name!r} is a {type(value).__name__}, not {kinds}")
        new_name = rename(name_map, name)
        if new_name is None:
            continue
        if new_name in seen_names:
            raise ValueError(f"duplicate tensor name {new_name!r}")
        key = memory_key(memory)
        if key is not None and (key := (is_draft_name(new_name), *key)) in seen_memory:
            continue
        seen_memory.add(key)
        seen_names.add(new_name)
        yield new_name, value


def _tensor(value: Any) -> torch.Tensor | None:
    return value.detach() if isinstance(value, torch.Tensor) else None


def normalize_weights(weights: Weights, name_map: NameMap | None = None) -> list[tuple[str, Any]]:
    """The `(name, tensor)` pairs to send, in order.

    Args:
        weights: an `nn.Module` (its state dict), a state dict, or `(name, tensor)` pairs.
        name_map: renames (a dict or a function); a name mapped to None is not sent.

    Returns:
        Detached tensors under their final names (`named_sources`: each memory once per
        model). A tied LM head is recognised by its values (`tied_head_names`), so a model,
        its state dict, a deepcopy and a tensor-by-tensor clone push the same tensors.

    Raises:
        TypeError: a value is not a tensor.
        ValueError: two tensors end up with the same name; a module whose config ties its
            embeddings holds a head that differs from them.
    """
    pairs = [
        (name, value.detach())
        for name, value in named_sources(weights, name_map, memory_of=_tensor)
    ]
    metas_of(pairs)  # raises ValueError on an unsupported dtype
    tensors = dict(pairs)
    dropped = tied_head_names(
        lambda name: (tensors.get(name), None), declared_tied=declares_tie(weights)
    )
    return [(name, tensor) for name, tensor in pairs if name not in dropped]


def declares_tie(weights: Any) -> bool:
    """Whether `weights` is a module whose config ties its head to its embeddings."""
    config = getattr(weights, "config", None) if isinstance(weights, torch.nn.Module) else None
    return bool(getattr(config, "tie_word_embeddings", False))


def tied_head_names(
    held: Callable[[str], tuple[torch.Tensor | None, object]], *, declared_tied: bool = False
) -> set[str]:
    """The heads (`TIED_HEADS`, of the main model and of a draft) tied to their embeddings: a
    head whose values equal the embeddings' (same dtype, shape and bits), as a clone of a tied
    model's state dict holds. An engine serving a tied checkpoint expects the embeddings alone
    (vLLM refuses the head); an untied model's head differs from its embeddings after any
    training.

    `held(name)` is `(tensor, where)`: the tensor held under `name` (None: not held) and which
    part of the full tensor it is (compared too: a sharded trainer's rank compares the parts it
    holds of both).

    Raises:
        ValueError: `declared_tied` (the module's config ties them) and a head differs from its
            embeddings, naming both.
    """
    dropped = set()
    for head, embeddings in TIED_HEADS:
        for prefix in ("", DRAFT_PREFIX):
            head_tensor, head_part = held(prefix + head)
            source, source_part = held(prefix + embeddings)
            if head_tensor is None or source is None or head_part != source_part:
                continue
            if same_values(head_tensor, source):
                dropped.add(prefix + head)
            elif declared_tied:
                raise ValueError(
                    f"{prefix + head!r} differs from {prefix + embeddings!r}, but the model's "
                    "config ties them (tie_word_embeddings): untie the config or the tensors"
                )
    return dropped


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bits (dtype, shape, device too); an untied head
    differs in its first row, so it costs no full read per push."""
    if (a.dtype, a.shape, a.device) != (b.dtype, b.shape, b.device):
        return False
    if memory_key(a) == memory_key(b):
        return True
    if a.dim() and not _same_bits(a[:1], b[:1]):
        return False
    return _same_bits(a, b)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_contiguous() and b.is_contiguous():  # bits: -0.0 and 0.0 differ
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return torch.equal(a, b)
