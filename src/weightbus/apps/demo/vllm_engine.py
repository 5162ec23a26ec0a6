"""`weightbus demo --engine vllm`: the same RL loop with a vLLM server generating.

vLLM serves the trainer's checkpoint (float32, so its logprobs match the trainer's to ~1e-5)
with backend `weightbus`; every step is pushed through `VllmEngineTarget` with a logprob probe.
vLLM-CPU's attention needs head_dim 64 (the reference engine's `tiny` uses 32), and
`/v1/completions` needs a tokenizer in the directory even for token-id prompts.
"""

import dataclasses
from pathlib import Path

from weightbus.apps.demo.rollout import RolloutClient
from weightbus.apps.demo.task import Rollout
from weightbus.apps.demo.trainer import Trainer
from weightbus.engines.reference.models.config import ModelConfig, tiny_config
from weightbus.engines.vllm.launch import VllmServer, write_word_tokenizer


def vllm_demo_config() -> ModelConfig:
    """The demo's `tiny` Llama with 4 heads of 64 (vLLM-CPU rejects head_dim 32 and below)."""
    return dataclasses.replace(
        tiny_config(), num_attention_heads=4, num_key_value_heads=2, head_dim=64
    )


def start_vllm(trainer: Trainer, directory: Path, tp_size: int) -> VllmServer:
    """Save the trainer's checkpoint (with a tokenizer) and serve it with vLLM."""
    model_dir = directory / "model"
    trainer.save(model_dir)
    write_word_tokenizer(model_dir, trainer.model.config.vocab_size)
    server = VllmServer(
        model_dir, tp_size=tp_size, dtype="float32", log_path=directory / "vllm.log"
    )
    try:
        server.wait_ready()
    except (RuntimeError, TimeoutError):
        server.stop()
        raise
    return server


class VllmRolloutClient(RolloutClient):
    """Rollouts from vLLM's `/v1/completions`: it does not stamp completions with a version,
    so each one carries the version `/weight_info` reports (pushes happen between rollouts)."""

    def __init__(self, url: str, model: str, **options: object) -> None:
        super().__init__(url, **options)
        self.model = model
        self._version = ""

    def sample(self, prompts: list[list[int]], group_size: int, seed: int) -> list[Rollout]:
        self._version = self.weights()["version"]
        return super().sample(prompts, group_size, seed)

    def _request_body(self, prompt: list[int], seed: int) -> dict:
        return {
            **super()._request_body(prompt, seed),
            "model": self.model,
            "return_token_ids": True,
        }

    def _version_of(self, choice: dict) -> str:
        return self._version

    def weights(self) -> dict:
        """The version vLLM serves (`/weight_info`); it cannot report a fingerprint."""
        response = self._http.get("/weight_info")
        response.raise_for_status()
        return {"version": response.json()["weight_version"], "fingerprint": None}
