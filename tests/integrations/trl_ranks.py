"""One process of a 2-process TRL run (`torchrun`, accelerate's MULTI_CPU): a
`Publisher(group=...)` on every process (accelerate's process group), `WeightbusRollouts`
given the engine to sample from; writes what it saw to `<out>/rank<r>.json`, with the largest
difference of each step's engine logprobs from transformers' on the weights TRL held then.
Arguments: MODEL_DIR (a checkpoint with its tokenizer) ENGINE_URL OUT_DIR."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from trl_harness import grpo_config, logprob_errors, run_grpo

from weightbus import Publisher
from weightbus.integrations.trl import WeightbusRollouts


def main() -> None:
    model_dir, url, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    grpo_config(out)  # sets up accelerate's process group, which the publisher joins
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    publisher = Publisher([url], transport="shm", group=dist.group.WORLD)
    rollouts = WeightbusRollouts(publisher, engines=[url], version_prefix="ranks-")
    run = run_grpo(model, model_dir, out, rollouts, per_device_train_batch_size=8)
    rollouts.close()
    pushes = [step.push for step in rollouts.steps]
    record = {
        "distributed_type": run.trainer.accelerator.distributed_type.name,
        "pushes": [
            {"version": p.version, "fingerprint": p.fingerprint, "sent_bytes": p.sent_bytes}
            for p in pushes
        ],
        "fingerprints": [run.weights.fingerprint(p.step) for p in pushes],
        "off_policy": [step.off_policy for step in rollouts.steps],
        "logprob_errors": logprob_errors(run),
    }
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    publisher.close()


if __name__ == "__main__":
    main()
