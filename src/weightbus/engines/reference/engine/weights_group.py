"""A rank's side of `/v1/init_weights_group` and `/v1/destroy_weights_group`.

Every rank starts the request at the same step boundary (`Action.WEIGHTS_GROUP`) through the
`dist` transport's rank set-up (`weightbus.core.transport.rank_setup`), in a background thread
(`GroupChange`): joining waits until the whole group formed or `timeout_s` passed, and the
engine generates meanwhile. Each step rank 0 polls (`Action.GROUP_POLL`); once every rank is
done, the outcomes (`RankResult`s) are all-gathered like an update's verdicts, so rank 0
answers once for the engine.
"""

import threading
import time

import msgspec

from weightbus.core.receiver import RankResult
from weightbus.core.transport import decode_setup_request, rank_setup
from weightbus.core.wire.messages import SliceSpec
from weightbus.engines.reference.engine import messages
from weightbus.engines.reference.models.llama import LlamaForCausalLM

_FIELDS = {
    "init": (
        "group_name",
        "master_addr",
        "master_port",
        "rank_offset",
        "world_size",
        "backend",
        "timeout_s",
    ),
    "destroy": ("group_name",),
}


def slice_specs(model: LlamaForCausalLM) -> list[SliceSpec]:
    """This rank's slice of every full tensor (its `shard_copies`, as wire data)."""
    return [
        SliceSpec(hf_name, copy.src_dim, copy.src_start, copy.length)
        for hf_name, _, copy in model.shard_copies()
    ]


def apply_weights_group(
    request: messages.WeightsGroupRequest, tp_rank: int, tp_size: int, slices: list[SliceSpec]
) -> RankResult:
    """Join or leave the group the request names; never raises, the result says what failed."""
    result = RankResult()
    fields = msgspec.structs.asdict(request)
    raw = {"action": request.action, **{name: fields[name] for name in _FIELDS[request.action]}}
    try:
        setup_request = decode_setup_request("dist", raw)
        rank_setup("dist")(setup_request, tp_rank=tp_rank, tp_size=tp_size, slices=slices)
    except TimeoutError as exc:
        result.timed_out = True
        result.fail(str(exc))
    except (OSError, ValueError, RuntimeError) as exc:
        result.fail(str(exc))
    return result


# A rank gives up on its group change this long after the request's `timeout_s`: torch's
# TCPStore client does not bound its handshake, so a store that accepts connections and never
# answers would hold the thread for ever (it is left behind, a daemon).
GROUP_GRACE_S = 5.0


class GroupChange:
    """`apply_weights_group` running in a background thread; `outcome` once it ended or gave up."""

    def __init__(
        self,
        request: messages.WeightsGroupRequest,
        tp_rank: int,
        tp_size: int,
        slices: list[SliceSpec],
    ) -> None:
        self.request = request
        self.result: RankResult | None = None
        self._deadline = time.monotonic() + request.timeout_s + GROUP_GRACE_S
        self._thread = threading.Thread(
            target=self._run, args=(tp_rank, tp_size, slices), name="weights-group", daemon=True
        )
        self._thread.start()

    def _run(self, tp_rank: int, tp_size: int, slices: list[SliceSpec]) -> None:
        self.result = apply_weights_group(self.request, tp_rank, tp_size, slices)

    def outcome(self) -> RankResult | None:
        """The result, a timed-out one once the deadline passed, or None while it runs."""
        if self.result is not None or time.monotonic() < self._deadline:
            return self.result
        given_up = RankResult()
        given_up.timed_out = True
        given_up.fail(
            f"weights group {self.request.group_name!r}: the {self.request.action} did not return "
            f"within {self.request.timeout_s + GROUP_GRACE_S:g} s (a store that never answers?)"
        )
        return given_up
