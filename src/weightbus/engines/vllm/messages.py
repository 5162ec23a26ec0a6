"""The messages of backend `weightbus` that cross from a trainer into vLLM's workers: the
trainer side (`target.py`, `trainer.py`) encodes them, the worker side (`worker.py`) decodes them.
"""

from typing import Any

import msgspec

from weightbus.core.wire import UpdateOrder

# Workers start every refusal with this: the model was not touched, vLLM serves what it served.
UNTOUCHED = "refused before loading; vLLM still serves its previous weights"


class VllmUpdateInfo(UpdateOrder, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`update_info` for backend `weightbus`: one whole push, as the update order's engine fields
    (`UpdateOrder.engine_fields`: the workers receive, verify and load it; `/pause` and
    `/resume` apply its pause mode) and one vLLM option.

    `skip_unchanged`: load only the blocks whose bytes differ from the last weightbus load
    (safe only while weightbus is the one writer of the weights: vLLM's own `reload_weights`
    changes them behind its back). A forced push (`force`) loads everything.
    """

    skip_unchanged: bool = False


class VllmTransportSetup(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A transport's set-up every worker runs (`dist`: join or leave the weights group):
    `request` is the transport's typed set-up request in its JSON form."""

    transport: str
    request: dict[str, Any]


class VllmDecision(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The second phase of a two-phase push or rollback: load the staged `version` (commit; its
    `fingerprint` when known) or discard it (abort, for `reason`)."""

    version: str
    fingerprint: str | None = None
    reason: str = ""


class VllmRollback(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Load the previous version again, expected to be `version` (`fingerprint`); with
    `two_phase`, stage it for a commit within `timeout_s` instead."""

    version: str
    fingerprint: str | None
    two_phase: bool = False
    timeout_s: float = 60.0


class VllmInitInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`init_info` of `/init_weight_transfer_engine` for backend `weightbus`: the backend's
    options, and at most one action.

    Attributes:
        retie_tied_heads: rebuild a tied LM head's repacked weight after each load (the fix of
            the stale-head case; off only to show what the logprob probe catches).
        keep_previous: each worker keeps two staging copies, so the version served before the
            last push stays held for a rollback (twice the staging memory); False: one copy;
            None (the default): as the last init that said.
        setup: a transport set-up to run on every worker (`Publisher.setup_transport`).
        push: a push to receive and verify, then load (or, two-phase, stage).
        commit: load the staged version.
        abort: discard the staged version.
        rollback: load (or stage) the previous version again.
    """

    retie_tied_heads: bool = True
    keep_previous: bool | None = None
    setup: VllmTransportSetup | None = None
    push: VllmUpdateInfo | None = None
    commit: VllmDecision | None = None
    abort: VllmDecision | None = None
    rollback: VllmRollback | None = None
