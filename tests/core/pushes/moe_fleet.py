"""The tiny Qwen3-MoE of the MoE push tests: its engines' layouts, prompt and seeds
(test_moe_pushes.py, test_moe_trainer_ranks.py; fixtures `hf_moe` and `moe_engines` in
conftest.py)."""

import torch
from engine_harness import VOCAB_SIZE

# name -> serve flags: the layouts of the experts the issue names
LAYOUTS = {
    "tp1": ("--tp", "1"),
    "tp2": ("--tp", "2"),
    "ep2": ("--tp", "2", "--expert-parallel"),
    "ep2_redundant": ("--tp", "2", "--expert-parallel", "--redundant-experts", "2"),
}
NUM_EXPERTS = 8
SEEDS = (1, 2, 3, 4)  # the trained versions pushed here
# 40 tokens, drawn with a seed chosen so that both copies of each replicated expert get prompt
# tokens in every MoE layer of every version pushed (checked in test_moe_pushes.py)
LONG_PROMPT = torch.randint(
    0, VOCAB_SIZE, (40,), generator=torch.Generator().manual_seed(5)
).tolist()
