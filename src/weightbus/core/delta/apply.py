"""The receiving side of a delta: payload names, and a sparse change applied to one rank's slice.

A sparse tensor travels as two ordinary stream tensors: its changed elements' flat indices in
the full tensor (int32, or int64 past 2**31 elements; increasing) and their new values (its
dtype). A rank holding a slice of the tensor (`ShardCopy`: a range along one dimension) keeps
the changes that fall inside it and writes them at their place in its parameter.
"""

import math

import torch

from weightbus.core.delta.bits import gather, scatter
from weightbus.core.plan.shard import ShardCopy

PAYLOAD_PREFIX = "weightbus.core.delta/"
_INDICES, _VALUES = "indices", "values"


def payload_names(name: str) -> tuple[str, str]:
    """The stream names of a sparse tensor's indices and values."""
    return f"{PAYLOAD_PREFIX}{name}/{_INDICES}", f"{PAYLOAD_PREFIX}{name}/{_VALUES}"


def payload_of(stream_name: str) -> tuple[str, str] | None:
    """`(tensor name, "indices" | "values")` for a payload name; None for a whole tensor."""
    if not stream_name.startswith(PAYLOAD_PREFIX):
        return None
    name, _, part = stream_name[len(PAYLOAD_PREFIX) :].rpartition("/")
    return (name, part) if name and part in (_INDICES, _VALUES) else None


def check_payload(name: str, indices: torch.Tensor, values: torch.Tensor, numel: int) -> None:
    """Raise ValueError unless the indices are increasing and address the tensor, one value each.

    A corrupted index inside the range passes this check; the slice digests after applying
    catch it.
    """
    if indices.dim() != 1 or values.shape != indices.shape:
        raise ValueError(
            f"delta of {name!r}: {tuple(indices.shape)} indices for {tuple(values.shape)} values"
        )
    if indices.numel() == 0:
        return
    first, last = int(indices[0]), int(indices[-1])
    if first < 0 or last >= numel:
        raise ValueError(f"delta of {name!r}: an index lies outside its {numel} elements")
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise ValueError(f"delta of {name!r}: indices are not strictly increasing")


def apply_to_slice(
    destination: torch.Tensor,
    full_shape: tuple[int, ...],
    copy: ShardCopy,
    indices: torch.Tensor,
    values: torch.Tensor,
) -> int:
    """Write the changes inside this rank's slice of the full tensor into `destination`
    (`copy.destination(param)`); returns how many elements it wrote.

    `indices` are increasing flat indices into the full tensor of `full_shape`; the slice is
    `full.narrow(copy.src_dim, copy.src_start, copy.length)` and has `destination`'s shape.
    """
    if not full_shape or (copy.src_start == 0 and copy.length == full_shape[copy.src_dim]):
        scatter(destination, indices, values)  # held whole
        return indices.numel()
    inner = math.prod(full_shape[copy.src_dim + 1 :])
    if copy.src_dim == 0:  # a range of rows: a range of flat indices, found by bisection
        bounds = torch.tensor([copy.src_start * inner, (copy.src_start + copy.length) * inner])
        low, high = torch.searchsorted(indices, bounds.to(indices.dtype)).tolist()
        scatter(destination, indices[low:high] - copy.src_start * inner, values[low:high])
        return high - low
    dim_size = full_shape[copy.src_dim]
    coordinate = torch.div(indices, inner, rounding_mode="floor") % dim_size
    inside = (coordinate >= copy.src_start) & (coordinate < copy.src_start + copy.length)
    flat, coordinate = indices[inside], coordinate[inside]
    outer = torch.div(flat, dim_size * inner, rounding_mode="floor")
    local = (outer * copy.length + coordinate - copy.src_start) * inner + flat % inner
    scatter(destination, local, gather(values, inside.nonzero().view(-1)))
    return int(local.numel())
