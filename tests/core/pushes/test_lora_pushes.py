"""LoRA adapter pushes into reference engines at TP 2 and TP 1 serving adapters
(`--lora-rank 4`): a real `peft` adapter trained on the engines' base travels alone (its
`lora_A` / `lora_B` only), the engines apply it unmerged and compute what transformers + peft
compute; an adapter for another base or of another shape is refused with nothing changed, a
corrupted byte fails closed, a rollback returns the previous adapter, removing the adapter
serves the base bit for bit, and a push of the base drops the adapter. Over `shm` every push
into them (adapter or base) is written straight into each rank's parameters, its slices only
(`shm direct`; the slots when asked)."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_harness import ServedEngine
from update_harness import ByteFlippingTarget, engine_greedy, hf_greedy, weights_state

from helpers import SMALL_LLAMA as CONFIG
from weightbus import Publisher, PushError, PushResult
from weightbus.apps.capacity.shapes import model_tensors
from weightbus.apps.capacity.sharding import EngineLayout
from weightbus.apps.capacity.traffic import traffic
from weightbus.core.digest import fingerprint
from weightbus.core.finite import NonFiniteWeightsError
from weightbus.core.lora import adapter_tensors, base_weights
from weightbus.core.plan.planner import DEFAULT_BUCKET_BYTES
from weightbus.core.wire.adapter import adapter_names, served_fingerprint

pytestmark = pytest.mark.e2e  # starts `weightbus serve` (tests/conftest.py)

LOGPROB_ATOL = 1e-4  # float32 engine vs transformers + peft, as test_update_e2e.py
RANK = 4
ROW_PARALLEL = ("o_proj", "down_proj")  # the other five projections are column-parallel


def _base_model(path: Path) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norms near 1, the rest large enough that greedy choices are clear
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
    model.save_pretrained(path)
    return model


def _peft(base: torch.nn.Module, rank: int = RANK) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    return get_peft_model(copy.deepcopy(base), config).eval()


def trained(model: torch.nn.Module, seed: int, lr: float = 0.5) -> torch.nn.Module:
    """A copy of the peft `model` after one SGD step of its adapter (the base stays frozen)."""
    model = copy.deepcopy(model).train()
    ids = torch.randint(
        0, CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(seed)
    )
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    return model.eval()


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("lora-base")
    return path, _base_model(path)


def _start(path: Path, tp: str, log: Path) -> ServedEngine:
    engine = ServedEngine("--model", str(path), "--tp", tp, "--lora-rank", str(RANK), log_path=log)
    engine.base_state = weights_state(engine)  # what it serves before any adapter
    engine.base_choice = engine_greedy(engine)
    return engine


@pytest.fixture(scope="module")
def tp2(base, tmp_path_factory):
    engine = _start(base[0], "2", tmp_path_factory.mktemp("log") / "tp2.log")
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def tp1(base, tmp_path_factory):
    engine = _start(base[0], "1", tmp_path_factory.mktemp("log") / "tp1.log")
    yield engine
    engine.stop()


def assert_serves(engine: ServedEngine, model: torch.nn.Module, version: str) -> None:
    tokens, logprobs = hf_greedy(model)
    choice = engine_greedy(engine)
    assert (choice["weight_version"], choice["token_ids"]) == (version, tokens)
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(logprobs, abs=LOGPROB_ATOL)


def adapter_rank_bytes(tensors: dict[str, torch.Tensor], tp: int) -> list[int]:
    """The bytes of an adapter each rank of a TP-`tp` engine holds (docs/lora.md, vLLM's
    rule): on a column-parallel projection A whole and 1/tp of B's rows, on a row-parallel
    one 1/tp of A's columns and B whole."""
    share = 0
    for name, tensor in tensors.items():
        row_parallel = any(f".{projection}." in name for projection in ROW_PARALLEL)
        split = ("lora_A" in name) == row_parallel
        share += tensor.nbytes // tp if split else tensor.nbytes
    return [share] * tp


def assert_direct(result: PushResult, rank_bytes: list[list[int]]) -> None:
    """`result` was written straight into the engines' parameters, each rank receiving
    `rank_bytes[engine][rank]` bytes (its slices)."""
    assert result.mode == "shm direct"
    assert [engine.rank_nbytes for engine in result.engines] == rank_bytes


def base_rank_bytes(path: Path, tp: int) -> list[int]:
    """The bytes of the base checkpoint at `path` each rank of a TP-`tp` engine holds (the
    capacity planner's count, checked against the transports' in tests/apps/capacity)."""
    model = model_tensors(path, "float32")
    planned = traffic(model, EngineLayout(tp), "shm", bucket_bytes=DEFAULT_BUCKET_BYTES)
    return list(planned.receive_bytes)


def _serving(engine: ServedEngine) -> tuple[str, dict]:
    return weights_state(engine)["fingerprint"], engine_greedy(engine)


def _back_to_the_base(engines: list[ServedEngine], base_model: torch.nn.Module) -> None:
    """Serve the start checkpoint again (a test that pushed another base leaves it so)."""
    for engine in engines:
        if weights_state(engine)["base_fingerprint"] != engine.base_state["fingerprint"]:
            with Publisher([engine.url], transport="shm") as publisher:
                publisher.push(base_model, version="base", force=True)


def test_three_adapter_pushes_serve_what_peft_serves(tp2, tp1, base, tmp_path):
    """A fleet of a TP-2 and a TP-1 engine: each push two-phase, over shm, disk, nixl."""
    _, base_model = base
    _back_to_the_base([tp2, tp1], base_model)
    model = _peft(base_model)
    for i, transport in enumerate(("shm", "disk", "nixl")):
        model = trained(model, seed=i)
        version = f"adapter-{transport}"
        options = {"root": tmp_path} if transport == "disk" else None
        with Publisher([tp2.url, tp1.url], transport=transport, transport_options=options) as pub:
            base_fp = pub.fingerprint(base_weights(model))
            result = pub.push(
                model,
                version=version,
                adapter=model.peft_config["default"],
                base_fingerprint=base_fp,
            )
        tensors = adapter_tensors(model)
        assert result.two_phase
        assert result.nbytes == sum(t.nbytes for t in tensors.values())  # the adapter only
        if transport in ("shm", "nixl"):  # each rank receives its slices only
            ranks = [adapter_rank_bytes(tensors, 2), adapter_rank_bytes(tensors, 1)]
            assert [engine.rank_nbytes for engine in result.engines] == ranks
            assert result.mode == ("shm direct" if transport == "shm" else "nixl")
        with Publisher([tp2.url]) as pub:
            adapter_fp = pub.fingerprint(tensors)
        assert result.fingerprint == served_fingerprint(result.adapter, adapter_fp)
        for engine in (tp2, tp1):
            state = weights_state(engine)
            assert state["fingerprint"] == result.fingerprint
            assert state["base_fingerprint"] == base_fp == engine.base_state["fingerprint"]
            assert state["adapter"]["version"] == version
            assert state["adapter"]["fingerprint"] == adapter_fp
            assert (state["adapter"]["r"], state["adapter"]["scaling"]) == (RANK, 2.0)
            assert_serves(engine, model, version)
    full_bytes = sum(t.nbytes for t in base_weights(model).values())
    assert result.nbytes < full_bytes / 4


def test_a_rollback_returns_the_previous_adapter_and_in_place_pushes_land(tp2, base):
    _, base_model = base
    _back_to_the_base([tp2], base_model)
    first, second = trained(_peft(base_model), seed=10), trained(_peft(base_model), seed=11)
    config = first.peft_config["default"]
    with Publisher([tp2.url], transport="hf_dir") as pub:
        base_fp = pub.fingerprint(base_weights(first))
        one = pub.push(first, version="adapter-one", adapter=config, base_fingerprint=base_fp)
        pub.push(second, version="adapter-two", adapter=config, base_fingerprint=base_fp)
        assert_serves(tp2, second, "adapter-two")
        back = pub.rollback()
        assert (back.version, back.fingerprint) == ("adapter-one", one.fingerprint)
        assert weights_state(tp2)["adapter"]["version"] == "adapter-one"
        assert_serves(tp2, first, "adapter-one")
        third = trained(second, seed=12)
        pub.push(
            third, version="adapter-in-place", adapter=config, atomic=False, pause_mode="in_place"
        )
    assert_serves(tp2, third, "adapter-in-place")


def assert_adapter(engine: ServedEngine, model: torch.nn.Module, version: str) -> None:
    """`engine` applies `model`'s adapter bit for bit (its tensors' fingerprint) and serves
    what peft computes with it."""
    assert weights_state(engine)["adapter"]["fingerprint"] == fingerprint(adapter_tensors(model))
    assert_serves(engine, model, version)


def test_shm_writes_each_ranks_slices_into_its_parameters(tp2, base):
    """Adapter pushes (verify full and none, atomic and in place), the adapter's removal and a
    push of the base into a LoRA engine all go `shm direct`, each rank receiving its slices
    only, and a rollback returns the adapter before; asked for the slots, each rank reads the
    whole adapter there."""
    path, base_model = base
    _back_to_the_base([tp2], base_model)
    first = trained(_peft(base_model), seed=70)
    second, third = trained(first, seed=71), trained(first, seed=72)
    config = first.peft_config["default"]
    slices = [adapter_rank_bytes(adapter_tensors(first), 2)]
    with Publisher([tp2.url], transport="shm") as pub:
        base_fp = pub.fingerprint(base_weights(first))
        one = pub.push(first, version="direct-one", adapter=config, base_fingerprint=base_fp)
        assert_direct(one, slices)
        two = pub.push(second, version="direct-two", adapter=config, verify="none")
        assert_direct(two, slices)
        assert_adapter(tp2, second, "direct-two")
        back = pub.rollback()
        assert (back.version, back.fingerprint) == ("direct-one", one.fingerprint)
        assert_adapter(tp2, first, "direct-one")
        in_place = pub.push(
            third, version="direct-in-place", adapter=config, atomic=False, pause_mode="in_place"
        )
        assert_direct(in_place, slices)
        assert_adapter(tp2, third, "direct-in-place")
        assert_direct(pub.remove_adapter(version="direct-off"), slices)
        assert engine_greedy(tp2)["logprobs"] == tp2.base_choice["logprobs"]
        whole = pub.push(base_model, version="direct-base", force=True)
        assert_direct(whole, [base_rank_bytes(path, 2)])
    assert weights_state(tp2)["fingerprint"] == tp2.base_state["fingerprint"]
    with Publisher([tp2.url], transport="shm", transport_options={"direct": False}) as pub:
        slots = pub.push(first, version="slots-one", adapter=config, base_fingerprint=base_fp)
    assert slots.mode == "shm slots"
    adapter_bytes = sum(t.nbytes for t in adapter_tensors(first).values())
    assert slots.engines[0].rank_nbytes == [adapter_bytes, adapter_bytes]
    assert_adapter(tp2, first, "slots-one")


def test_removing_the_adapter_serves_the_base_bit_for_bit(tp2, base):
    _, base_model = base
    _back_to_the_base([tp2], base_model)
    model = trained(_peft(base_model), seed=20)
    with Publisher([tp2.url], transport="shm") as pub:
        base_fp = pub.fingerprint(base_weights(model))
        pub.push(
            model,
            version="adapter-on",
            adapter=model.peft_config["default"],
            base_fingerprint=base_fp,
        )
        assert engine_greedy(tp2)["token_ids"] != tp2.base_choice["token_ids"]
        removed = pub.remove_adapter(version="adapter-off")
    assert removed.fingerprint == base_fp
    state = weights_state(tp2)
    assert (state["fingerprint"], state["adapter"]) == (tp2.base_state["fingerprint"], None)
    choice = engine_greedy(tp2)
    assert choice["token_ids"] == tp2.base_choice["token_ids"]
    assert choice["logprobs"] == tp2.base_choice["logprobs"]  # exactly the start's
    with model.disable_adapter():
        assert_serves(tp2, model, "adapter-off")


def test_refused_adapters_change_nothing(tp2, base, engine):
    """Another base (409 naming both), another rank, NaN, an engine serving no adapters."""
    _, base_model = base
    model = trained(_peft(base_model), seed=30)
    config = model.peft_config["default"]
    before = _serving(tp2)
    state = weights_state(tp2)
    served_base, served_version = state["base_fingerprint"], state["version"]
    with Publisher([tp2.url], transport="shm") as pub:
        with pytest.raises(PushError) as refused:
            pub.push(model, version="adapter-foreign", adapter=config, base_fingerprint="a" * 32)
        assert refused.value.failures[tp2.url] == (
            f"HTTP 409: adapter base {'a' * 32} is not served here: this engine serves base "
            f"{served_base} (version {served_version!r})"
        )
        wide = trained(_peft(base_model, rank=8), seed=31)
        with pytest.raises(PushError) as refused:
            pub.push(
                wide,
                version="adapter-r8",
                adapter=wide.peft_config["default"],
                base_fingerprint=served_base,
            )
        assert refused.value.failures[tp2.url] == (
            "HTTP 409: the adapter is rank 8, alpha 8 on down_proj, gate_proj, k_proj, o_proj, "
            "q_proj, up_proj, v_proj; this engine serves adapters of rank 4 on down_proj, "
            "gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj (--lora-rank, --lora-targets)"
        )
        broken = copy.deepcopy(model)
        b_name = adapter_names(1, "up_proj")[1]
        with torch.no_grad():
            broken.state_dict()[b_name.replace("lora_B.", "lora_B.default.")][3, 1] = float("inf")
        with pytest.raises(NonFiniteWeightsError, match=f"{b_name} \\(0 NaN, 1 inf\\)"):
            pub.push(broken, version="adapter-inf", adapter=config, base_fingerprint=served_base)
    assert _serving(tp2) == before
    with Publisher([engine.url], transport="shm") as pub, pytest.raises(PushError) as refused:
        pub.push(model, version="adapter-nowhere", adapter=config, base_fingerprint="a" * 32)
    assert refused.value.failures[engine.url] == (
        "HTTP 409: this engine serves no LoRA adapters: start it with --lora-rank"
    )


CORRUPTED = adapter_names(0, "v_proj")[1]


def test_a_corrupted_adapter_byte_fails_closed(tp2, base, tmp_path):
    _, base_model = base
    model = trained(_peft(base_model), seed=40)
    before = _serving(tp2)
    target = ByteFlippingTarget(tp2.url, CORRUPTED)
    with (
        Publisher([target], transport="disk", transport_options={"root": tmp_path}) as pub,
        pytest.raises(PushError) as failed,
    ):
        pub.push(
            model,
            version="adapter-corrupted",
            adapter=model.peft_config["default"],
            base_fingerprint=weights_state(tp2)["base_fingerprint"],
        )
    assert f"digest mismatch for tensor '{CORRUPTED}'" in failed.value.failures[tp2.url]
    assert _serving(tp2) == before


def test_a_push_of_the_base_drops_the_adapter(tp2, base):
    _, base_model = base
    _back_to_the_base([tp2], base_model)
    model = trained(_peft(base_model), seed=50)
    config = model.peft_config["default"]
    new_base = copy.deepcopy(base_model)
    with torch.no_grad():
        new_base.model.norm.weight.mul_(1.5)
    with Publisher([tp2.url], transport="shm") as pub:
        old_fp = pub.fingerprint(base_model)
        pub.push(model, version="adapter-old-base", adapter=config, base_fingerprint=old_fp)
        pushed = pub.push(new_base, version="new-base")  # the Publisher's base is this one now
        state = weights_state(tp2)
        assert (state["fingerprint"], state["base_fingerprint"]) == (pushed.fingerprint,) * 2
        assert state["adapter"] is None
        assert_serves(tp2, new_base, "new-base")
        with pytest.raises(PushError, match=f"adapter base {old_fp} is not served here"):
            pub.push(model, version="adapter-stale", adapter=config, base_fingerprint=old_fp)
        on_new = pub.push(model, version="adapter-new-base", adapter=config)  # the last base
        assert on_new.adapter.base_fingerprint == pushed.fingerprint
        pub.push(new_base, version="new-base-again")  # drops the adapter again
        removed = pub.remove_adapter(version="no-adapter")  # stamped with the current base
    assert removed.fingerprint == weights_state(tp2)["fingerprint"] == pushed.fingerprint


def test_weightbus_push_sends_a_peft_adapter_directory(tp2, base, tmp_path):
    _, base_model = base
    _back_to_the_base([tp2], base_model)
    model = trained(_peft(base_model), seed=60)
    model.save_pretrained(tmp_path / "adapter")  # adapter_config.json, adapter_model.safetensors
    base_fp = weights_state(tp2)["base_fingerprint"]
    command = [
        sys.executable, "-m", "weightbus", "push", "--engine", tp2.url,
        "--from", str(tmp_path / "adapter"), "--version", "adapter-cli", "--transport", "shm",
    ]  # fmt: skip
    missing = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert missing.returncode == 1
    assert "is a peft adapter: give --base-fingerprint" in missing.stderr
    done = subprocess.run(
        [*command, "--base-fingerprint", base_fp],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["fingerprint"] == weights_state(tp2)["fingerprint"]
    assert_serves(tp2, model, "adapter-cli")
