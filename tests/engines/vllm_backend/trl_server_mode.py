"""TRL's own server mode (`use_vllm=True, vllm_mode="server"`) with docs/trl-weight-transfer-
backend.patch applied: 3 GRPO steps against a vLLM server whose weight-transfer backend is
`weightbus`. Writes TRL's log to `<out>/server_mode.json` and the weights TRL held at step 2
(its last sync) to `<out>/step2.pt`. Arguments: MODEL_DIR SERVER_URL OUT_DIR VERSION_PREFIX."""

import json
import sys
from pathlib import Path

import torch
import trl
from transformers import AutoModelForCausalLM
from trl_harness import run_grpo


def main() -> None:
    model_dir, url, out, prefix = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    run = run_grpo(
        model,
        model_dir,
        out,
        None,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        vllm_weight_transfer_init_info={"transport": "shm", "version_prefix": prefix},
    )
    record = {
        "trl": trl.__file__,
        "log": run.trainer.state.log_history,
    }
    (out / "server_mode.json").write_text(json.dumps(record))
    torch.save(run.weights.by_step[2], out / "step2.pt")


if __name__ == "__main__":
    main()
