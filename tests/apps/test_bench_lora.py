"""`weightbus bench lora`: the trainer-side merge is peft's to the bit, and the bench runs end to
end on a small model (an adapter push into a `--lora-rank` engine, the merged model pushed
whole into a plain one, merging's numeric cost)."""

import json
import subprocess
import sys

import pytest
import torch

from weightbus.apps.bench.lora import lora_config, merged_weights
from weightbus.core.lora import adapter_tensors, base_weights

ROWS = ["memcpy floor, adapter", "adapter push", "memcpy floor, model", "merge", "merged push"]


@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_benchs_merge_is_peft_merge_bit_for_bit(adapter_dtype):
    """A bf16 base with a bf16 adapter, and with the float32 adapter peft keeps by default."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    peft_model = get_peft_model(
        model,
        LoraConfig(**lora_config(4), lora_dropout=0.0),
        autocast_adapter_dtype=adapter_dtype == torch.float32,
    )
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.01)
    base = {name: tensor.clone() for name, tensor in base_weights(peft_model).items()}
    adapter = adapter_tensors(peft_model)
    assert {tensor.dtype for tensor in adapter.values()} == {adapter_dtype}
    ours = dict(merged_weights(list(base.items()), adapter, scaling=2.0))
    theirs = peft_model.merge_and_unload().state_dict()
    assert ours.keys() == theirs.keys()
    changed = [name for name, tensor in ours.items() if not torch.equal(tensor, base[name])]
    assert len(changed) == 2 * 7  # every projection of both layers
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


@pytest.mark.e2e  # starts two `weightbus serve` (through the bench)
def test_bench_lora_reports_every_row(tmp_path):
    out = tmp_path / "lora.json"
    command = [sys.executable, "-m", "weightbus", "--log-level", "WARNING", "bench", "lora"]
    command += ["--size", "8MiB", "--rank", "4", "--repeat", "1", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=280, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert [row["name"] for row in report["rows"]] == ROWS
    wire = report["bytes_pushed"]
    assert wire["adapter push"] < wire["merged push"] / 10
    # both engines offer their parameters: each push is written straight into them
    assert {push["mode"] for push in report["travel"].values()} == {"shm direct"}
    assert report["travel"]["adapter push"]["rank_bytes"] == [wire["adapter push"]]  # TP 1
    assert "adapter push / merged push: bytes" in result.stdout
    errors = report["merge_errors"]
    assert [e["update_share"] for e in errors] == [0.1, 0.01, 0.001]
    # bf16 rounds away more of a smaller update; the largest is kept within a few percent
    lost = [e["update_lost"] for e in errors]
    assert lost == sorted(lost)
    assert lost[0] < 0.05
    assert lost[-1] > 0.3
    for e in errors:
        assert 0 < e["unmerged_bf16"] < 0.1
        assert 0 < e["merged_bf16"] < 0.1
