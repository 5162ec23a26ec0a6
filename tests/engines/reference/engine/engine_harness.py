"""Shared helpers of the engine tests: tiny HF checkpoints, greedy decoding, a served engine."""

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

from weightbus.engines.reference.engine.model_runner import ModelInput, ModelRunner
from weightbus.engines.reference.layers.attention import AttentionMetadata
from weightbus.engines.reference.layers.parallel import destroy_tp_group, init_tp_group
from weightbus.engines.reference.models.config import ModelConfig

# The MoE case's experts and layers (shared with the MoE tests)
MOE_OPTIONS = {
    "num_key_value_heads": 2,
    "num_hidden_layers": 3,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
}

# Small random models covering every architectural option the engine claims.
HF_CASES: dict[str, dict] = {
    # Llama 3 rope scaling; 1 KV head < tp 2, so KV heads are replicated
    "llama3_rope_kv1": {
        "family": "llama",
        "num_key_value_heads": 1,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    },
    # tied embeddings, q/k/v/o biases, sharded checkpoint with an index
    "llama_tied_bias_sharded": {
        "family": "llama",
        "num_key_value_heads": 2,
        "attention_bias": True,
        "tie_word_embeddings": True,
        "shard": True,
    },
    # Qwen2: q/k/v biases, untied head
    "qwen2_untied": {"family": "qwen2", "num_key_value_heads": 2},
    # Qwen2, tied head, one KV head, sharded checkpoint
    "qwen2_tied_kv1_sharded": {
        "family": "qwen2",
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
        "shard": True,
    },
    # Qwen3: q_norm / k_norm per head, q/k/v/o biases
    "qwen3_bias": {"family": "qwen3", "num_key_value_heads": 2, "attention_bias": True},
    # Qwen3-MoE: 8 experts, top 2, renormalised; layers 0 and 2 MoE, layer 1 dense
    "qwen3_moe": {"family": "qwen3_moe", **MOE_OPTIONS},
}

# An odd vocabulary exercises the padded last shard of the vocab-parallel layers.
VOCAB_SIZE = 101
PROMPT = [3, 17, 42, 99, 0, 5, 64, 23, 100, 7, 11, 58]
NUM_GREEDY_TOKENS = 12


def make_hf_model(name: str, path: Path, seed: int = 0) -> torch.nn.Module:
    """Build HF case `name` with seeded random weights and save it (safetensors) to `path`."""
    import transformers

    options = dict(HF_CASES[name])
    family = options.pop("family")
    shard = options.pop("shard", False)
    config_name, model_name = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    }[family]
    config_cls, model_cls = getattr(transformers, config_name), getattr(transformers, model_name)
    defaults = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "head_dim": 16,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    config = config_cls(**(defaults | options))
    model = model_cls(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            # norms near 1, everything else large enough that greedy choices are clear
            param.copy_(1.0 + 0.1 * noise if "norm" in param_name else 0.2 * noise)
    model.save_pretrained(path, max_shard_size="40KB" if shard else "1GB")
    return model


def fp8_block_llama() -> torch.nn.Module:
    """A float32 Llama (seed 0) whose matrices split over TP 2 on 128x128 blocks: q, k, v 128
    rows per rank, o_proj 128 columns, gate/up 256 rows, down_proj 256 columns."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def hf_reference(model: torch.nn.Module) -> tuple[torch.Tensor, list[int]]:
    """Logits of PROMPT and NUM_GREEDY_TOKENS greedy tokens from transformers."""
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = model(ids).logits[0]
        out = model.generate(
            ids,
            max_new_tokens=NUM_GREEDY_TOKENS,
            do_sample=False,
            pad_token_id=0,
            attention_mask=torch.ones_like(ids),
        )
    return logits, out[0, len(PROMPT) :].tolist()


def greedy_generate(
    runner: ModelRunner, prompt: list[int], num_tokens: int, slot: int = 0
) -> tuple[torch.Tensor, list[int]]:
    """Prefill `prompt` (logits of every position), then decode greedily with the KV cache."""
    meta = AttentionMetadata(slots=[slot], start_positions=[0], num_new_tokens=[len(prompt)])
    logits = runner.forward(ModelInput(torch.tensor(prompt), meta), all_logits=True)
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < num_tokens:
        position = len(prompt) + len(tokens) - 1
        meta = AttentionMetadata(slots=[slot], start_positions=[position], num_new_tokens=[1])
        step = runner.forward(ModelInput(torch.tensor(tokens[-1:]), meta))
        tokens.append(int(step[0].argmax()))
    return logits, tokens


def tp_rank_main(rank: int, tp_size: int, store_port: int, cases: dict, out_dir: str) -> None:
    """Body of one rank process: run every case and save its logits and greedy tokens.

    Started as `python engine_harness.py JSON_ARGS` (plain argv, nothing pickled).
    """
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp_size))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    init_tp_group(
        tp_rank=rank, tp_size=tp_size, store_host="127.0.0.1", store_port=store_port, timeout_s=60
    )
    try:
        for name, model_dir in cases.items():
            runner = ModelRunner(
                config=ModelConfig.from_hf_dir(model_dir),
                source=model_dir,
                dtype=torch.float32,
                max_num_seqs=1,
                max_model_len=64,
            )
            logits, tokens = greedy_generate(runner, PROMPT, NUM_GREEDY_TOKENS)
            save_file(
                {"logits": logits.contiguous(), "tokens": torch.tensor(tokens)},
                str(Path(out_dir) / f"{name}.rank{rank}.safetensors"),
            )
    finally:
        destroy_tp_group()


# --- a served engine, as a user starts it ---

URL_PATTERN = re.compile(r"serving on (http://\S+)")


def children_of(pid: int) -> list[int]:
    """Live (non-zombie) processes whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        state, ppid = fields[0], int(fields[1])
        if ppid == pid and state != "Z":
            found.append(int(stat.parent.name))
    return found


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class ServedEngine:
    """`weightbus serve --port 0 ...` as a subprocess; the URL is read from its stdout."""

    def __init__(
        self,
        *args: str,
        log_path: Path,
        startup_timeout_s: float = 90.0,
        prefix: tuple[str, ...] = (),
        token: str | None = None,
    ) -> None:
        # prefix: e.g. ("ip", "netns", "exec", NAME), which execs the server in place
        # --exit-with-parent: a killed test run leaves no engine behind
        cmd = [*prefix, sys.executable, "-m", "weightbus", "serve", "--port", "0"]
        cmd += ["--exit-with-parent", *args]
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log)
        self.url = self._read_url(startup_timeout_s)
        self.worker_pids = children_of(self.proc.pid)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(base_url=self.url, timeout=120.0, headers=headers)

    def _read_url(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.proc.stdout], [], [], remaining)
            if not ready:
                break
            line = self.proc.stdout.readline().decode()
            if not line:  # exited before serving
                break
            if match := URL_PATTERN.search(line):
                return match.group(1)
        self.stop()
        raise RuntimeError(f"engine did not start; log:\n{self.log_path.read_text()[-4000:]}")

    def complete(self, **body: object) -> httpx.Response:
        return self.client.post("/v1/completions", json=body)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Signal the server and wait; kill everything left after the timeout. Returns its code."""
        if hasattr(self, "client"):
            self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(timeout=10)
        for pid in getattr(self, "worker_pids", []):
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)
        self._log.close()
        return code


def started_together(starts: Iterable[Callable[[], ServedEngine]]) -> list[ServedEngine]:
    """Each `start()` at the same time, their engines in order. A start is two processes'
    imports and set-up, about 1.2 cores for 4 s: on 2 cores three engines start in ~8 s
    together, ~13 s one after the other. One that fails stops those that started.

    Raises:
        RuntimeError: an engine did not start (its log's tail).
    """
    starts = list(starts)
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    failed = [future.exception() for future in futures if future.exception() is not None]
    if failed:
        stopped_together([future.result() for future in futures if future.exception() is None])
        raise failed[0]
    return [future.result() for future in futures]


def stopped_together(engines: Iterable[ServedEngine]) -> None:
    """`ServedEngine.stop` of every engine at the same time (each waits for its own exit)."""
    engines = list(engines)
    if engines:
        with ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(lambda engine: engine.stop(), engines))


if __name__ == "__main__":
    tp_rank_main(*json.loads(sys.argv[1]))
