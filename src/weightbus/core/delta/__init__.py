"""Delta pushes: a version sent as its changes to the version the engines already serve.

Publisher side: `DeltaBase` (the last version pushed) and its `encode`, `rank_digests`.
Receiver side: `payload_of`, `check_payload`, `apply_to_slice`. The description of a delta
(`DeltaSpec`) is a wire type (`weightbus.core.wire.delta`).
"""

from weightbus.core.delta.apply import (
    PAYLOAD_PREFIX,
    apply_to_slice,
    check_payload,
    payload_names,
    payload_of,
)
from weightbus.core.delta.encode import (
    DeltaBase,
    DeltaEncoding,
    rank_digests,
    slice_of,
    version_digests,
)

__all__ = [
    "PAYLOAD_PREFIX",
    "DeltaBase",
    "DeltaEncoding",
    "apply_to_slice",
    "check_payload",
    "payload_names",
    "payload_of",
    "rank_digests",
    "slice_of",
    "version_digests",
]
