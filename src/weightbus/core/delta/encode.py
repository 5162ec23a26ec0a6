"""The publishing side of a delta: the base kept from the last push, and what changed since.

`DeltaBase` holds a copy of every tensor of the last version pushed (host memory equal to the
model's size: the price of a delta), with its digests. `DeltaBase.encode` compares the next
version bit-wise, tensor by tensor: a tensor whose digest is unchanged is compared no further
and not sent (`same`); otherwise its changed elements travel as flat indices and values
(`sparse`) when that is smaller than the tensor, else the tensor is sent whole (`full`). After
the push, `advance` writes the same changes into the base, so it is the new version.
"""

import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from weightbus.core.delta.apply import payload_names
from weightbus.core.delta.bits import changes, scatter
from weightbus.core.digest import fingerprint_of_digests, tensor_digest
from weightbus.core.meta import dtype_name
from weightbus.core.wire.delta import DeltaKind, DeltaTensor
from weightbus.core.wire.messages import SliceSpec


@dataclass(slots=True)
class DeltaEncoding:
    """One version as changes to a base: per tensor its kind, and the tensors a push carries.

    Attributes:
        kinds: every tensor's `DeltaKind`.
        sparse: the changed elements of each sparse tensor, `(indices, values)`.
        stream: what the push sends: whole tensors under their names, and the payload tensors
            of each sparse one (`payload_names`).
        changed_elements, total_elements: elements whose bits differ (in compared tensors),
            and all elements.
        stream_bytes, full_bytes: the bytes the push carries, and what a full push would.
        encode_s: seconds spent comparing and gathering.
    """

    kinds: dict[str, DeltaKind] = field(default_factory=dict)
    sparse: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    stream: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    changed_elements: int = 0
    total_elements: int = 0
    stream_bytes: int = 0
    full_bytes: int = 0
    encode_s: float = 0.0
    compared: bool = True  # every changed tensor was compared element by element

    @property
    def changed_fraction(self) -> float | None:
        """Changed elements over all elements (None when changed tensors were not compared)."""
        if not self.compared:
            return None
        return self.changed_elements / self.total_elements if self.total_elements else 0.0

    def whole(self, name: str, tensor: torch.Tensor) -> None:
        """Send `name` whole."""
        self.kinds[name] = "full"
        self.stream.append((name, tensor))
        self.stream_bytes += _nbytes(tensor)

    @property
    def unchanged_tensors(self) -> int:
        return sum(kind == "same" for kind in self.kinds.values())

    def count(self, kind: DeltaKind) -> int:
        return sum(each == kind for each in self.kinds.values())


def _host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu").contiguous()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class DeltaBase:
    """The last version pushed, kept on the host to encode the next push against.

    Args:
        version, fingerprint: the version's name and fingerprint.
        tensors: its tensors by name (copied; the caller's tensors are not kept).
        digests: each tensor's digest (`weightbus.core.digest.tensor_digest`).
    """

    def __init__(
        self,
        version: str,
        fingerprint: str,
        tensors: Mapping[str, torch.Tensor],
        digests: Mapping[str, str],
    ) -> None:
        self.version = version
        self.fingerprint = fingerprint
        self.tensors = {name: _host(tensor).clone() for name, tensor in tensors.items()}
        self.digests = dict(digests)

    @property
    def nbytes(self) -> int:
        """Host memory the base holds."""
        return sum(_nbytes(tensor) for tensor in self.tensors.values())

    def mismatch(self, tensors: Mapping[str, torch.Tensor]) -> str | None:
        """Why `tensors` cannot be encoded against this base (None: they can)."""
        if set(tensors) != set(self.tensors):
            return "the tensors' names differ from the base's"
        for name, tensor in tensors.items():
            base = self.tensors[name]
            if (tensor.dtype, tuple(tensor.shape)) != (base.dtype, tuple(base.shape)):
                return f"tensor {name!r} changed its dtype or shape"
        return None

    def encode(
        self,
        tensors: Mapping[str, torch.Tensor],
        digests: Mapping[str, str],
        *,
        sparse: bool = True,
    ) -> DeltaEncoding:
        """Compare `tensors` (the next version, with its digests) with the base, bit-wise.

        With `sparse` False a changed tensor always goes whole (only unchanged ones are
        skipped) and is not compared element by element.
        """
        start = time.perf_counter()
        encoding = DeltaEncoding()
        with ThreadPoolExecutor(max_workers=max(torch.get_num_threads(), 1)) as pool:
            for name, tensor in tensors.items():
                self._encode_tensor(encoding, name, tensor, digests[name], pool if sparse else None)
        encoding.encode_s = time.perf_counter() - start
        return encoding

    def _encode_tensor(
        self,
        encoding: DeltaEncoding,
        name: str,
        tensor: torch.Tensor,
        digest: str,
        pool: ThreadPoolExecutor | None,
    ) -> None:
        """`pool` None: a changed tensor goes whole, uncompared."""
        nbytes = _nbytes(tensor)
        encoding.total_elements += tensor.numel()
        encoding.full_bytes += nbytes
        if digest == self.digests[name]:
            encoding.kinds[name] = "same"
            return
        if pool is None:
            encoding.compared = False
            encoding.whole(name, tensor)
            return
        indices, values = changes(self.tensors[name], _host(tensor), pool)
        encoding.changed_elements += indices.numel()
        sparse_bytes = indices.numel() * (indices.element_size() + tensor.element_size())
        if sparse_bytes < nbytes:
            encoding.kinds[name] = "sparse"
            encoding.sparse[name] = (indices, values)
            encoding.stream.extend(zip(payload_names(name), (indices, values), strict=True))
            encoding.stream_bytes += sparse_bytes
        else:
            encoding.whole(name, tensor)

    def advance(
        self,
        encoding: DeltaEncoding,
        tensors: Mapping[str, torch.Tensor],
        version: str,
        fingerprint: str,
        digests: Mapping[str, str],
    ) -> None:
        """Make the base the version `encoding` encoded (after a push of it committed)."""
        for name, kind in encoding.kinds.items():
            if kind == "sparse":
                scatter(self.tensors[name], *encoding.sparse[name])
            elif kind == "full":
                self.tensors[name].copy_(tensors[name].detach())
        self.version, self.fingerprint = version, fingerprint
        self.digests = dict(digests)

    def replace(
        self,
        tensors: Mapping[str, torch.Tensor],
        version: str,
        fingerprint: str,
        digests: Mapping[str, str],
    ) -> None:
        """Make the base another version of the same tensors, copied into its buffers."""
        for name, tensor in tensors.items():
            self.tensors[name].copy_(tensor.detach())
        self.version, self.fingerprint = version, fingerprint
        self.digests = dict(digests)

    def tensor_list(self, encoding: DeltaEncoding, digests: Mapping[str, str]) -> list[DeltaTensor]:
        """The spec's per-tensor list: kind, base digest and new digest of every tensor."""
        return [
            DeltaTensor(name, kind, self.digests[name], digests[name])
            for name, kind in encoding.kinds.items()
        ]


def version_digests(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, str], str]:
    """Every tensor's digest, and the version's fingerprint."""
    digests = {name: tensor_digest(tensor) for name, tensor in tensors.items()}
    records = [
        (name, dtype_name(t.dtype), tuple(t.shape), digests[name]) for name, t in tensors.items()
    ]
    return digests, fingerprint_of_digests(records)


def slice_of(full: torch.Tensor, spec: SliceSpec) -> torch.Tensor:
    """A rank's slice of a full tensor (`SliceSpec`: a range along one dimension)."""
    return full.narrow(spec.dim, spec.start, spec.length) if full.dim() else full


def rank_digests(
    rank_slices: list[list[SliceSpec]],
    sparse_names: list[str],
    tensors: Mapping[str, torch.Tensor],
    digests: Mapping[str, str],
) -> list[list[str]]:
    """Per rank, the digest of its slice of each sparse tensor of the new version.

    Ranks holding a tensor whole reuse its digest; equal slices are digested once.

    Raises:
        ValueError: a rank's slice map lacks a sparse tensor.
    """
    cache: dict[tuple, str] = {}
    out = []
    for rank, slices in enumerate(rank_slices):
        by_name = {spec.name: spec for spec in slices}
        row = []
        for name in sparse_names:
            spec = by_name.get(name)
            if spec is None:
                raise ValueError(f"rank {rank}'s slice map lacks tensor {name!r}")
            full = tensors[name]
            whole = full.dim() == 0 or (spec.start == 0 and spec.length == full.shape[spec.dim])
            if whole:
                row.append(digests[name])
                continue
            key = (name, spec.dim, spec.start, spec.length)
            if key not in cache:
                cache[key] = tensor_digest(slice_of(_host(full), spec))
            row.append(cache[key])
        out.append(row)
    return out
