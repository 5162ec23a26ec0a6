"""Mixture-of-experts pushes into real engines: a tiny Qwen3-MoE served at TP 1, TP 2 (each
expert's intermediate dimension split), EP 2 (whole experts per rank) and EP 2 with 2
redundant slots, pushed trained versions over `shm`, `nixl` and `dist`.

After each push every engine's greedy tokens and their logprobs are transformers' on the
pushed weights. Trainers push transformers 5's state dict (fused 3-D expert tensors) or the
checkpoint's per-expert tensors: one fingerprint. Each engine rank receives exactly the bytes
`weightbus plan` gives it: an expert-parallel rank only its experts (and each copy of a
replicated expert, so no replica is left stale: the prompt routes tokens to both copies).
Deltas, probes, a two-phase fleet and its rollback work as for dense models, and block-FP8
pushes place each expert's scales with it.
"""

import json
import re
from pathlib import Path

import pytest
import torch
from engine_harness import ServedEngine
from moe_fleet import LAYOUTS, LONG_PROMPT, NUM_EXPERTS, SEEDS
from safetensors.torch import save_file
from update_harness import engine_greedy, hf_greedy, trained_copy

from weightbus import Publisher
from weightbus.apps.capacity.shapes import ModelTensors
from weightbus.apps.capacity.sharding import EngineLayout
from weightbus.apps.capacity.traffic import traffic
from weightbus.core.checkpoint import iter_safetensors
from weightbus.core.digest import fingerprint
from weightbus.core.fp8 import Fp8Block, quantize_weights
from weightbus.core.meta import metas_of
from weightbus.core.plan.planner import DEFAULT_BUCKET_BYTES
from weightbus.core.publisher.probe import LogprobProbe
from weightbus.core.publisher.targets import HttpEngineTarget
from weightbus.core.weights import normalize_weights
from weightbus.engines.reference.models.experts import linear_placement

pytestmark = pytest.mark.e2e

LOGPROB_ATOL = 1e-4


def _assert_serves(moe_engines: dict[str, ServedEngine], model: torch.nn.Module) -> None:
    tokens, logprobs = hf_greedy(model, LONG_PROMPT)
    for name, engine in moe_engines.items():
        choice = engine_greedy(engine, LONG_PROMPT)
        assert choice["token_ids"] == tokens, name
        got = choice["logprobs"]["token_logprobs"]
        assert got == pytest.approx(logprobs, abs=LOGPROB_ATOL), name


def _expert_bytes_planned(model: torch.nn.Module, redundant: int) -> list[int]:
    """`weightbus plan`'s bytes per rank of an EP 2 engine (shm direct) for `model`'s push."""
    pushed = normalize_weights(model)
    config = model.config.to_dict()
    tensors = ModelTensors("tiny qwen3-moe", tuple(metas_of(pushed)), config)
    layout = EngineLayout(2, 2, "linear", redundant)
    return list(traffic(tensors, layout, "shm", bucket_bytes=DEFAULT_BUCKET_BYTES).receive_bytes)


def test_state_dicts_fused_and_per_expert_have_the_checkpoints_fingerprint(hf_moe: tuple) -> None:
    path, model = hf_moe
    assert any(name.endswith("experts.gate_up_proj") for name in model.state_dict())
    checkpoint = dict(iter_safetensors(str(path)))
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in checkpoint
    assert fingerprint(model) == fingerprint(checkpoint) == fingerprint(model.state_dict())


def test_the_prompt_routes_tokens_to_both_copies_of_each_replicated_expert(hf_moe: tuple) -> None:
    """The precondition of the stale-replica check: token i takes copy i % 2 of an expert held
    twice, so both copies serve tokens of the prompt, in every MoE layer, for every version
    pushed here; a stale copy would change the logprobs the pushes compare."""
    _, model = hf_moe
    expert_map = linear_placement(NUM_EXPERTS, 2, 2)
    replicated = [e for e in range(NUM_EXPERTS) if len(expert_map.replicas(e)) > 1]
    assert replicated
    for seed in SEEDS:
        parities = _routed_parities(trained_copy(model, seed=seed), LONG_PROMPT)
        layers = {layer for layer, _ in parities}
        missing = [(i, e) for i in layers for e in replicated if parities.get((i, e)) != {0, 1}]
        assert not missing, f"seed {seed}: copies without prompt tokens (layer, expert): {missing}"


def _routed_parities(model: torch.nn.Module, prompt: list[int]) -> dict[tuple[int, int], set]:
    """(MoE layer, expert) -> parities of the prompt tokens the router sends to it."""
    parities: dict[tuple[int, int], set[int]] = {}

    def record(layer: int, out: tuple) -> None:
        for token, ids in enumerate(out[2].tolist()):  # the router's top-k experts
            for expert in ids:
                parities.setdefault((layer, expert), set()).add(token % 2)

    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _a, out, i=i: record(i, out))
        for i, layer in enumerate(model.model.layers)
        if hasattr(layer.mlp, "gate")
    ]
    with torch.no_grad():
        model(torch.tensor([prompt]))
    for hook in hooks:
        hook.remove()
    return parities


@pytest.mark.parametrize("transport", ["shm", "nixl", "dist"])
def test_trained_versions_serve_like_transformers_under_every_layout(
    moe_engines: dict[str, ServedEngine], hf_moe: tuple, transport: str
) -> None:
    _, model = hf_moe
    trained = trained_copy(model, seed=SEEDS[("shm", "nixl", "dist").index(transport)])
    urls = [engine.url for engine in moe_engines.values()]
    with Publisher(urls, transport=transport, timeout_s=120) as publisher:
        if transport == "dist":
            publisher.init_weights_group("127.0.0.1", timeout_s=60)
        result = publisher.push(trained, version=f"moe-{transport}-{id(trained)}", force=True)
    assert result.fingerprint == fingerprint(trained)
    _assert_serves(moe_engines, trained)
    if transport != "shm":
        return
    # each EP rank received its experts (each copy of a replicated one) and its dense share
    by_url = {engine.url: name for name, engine in moe_engines.items()}
    got = {by_url[e.url]: e.rank_nbytes for e in result.engines}
    assert got["ep2"] == _expert_bytes_planned(trained, 0)
    assert got["ep2_redundant"] == _expert_bytes_planned(trained, 2)
    assert max(got["ep2"]) < result.nbytes * 0.6  # not every expert to every rank


def test_deltas_probes_and_a_fleet_rollback_work_for_moe(
    moe_engines: dict[str, ServedEngine], hf_moe: tuple
) -> None:
    _, model = hf_moe
    first, second = trained_copy(model, seed=SEEDS[3]), trained_copy(model, seed=SEEDS[3])
    with torch.no_grad():  # a small step: a few elements of one expert and the router
        second.model.layers[0].mlp.experts.gate_up_proj[5, :3] += 0.25
        second.model.layers[2].mlp.gate.weight[1, :4] -= 0.125
    urls = [engine.url for engine in moe_engines.values()]
    with Publisher(urls, transport="shm", delta="always", timeout_s=120) as publisher:
        publisher.push(first, version=f"moe-base-{id(first)}", force=True)
        probe = LogprobProbe.of_model(second, LONG_PROMPT, LOGPROB_ATOL * 10)
        result = publisher.push(second, version=f"moe-delta-{id(second)}", probe=probe)
        assert result.delta.sent, result.delta.reason
        assert result.two_phase
        _assert_serves(moe_engines, second)
        publisher.rollback()
    _assert_serves(moe_engines, first)


def test_block_fp8_experts_and_their_scales_reach_their_slots(
    hf_moe: tuple, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """An FP8 checkpoint (16x16 blocks: TP 2 splits attention on block edges) served at EP 2
    with 2 redundant slots; pushes quantized in the publisher, each expert's scales landing in
    its slots: the engine's teacher-forced logprobs are transformers' on the quantize-
    dequantized weights (what the probe checks, or the push is rolled back)."""
    path, model = hf_moe
    block = Fp8Block(16, 16)
    fp8_dir = tmp_path_factory.mktemp("fp8")
    save_file(
        dict(quantize_weights(iter_safetensors(str(path)), block)),
        str(fp8_dir / "model.safetensors"),
    )
    config = json.loads((path / "config.json").read_text())
    (fp8_dir / "config.json").write_text(
        json.dumps(config | {"quantization_config": block.hf_config()})
    )
    flags = LAYOUTS["ep2_redundant"]
    log_path = tmp_path_factory.mktemp("log") / "fp8.log"
    engine = ServedEngine("--model", str(fp8_dir), *flags, log_path=log_path)
    target = HttpEngineTarget(engine.url)
    try:
        for transport, seed in (("shm", SEEDS[0]), ("nixl", SEEDS[1])):
            trained = trained_copy(model, seed=seed)
            probe = LogprobProbe.of_quantized_model(trained, LONG_PROMPT, block)
            with Publisher([engine.url], transport=transport, quantize=block) as publisher:
                publisher.push(trained, version=f"moe-fp8-{transport}", probe=probe)
            assert target.score(LONG_PROMPT) == pytest.approx(probe.logprobs, abs=LOGPROB_ATOL)
    finally:
        target.close()
        engine.stop()


def test_the_moe_quickstart_runs_as_written(moe_engines: dict[str, ServedEngine], hf_moe: tuple):
    """docs/moe.md's push block, as written, into the shared EP-2 engine of its checkpoint: the
    engine serves the last version, and each rank received its experts, not all of them."""
    path, _ = hf_moe
    page = (Path(__file__).parents[3] / "docs" / "moe.md").read_text()
    section = page.split("## Serving an MoE")[1].split("\n## ")[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    engine = moe_engines["ep2"]
    code = code.replace("http://127.0.0.1:8000", engine.url)
    code = code.replace('"./qwen3-moe"', repr(str(path)))
    scope: dict = {}
    exec(compile(code, "docs/moe.md", "exec"), scope)
    result = scope["result"]
    assert engine.client.get("/v1/weights").json()["version"] == result.version == "moe-step-2"
    assert max(result.engines[0].rank_nbytes) < result.nbytes * 0.6
    assert result.fingerprint == fingerprint(scope["model"])
