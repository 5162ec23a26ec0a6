"""A rank's side of `/v1/init_weights_group` and `/v1/destroy_weights_group`.

Every rank applies the request at the same step boundary (`Action.WEIGHTS_GROUP`) through the
`dist` transport's rank set-up (`weightbus.transport.rank_setup`); joining blocks until the
whole group formed or `timeout_s` passed. The outcome is a `RankResult`, which the worker
all-gathers like an update's verdicts, so rank 0 answers once for the engine.
"""

import msgspec

from weightbus.engine import messages
from weightbus.models.llama import LlamaForCausalLM
from weightbus.receiver import RankResult
from weightbus.transport import decode_setup_request, rank_setup
from weightbus.wire.messages import SliceSpec

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
