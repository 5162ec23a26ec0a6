"""A delta push's description: what each tensor of the new version is relative to its base.

It travels in the update order (HTTP JSON to the API server, msgpack to the ranks), not in the
stream: the engine refuses a delta whose base it does not serve before a byte moves. The stream
itself carries ordinary tensors: the tensors sent whole under their own names, and per sparse
tensor two payload tensors (`weightbus.core.delta.payload_names`).
"""

from typing import Literal

import msgspec

from weightbus.core.wire.messages import Hex128, TensorName, Version

# How an engine's refusal of a delta for another base begins (HTTP 409): the publisher then
# pushes that engine the whole version.
DELTA_BASE_REFUSAL = "delta base"

# How a tensor of the new version reaches the engine: not at all (bit-identical to its base),
# as its changed elements (flat indices and values), or whole.
DeltaKind = Literal["same", "sparse", "full"]


class DeltaTensor(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One tensor of the new version: how it travels, its base's digest and its own."""

    name: TensorName
    kind: DeltaKind
    base_digest: Hex128
    digest: Hex128


class DeltaSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A push of `fingerprint` as changes to `base_fingerprint`, for one engine.

    Attributes:
        base_version, base_fingerprint: the version the delta applies to; an engine serving
            anything else refuses it (409) before receiving.
        fingerprint: the new version's fingerprint (every tensor, not the stream's payload).
        tensors: every tensor of the new version, each once.
        rank_digests: per TP rank of this engine, the digest of that rank's slice of each
            sparse tensor after the change, in `tensors` order (the publisher computes them
            from the slice map the engine reported): how a rank that holds only a slice
            proves it applied the change exactly.
        expert_map: the hash of the expert map those slice maps follow (None: a dense model).
    """

    base_version: Version
    base_fingerprint: Hex128
    fingerprint: Hex128
    tensors: list[DeltaTensor]
    rank_digests: list[list[Hex128]]
    # the expert map the slice maps behind `rank_digests` follow (a mixture-of-experts engine's
    # `GET /v1/weights/layout`); an engine whose experts moved since refuses the base (409)
    expert_map: Hex128 | None = None

    def __post_init__(self) -> None:
        names = [tensor.name for tensor in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("delta: a tensor is listed twice")
        sparse = sum(tensor.kind == "sparse" for tensor in self.tensors)
        if any(len(digests) != sparse for digests in self.rank_digests):
            raise ValueError(
                f"delta: every rank needs {sparse} slice digests, one per sparse tensor"
            )

    @property
    def sparse_names(self) -> list[str]:
        return [tensor.name for tensor in self.tensors if tensor.kind == "sparse"]
