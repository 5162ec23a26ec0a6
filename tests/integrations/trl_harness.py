"""Real TRL `GRPOTrainer` runs for the `weightbus.integrations.trl` tests: the vLLM tests' tiny
Qwen2 (`qwen2_tied`, word-level tokenizer), a reward that depends on the tokens, and a record of
the weights TRL held at every step and of every rollout TRL received."""

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerFast, TrainerCallback

from weightbus.core.digest import fingerprint
from weightbus.core.publisher import normalize_weights
from weightbus.core.publisher.probe import LogprobProbe

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL

PROMPTS = [[5 + i, 17, 99] for i in range(4)]
NUM_GENERATIONS = 4
MAX_TOKENS = 8
# float32 on both sides; the engines' kernels sum in another order than transformers'
LOGPROB_ATOL = 1e-3


def even_tokens(completion_ids: list[list[int]], **_: object) -> list[float]:
    """The reward: the share of even token ids (a GRPO group rarely scores all alike, so every
    step changes the weights)."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def prompt_dataset() -> Dataset:
    """The prompts as text the word-level tokenizer maps back to `PROMPTS`."""
    return Dataset.from_dict({"prompt": [" ".join(f"w{t}" for t in ids) for ids in PROMPTS]})


class StepWeights(TrainerCallback):
    """Copies of the weights TRL holds before training and after every optimizer step, keyed
    by TRL's global step (the weights a push at that step must carry). With `peft_config`, TRL
    wraps `model` in a peft model (the adapter's layers go into `model` itself)."""

    def __init__(self, model: torch.nn.Module, peft_config: Any = None) -> None:
        self.model = model
        self.peft_config = peft_config
        # accelerate wraps the forward of the model TRL trains (autocast, outputs to fp32): a
        # copy of that model keeps the wrapper
        self._untouched = copy.deepcopy(model).eval()
        self.by_step: dict[int, dict[str, torch.Tensor]] = {}

    def _copy(self, step: int) -> None:
        self.by_step[step] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self._copy(state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self._copy(state.global_step)

    def fingerprint(self, step: int) -> str:
        return fingerprint(normalize_weights(self.by_step[step]))

    def model_at(self, step: int) -> torch.nn.Module:
        model = copy.deepcopy(self._untouched)
        if self.peft_config is None:
            model.load_state_dict(self.by_step[step])
            return model
        from peft import get_peft_model

        peft_model = get_peft_model(model, self.peft_config)
        peft_model.base_model.model.load_state_dict(self.by_step[step])
        return peft_model.eval()


@dataclass
class GrpoRun:
    """What a run left: the trainer, the weights at each step, every rollout TRL received."""

    trainer: Any
    weights: StepWeights
    outputs: list[tuple[int, dict]] = field(default_factory=list)


def grpo_config(output_dir: Path, max_steps: int = 3, **options: Any) -> Any:
    from trl import GRPOConfig

    settings = {
        "per_device_train_batch_size": len(PROMPTS) * NUM_GENERATIONS,
        "num_generations": NUM_GENERATIONS,
        "max_completion_length": MAX_TOKENS,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "bf16": False,  # TRL's default autocasts to bf16, on CPU too; the engines run float32
        "disable_tqdm": True,
        **options,
    }
    return GRPOConfig(output_dir=str(output_dir), max_steps=max_steps, **settings)


def run_grpo(
    model: torch.nn.Module,
    model_dir: Path,
    output_dir: Path,
    rollout_func: Any,
    peft_config: Any = None,
    **options: Any,
) -> GrpoRun:
    """Train `model` with TRL's GRPOTrainer (`rollout_func` None: TRL's own generation; with
    `peft_config`, a LoRA adapter on the frozen `model`)."""
    from trl import GRPOTrainer

    weights = StepWeights(model, peft_config)
    run = GrpoRun(trainer=None, weights=weights)

    def recorded(prompts: list, trainer: Any) -> dict:
        out = rollout_func(prompts, trainer)
        run.outputs.append((trainer.state.global_step, out))
        return out

    max_steps = options.pop("max_steps", 3)
    run.trainer = GRPOTrainer(
        model=model,
        reward_funcs=even_tokens,
        args=grpo_config(output_dir, max_steps, **options),
        train_dataset=prompt_dataset(),
        processing_class=PreTrainedTokenizerFast.from_pretrained(model_dir),
        rollout_func=recorded if rollout_func is not None else None,
        callbacks=[weights],
        peft_config=peft_config,
    )
    run.trainer.train()
    return run


def hf_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> list[float]:
    """transformers' logprob of each completion token after the prompt and those before it
    (the Publisher's probe of the whole sequence, from the first completion token on)."""
    probe = LogprobProbe.of_model(model, prompt + completion, tolerance=LOGPROB_ATOL)
    return list(probe.logprobs[len(prompt) - 1 :])


def logprob_errors(run: GrpoRun) -> list[float]:
    """By rollout (TRL's steps in order), the largest difference between the engine's logprob
    of a sampled token and transformers' on the weights TRL held at that step."""
    errors = []
    for step, out in run.outputs:
        model = run.weights.model_at(step)
        errors.append(
            max(
                float((torch.tensor(engine) - torch.tensor(hf_logprobs(model, p, c))).abs().max())
                for p, c, engine in zip(
                    out["prompt_ids"], out["completion_ids"], out["logprobs"], strict=True
                )
            )
        )
    return errors


def check_rollouts_came_from_their_step(run: GrpoRun, version_prefix: str) -> None:
    """Every completion's version is its step's, and the engine's logprob of every sampled
    token is transformers' on the weights TRL held at that step."""
    assert [step for step, _ in run.outputs] == list(range(len(run.outputs)))
    for step, out in run.outputs:
        assert set(out["weight_version"]) == {f"{version_prefix}{step}"}
        model = run.weights.model_at(step)
        for prompt, completion, engine in zip(
            out["prompt_ids"], out["completion_ids"], out["logprobs"], strict=True
        ):
            expected = hf_logprobs(model, prompt, completion)
            assert torch.allclose(
                torch.tensor(engine), torch.tensor(expected), atol=LOGPROB_ATOL, rtol=0
            ), (step, engine, expected)
