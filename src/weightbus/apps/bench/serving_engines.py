"""The engine `weightbus bench serving` drives: the reference engine (`weightbus serve`) or a
vLLM server (as `weightbus bench vllm` starts one: backend `weightbus`, scale-out routes).

What the load reads differs (`ServingEngine.api`):
- reference: `/v1/completions` with `stream: true`; every chunk names the version that
  produced its token (`weight_version`);
- vLLM: `/inference/v1/generate` with `stream: true` (token ids in, token ids out); vLLM's
  chunks carry no version, its last chunk carries the completion's version spans
  (`weight_versions`: version, start, end over the output tokens), stamped by vLLM's output
  processor with the version weightbus's backend names at each push. Each token's version is
  read from those spans, its arrival time from its chunk.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx

from weightbus.apps.launch import start_engine, stop_engines

EngineKind = Literal["reference", "vllm"]
ENGINES: tuple[EngineKind, ...] = ("reference", "vllm")


@dataclass
class ServingEngine:
    """A started engine: its URL, the route the load streams from, how to stop it."""

    kind: EngineKind
    url: str
    stop: Callable[[], None]  # stops the engine and waits for it

    @property
    def api(self) -> str:
        return "completions" if self.kind == "reference" else "generate"

    def served_version(self) -> str:
        """The weights version the engine serves now."""
        if self.kind == "reference":
            return httpx.get(f"{self.url}/v1/weights", timeout=30).json()["version"]
        return str(httpx.get(f"{self.url}/weight_info", timeout=30).json()["weight_version"])


def start_serving_engine(
    kind: EngineKind, model_dir: Path, tp: int, extra: list[str] | None = None
) -> ServingEngine:
    """Start `kind` serving `model_dir` (a bf16 Llama checkpoint) at `tp`.

    Raises:
        RuntimeError / TimeoutError: the engine did not start (its launcher says why).
    """
    if kind == "reference":
        proc, url = start_engine(str(model_dir), tp, extra=["--dtype", "bfloat16", *(extra or [])])
        return ServingEngine(kind, url, lambda: stop_engines([proc]))
    from weightbus.engines.vllm.launch import VllmServer, write_word_tokenizer

    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    write_word_tokenizer(model_dir, vocab_size)  # vLLM loads a tokenizer even for token ids
    server = VllmServer(
        model_dir, tp_size=tp, dtype="bfloat16", log_path=model_dir.parent / "vllm.log"
    )
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return ServingEngine(kind, server.url, server.stop)
