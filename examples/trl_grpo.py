"""GRPO with Hugging Face TRL, generating with a weightbus-fed engine (docs/trl.md).

The demo's task (a tiny Llama learns to write digits): TRL's `GRPOTrainer` trains the policy,
and `WeightbusRollouts` pushes it into a `weightbus serve` engine whenever TRL's step changed,
then samples the step's completions there. Every completion must come from the policy of its
step (`off_policy="raise"`); at the end the engine serves the trained policy's fingerprint.

    python examples/trl_grpo.py --steps 30 --transport shm --json trl.json
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

from weightbus import Publisher
from weightbus.apps.demo.task import prompts, reward
from weightbus.apps.demo.trainer import hf_llama_config
from weightbus.apps.launch import start_engine, stop_engine
from weightbus.engines.reference.models.config import tiny_config
from weightbus.engines.vllm.launch import write_word_tokenizer
from weightbus.integrations.trl import WeightbusRollouts

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL


def digits(completion_ids: list[list[int]], **_: object) -> list[float]:
    """TRL reward function: the fraction of each completion's tokens that are digits."""
    return [reward(ids) for ids in completion_ids]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="GRPO steps")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per completion")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate")
    parser.add_argument("--tp", type=int, default=2, help="the engine's TP size")
    parser.add_argument(
        "--transport", default="shm", choices=["shm", "disk"], help="weightbus transport"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the run's record here")
    return parser.parse_args()


def grpo_config(args: argparse.Namespace, output_dir: str) -> GRPOConfig:
    return GRPOConfig(
        output_dir=output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.prompts * args.samples,
        num_generations=args.samples,
        max_completion_length=args.max_tokens,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,  # TRL's default autocasts to bf16 (on CPU too); the engine serves float32
        seed=args.seed,
        disable_tqdm=True,
    )


def train(args: argparse.Namespace, model_dir: Path, url: str) -> dict:
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    texts = [" ".join(f"w{t}" for t in ids) for ids in prompts(args.prompts)]
    with Publisher([url], transport=args.transport) as publisher:
        rollouts = WeightbusRollouts(publisher, off_policy="raise", seed=args.seed)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=digits,
            args=grpo_config(args, str(model_dir / "out")),
            train_dataset=Dataset.from_dict({"prompt": texts}),
            processing_class=tokenizer,
            rollout_func=rollouts,
        )
        trainer.train()
        rollouts.sync(trainer)  # the last step's weights
        rollouts.close()
        served = publisher.engine_weights()[0]
        rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
        return {
            "steps": [
                {
                    "step": s.step,
                    "version": s.policy_version,
                    "push_s": s.push.push_s if s.push else None,
                    "fingerprint": s.push.fingerprint if s.push else None,
                    "versions": dict(s.versions),
                    "off_policy": s.off_policy,
                    "reward": reward_,
                }
                for s, reward_ in zip(rollouts.steps, rewards, strict=True)
            ],
            "served": {"version": served.version, "fingerprint": served.fingerprint},
            "trained_fingerprint": publisher.fingerprint(model),
        }


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        LlamaForCausalLM(hf_llama_config(tiny_config())).float().save_pretrained(model_dir)
        write_word_tokenizer(model_dir, tiny_config().vocab_size)
        proc, url = start_engine(str(model_dir), args.tp)
        start = time.perf_counter()
        try:
            record = train(args, model_dir, url)
        finally:
            stop_engine(proc)
    record["seconds"] = time.perf_counter() - start
    for row in record["steps"]:
        push = f"{row['push_s'] * 1e3:7.1f} ms" if row["push_s"] is not None else "      -"
        reward_ = row["reward"]
        print(f"step {row['step']:3d}  {row['version']:>9}  push {push}  reward {reward_:.3f}")
    same = record["served"]["fingerprint"] == record["trained_fingerprint"]
    print(f"engine serves {record['served']['version']}: trained weights {'yes' if same else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
