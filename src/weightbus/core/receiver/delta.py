"""One rank's side of a delta push: which stream tensors to expect, applying the sparse ones,
and proving the result is the new version.

The rank starts from the base version (its live weights, or a copy of them for an atomic
update). Whole tensors go through `load_weights` as in any push; each sparse tensor's two
payload tensors are kept until both arrived and then written into this rank's slice
(`SliceWriter.apply`). At the end every sparse tensor's slice is digested and compared with
the digest the publisher computed for this rank's slice of the new tensor, whole tensors'
stream digests with the new digests, and unchanged tensors' base digests with their new ones;
the base and new fingerprints are recomputed from the lists. Only then does the rank report
the new version's fingerprint.
"""

from collections.abc import Mapping
from typing import Protocol

import torch

from weightbus.core.delta import check_payload, payload_names, payload_of
from weightbus.core.digest import fingerprint_of_metas
from weightbus.core.meta import TensorMeta
from weightbus.core.wire.delta import DeltaSpec

_INDEX_DTYPES = (torch.int32, torch.int64)


class SliceWriter(Protocol):
    """A rank's parameters as slices of full tensors (the engine implements it)."""

    def apply(self, name: str, indices: torch.Tensor, values: torch.Tensor) -> None:
        """Write the changes (flat indices into the full tensor) inside this rank's slice."""

    def digest(self, name: str) -> str:
        """xxh3-128 of this rank's slice of tensor `name`, row-major."""


class DeltaReceive:
    """The delta part of one rank's receive.

    Args:
        spec: the delta's description from the update order.
        expected: the model's tensors (full shapes, serving dtype).
        writer: this rank's slices.
        rank: this rank's TP rank (its row of `spec.rank_digests`).
    """

    def __init__(
        self,
        spec: DeltaSpec,
        expected: Mapping[str, TensorMeta],
        writer: SliceWriter,
        rank: int,
    ) -> None:
        self.spec = spec
        self.expected = expected
        self.writer = writer
        self.rank = rank
        self._parts: dict[str, dict[str, torch.Tensor]] = {}
        self.applied: set[str] = set()

    def check_open(self, stream: Mapping[str, TensorMeta]) -> list[tuple[str, list[str]]]:
        """(message, names) for every way the spec or the stream's tensors are wrong."""
        problems = []
        listed = {tensor.name for tensor in self.spec.tensors}
        if listed != set(self.expected):
            odd = sorted(listed ^ set(self.expected))
            problems.append((f"delta lists other tensors than the model's: {odd}", odd))
            return problems
        if self.rank >= len(self.spec.rank_digests):
            problems.append((f"delta has no slice digests for rank {self.rank}", []))
        base = {t.name: t.base_digest for t in self.spec.tensors}
        if fingerprint_of_metas(self.expected.values(), base) != self.spec.base_fingerprint:
            problems.append(("delta base digests do not make its base fingerprint", []))
        new = {t.name: t.digest for t in self.spec.tensors}
        if fingerprint_of_metas(self.expected.values(), new) != self.spec.fingerprint:
            problems.append(("delta digests do not make its fingerprint", []))
        problems.extend(self._stream_problems(stream))
        return problems

    def _stream_problems(self, stream: Mapping[str, TensorMeta]) -> list[tuple[str, list[str]]]:
        wanted: set[str] = set()
        problems = []
        for tensor in self.spec.tensors:
            meta = self.expected[tensor.name]
            if tensor.kind == "full":
                wanted.add(tensor.name)
            elif tensor.kind == "sparse":
                index_name, value_name = payload_names(tensor.name)
                wanted.update((index_name, value_name))
                index, value = stream.get(index_name), stream.get(value_name)
                if index is None or value is None:
                    continue  # reported as missing below
                if (
                    index.dtype not in _INDEX_DTYPES
                    or value.dtype != meta.dtype
                    or len(index.shape) != 1
                    or index.shape != value.shape
                ):
                    problems.append(
                        (f"delta payload of {tensor.name!r} is malformed", [tensor.name])
                    )
        if set(stream) != wanted:
            odd = sorted(set(stream) ^ wanted)
            problems.append((f"delta stream does not carry what its spec lists: {odd}", odd))
        return problems

    def split(
        self, tensors: list[tuple[str, torch.Tensor]]
    ) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, str, torch.Tensor]]]:
        """Whole tensors (for `load_weights`) and payload parts `(name, part, tensor)`."""
        whole, parts = [], []
        for stream_name, tensor in tensors:
            payload = payload_of(stream_name)
            if payload is None:
                whole.append((stream_name, tensor))
            else:
                parts.append((*payload, tensor))
        return whole, parts

    def take(self, name: str, part: str, tensor: torch.Tensor) -> None:
        """Keep one payload part (copied: batches are reused); apply once both arrived.

        Raises:
            ValueError: the payload is malformed (the message names the tensor).
        """
        parts = self._parts.setdefault(name, {})
        parts[part] = tensor.clone()
        if len(parts) < 2:
            return
        del self._parts[name]
        indices, values = parts["indices"], parts["values"]
        check_payload(name, indices, values, self.expected[name].numel)
        self.writer.apply(name, indices, values)
        self.applied.add(name)

    def close_errors(self, stream_digests: Mapping[str, str]) -> list[tuple[str, list[str]]]:
        """(message, names) for each tensor of the new version this rank cannot prove."""
        problems = []
        slice_digests = iter(self.spec.rank_digests[self.rank])
        for tensor in self.spec.tensors:
            name = tensor.name
            if tensor.kind == "same" and tensor.base_digest != tensor.digest:
                problems.append((f"delta marks {name!r} unchanged but its digest changed", [name]))
            elif tensor.kind == "full" and stream_digests.get(name) != tensor.digest:
                problems.append((f"delta: whole tensor {name!r} is not the new version's", [name]))
            elif tensor.kind == "sparse":
                expected = next(slice_digests)
                if name not in self.applied:
                    problems.append((f"delta of {name!r} was never applied", [name]))
                elif self.writer.digest(name) != expected:
                    why = "wrong base, or a corrupted index"
                    message = f"delta of {name!r}: this rank's slice is not the new one ({why})"
                    problems.append((message, [name]))
        return problems

    def digests(self) -> dict[str, str]:
        return {tensor.name: tensor.digest for tensor in self.spec.tensors}
