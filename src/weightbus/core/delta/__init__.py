"""Delta pushes: a version sent as its changes to the version the engines already serve.

Publisher side: `RankBase` (what each trainer rank held of the last version pushed) and its
`encode`, `encode_cells`.
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
    CellChanges,
    RankBase,
    encode_cells,
    slice_of,
)

__all__ = [
    "PAYLOAD_PREFIX",
    "CellChanges",
    "RankBase",
    "apply_to_slice",
    "check_payload",
    "encode_cells",
    "payload_names",
    "payload_of",
    "slice_of",
]
