"""A rank's side of `/v1/init_weights_group` and `/v1/destroy_weights_group`.

Every rank applies the request at the same step boundary (`Action.WEIGHTS_GROUP`); joining
blocks until the whole group formed or `timeout_s` passed. The outcome is a `RankResult`, which
the worker all-gathers like an update's verdicts, so rank 0 answers once for the engine.
"""

from weightbus.engine import messages
from weightbus.models.llama import LlamaForCausalLM
from weightbus.receiver import RankResult
from weightbus.transport.dist_group import destroy_group, join_group
from weightbus.wire.messages import RankLayout, SliceSpec


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
    try:
        if request.action == "destroy":
            destroy_group(request.group_name)
            return result
        group_rank = request.rank_offset + tp_rank
        join_group(
            name=request.group_name,
            master_addr=request.master_addr,
            master_port=request.master_port,
            group_rank=group_rank,
            world_size=request.world_size,
            timeout_s=request.timeout_s,
            layout=RankLayout(
                group_rank=group_rank, tp_rank=tp_rank, tp_size=tp_size, slices=slices
            ),
        )
    except TimeoutError as exc:
        result.timed_out = True
        result.fail(str(exc))
    except (OSError, ValueError, RuntimeError) as exc:
        result.fail(str(exc))
    return result
