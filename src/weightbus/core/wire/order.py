"""The update order: one engine's part of a push, declared once.

The Publisher builds one per engine (`PushOrder`, which adds what the trainer knows and no engine
is sent); an engine target sends it (the reference engine's HTTP target posts `engine_fields()`
as the body of `POST /v1/update_weights`); the engine's HTTP edge validates that body against
this struct (its schema is generated from it) and converts it once into the rank-0 message,
which is this order with an id (`UpdateWeights`); rank 0 holds it as is while the update runs,
and every rank's Receiver reads what it needs from it. A new push option is a field here and
its use where it acts.
"""

from typing import Annotated, Any, Literal

import msgspec

from weightbus.core.wire.adapter import AdapterSpec
from weightbus.core.wire.delta import DeltaSpec
from weightbus.core.wire.messages import Hex128, PauseMode, VerifyLevel

MAX_VERSION_CHARS = 256
# An update's own bound; an engine's HTTP edge waits a little longer for its ranks' answer.
MAX_UPDATE_TIMEOUT_S = 3600.0
# printable: a version names files, log lines and metrics labels
VERSION_PATTERN = r"^[^\x00-\x1f\x7f]+$"

OrderVersion = Annotated[
    str, msgspec.Meta(min_length=1, max_length=MAX_VERSION_CHARS, pattern=VERSION_PATTERN)
]
Step = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
TimeoutS = Annotated[float, msgspec.Meta(gt=0, le=MAX_UPDATE_TIMEOUT_S)]
KeepDraft = Annotated[
    bool,
    msgspec.Meta(
        description="the push carries no draft tensors and the draft model served stays as it "
        "is (an engine with a draft refuses a push without them otherwise)"
    ),
]
AllowNonfinite = Annotated[
    bool,
    msgspec.Meta(
        description="the engine takes NaN and infinite values (else verify `full` refuses a "
        "tensor holding any, naming it)"
    ),
]

RunningKV = Annotated[
    Literal["keep", "recompute"],
    msgspec.Meta(
        description="pause_mode in_place: the running requests keep the KV cache their old "
        "version computed (`keep`, their later tokens attend to it) or recompute it on the new "
        "weights (`recompute`); no effect in the other modes, where no request runs across the "
        "swap"
    ),
]
KeepPrefixCache = Annotated[
    bool,
    msgspec.Meta(
        description="keep the engine's prefix cache across this push: new requests may then "
        "reuse KV the old weights computed (default: every cached prefix of the old weights is "
        "dropped when the new ones serve)"
    ),
]

MAX_PEERS = 1024
PeerUrl = Annotated[str, msgspec.Meta(max_length=2048, pattern=r"^https?://\S+$")]
Peers = Annotated[
    list[PeerUrl],
    msgspec.Meta(
        max_length=MAX_PEERS,
        description="two-phase: the fleet's other engines, asked whether one of them committed "
        "the version when no decision comes within `timeout_s`",
    ),
]


class UpdateOrder(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Receive `version` from the transport session `source`, and how to apply it.

    Attributes:
        version: the version's name (printable, at most 256 characters).
        step: the trainer's step, reported back by the engine.
        force: push even when the engine serves this version's fingerprint already.
        transport: the registered transport's name.
        source: the session this engine's ranks open, in its JSON form
            (`weightbus.core.transport.decode_description` gives the typed description).
        plan_hash: the plan every rank must recompute from the stream's header.
        pause_mode: how generation pauses for the swap (`drain`, `in_place`, `abort`).
        atomic: stage, verify, then swap (False: load into the live weights).
        verify: `full` checks every digest on the ranks; `none` only the fingerprint.
        timeout_s: bound of the update on the engine.
        two_phase: stage and verify only; the engine swaps on a later commit (atomic only).
        delta: the stream carries changes to the version the engine serves.
        keep_draft: the push carries no draft model (`draft.` tensors): an engine serving one
            keeps it (else it refuses such a push).
        allow_nonfinite: the engine takes NaN and infinite values (else its verify pass
            refuses a tensor holding any, naming it).
        peers: two-phase: the base URLs of the fleet's other engines. An engine that staged
            and hears no decision within `timeout_s` asks them before it discards: if one
            committed the version, it commits too (docs/fleet.md).
        adapter: the stream carries a LoRA adapter's tensors only (PEFT names), applied to
            the base the engine serves, which must be `adapter.base_fingerprint`.
        running_kv: in place: the running requests keep their KV (`keep`) or recompute it on
            the new weights (`recompute`), docs/serving.md.
        keep_prefix_cache: the engine keeps the prefix cache the old weights computed (default:
            dropped as the new weights serve), docs/serving.md.
    """

    version: OrderVersion
    step: Step | None = None
    force: bool = False
    transport: str
    source: dict[str, Any]
    plan_hash: Hex128 | None = None
    pause_mode: PauseMode = "drain"
    atomic: bool = True
    verify: VerifyLevel = "full"
    timeout_s: TimeoutS = 60.0
    two_phase: bool = False
    delta: DeltaSpec | None = None
    keep_draft: KeepDraft = False
    allow_nonfinite: AllowNonfinite = False
    peers: Peers = msgspec.field(default_factory=list)
    adapter: AdapterSpec | None = None
    running_kv: RunningKV = "keep"
    keep_prefix_cache: KeepPrefixCache = False

    def engine_fields(self) -> dict[str, Any]:
        """The order as an engine receives it, in JSON/msgpack values: this struct's fields
        only (a subclass's own fields, such as the Publisher's `PushOrder.probe`, stay home)."""
        values = msgspec.to_builtins(self)
        return {name: values[name] for name in UpdateOrder.__struct_fields__}
