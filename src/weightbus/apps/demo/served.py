"""How the engines `weightbus demo` starts serve its `--model` (shared by the single-process
loop and `--trainer-ranks`)."""

import argparse

from weightbus.apps.demo.trainer import DEMO_MODELS
from weightbus.core.fp8 import Fp8Block
from weightbus.engines.reference.models.config import ModelConfig
from weightbus.engines.reference.models.experts import ExpertLayout


def served_config(args: argparse.Namespace) -> ModelConfig:
    """The `--model` checkpoint as the engines the demo starts serve it: a mixture-of-experts
    model expert parallel above TP 1, block FP8 with --fp8."""
    config = ModelConfig.from_hf_dict(DEMO_MODELS[args.model].hf_config().to_dict())
    config.expert_layout = ExpertLayout(expert_parallel=bool(config.num_experts) and args.tp > 1)
    config.quantization = Fp8Block() if args.fp8 else None
    return config


def print_expert_layout(args: argparse.Namespace) -> None:
    """One line naming how the engine holds a mixture-of-experts model's experts."""
    num_experts = served_config(args).num_experts
    if not num_experts:
        return
    if args.expert_parallel:
        held = f"expert parallel: {num_experts // args.tp} experts per rank"
    else:
        held = f"all {num_experts} experts on its one rank"
    print(f"engine: TP {args.tp}, {held}")
