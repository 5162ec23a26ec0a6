"""Published weight-update timings, each as a scenario `weightbus plan` predicts
(`weightbus plan --published`; docs/scale.md discusses every row)."""

import json
from dataclasses import dataclass

from weightbus.apps.capacity.forecast import Forecast, Scenario, forecast
from weightbus.apps.capacity.profiles import PROFILES
from weightbus.apps.capacity.sharding import EngineLayout
from weightbus.apps.tables import print_table

GIB = 2**30


@dataclass(frozen=True, slots=True)
class PublishedCase:
    """A published push: what ran, how long it took, where it was published, and the scenario
    that stands for it here (`assumed` says what the source does not state)."""

    key: str
    system: str
    model: str  # a preset of weightbus.apps.capacity.configs
    dtype: str
    scenario: Scenario
    published_s: float
    source: str
    assumed: str = ""


CASES = (
    PublishedCase(
        key="checkpoint-engine-qwen3-235b",
        system="checkpoint-engine broadcast, Qwen3-235B-A22B BF16, 8xH800 TP8",
        model="qwen3-235b-a22b",
        dtype="bfloat16",
        scenario=Scenario(
            engine=EngineLayout(8),
            transport="dist-broadcast",
            hardware=PROFILES["h800"],
            trainer_ranks=8,
            bucket_bytes=int(2.67 * GIB) // 256 * 256,
            cross_node=False,
            staged_from_host=True,
            stage_overlaps=False,
        ),
        published_s=6.22,
        source="https://github.com/MoonshotAI/checkpoint-engine/blob/59a3c4ffa2e14c0c26e81f62642e2d3ed68253ab/README.md#benchmark",
    ),
    PublishedCase(
        key="checkpoint-engine-kimi-k2",
        system="checkpoint-engine broadcast, Kimi-K2 FP8, 256xH20 (16 x TP16)",
        model="kimi-k2",
        dtype="fp8-block",
        scenario=Scenario(
            engine=EngineLayout(16),
            transport="dist-broadcast",
            hardware=PROFILES["h20"],
            replicas=16,
            trainer_ranks=256,
            bucket_bytes=8 * GIB,
            cross_node=True,
            staged_from_host=True,
            stage_overlaps=False,
        ),
        published_s=16.04,
        source="https://github.com/MoonshotAI/checkpoint-engine/blob/59a3c4ffa2e14c0c26e81f62642e2d3ed68253ab/README.md#benchmark",
        assumed="one 400 Gb/s NIC per GPU (H20 node NICs are not published)",
    ),
    PublishedCase(
        key="perplexity-kimi-k2",
        system="Perplexity RDMA WRITE, Kimi-K2 BF16 -> FP8, 256 training -> 128 inference GPUs",
        model="kimi-k2",
        dtype="fp8-block",
        scenario=Scenario(
            engine=EngineLayout(16),
            transport="nixl",
            hardware=PROFILES["h100"],
            replicas=8,
            trainer_ranks=256,
            cross_node=True,
        ),
        published_s=1.3,
        source="https://research.perplexity.ai/articles/weight-transfer-for-rl-post-training-in-under-2-seconds",
        assumed="8 inference replicas of 16 GPUs, H100-class GPUs with one 400 Gb/s NIC each "
        "(neither is published)",
    ),
    PublishedCase(
        key="nemo-rl-deepseek-v3",
        system="NeMo-RL NCCL-Xfer refit, DeepSeek-V3 BF16, PP16xEP16 -> TP32xDP8",
        model="deepseek-v3",
        dtype="bfloat16",
        scenario=Scenario(
            engine=EngineLayout(32),
            transport="dist-parts",
            hardware=PROFILES["h100"],
            replicas=8,
            trainer_ranks=32,
            cross_node=True,
        ),
        published_s=7.65,
        source="https://github.com/NVIDIA-NeMo/RL/pull/2413 (table: 7.65s-9.94s)",
        assumed="32 of the 256 training ranks send at once: the refit runs one NCCL group per "
        "PP stage (16 ranks each) on 2 streams (NRL_REFIT_NUM_STREAMS, docs/design-docs/"
        "nccl-reshard-refit.md); DGX-H100 (the merged PR #2971 names it, #2413 does not)",
    ),
)


def predict_case(case: PublishedCase) -> Forecast:
    return forecast(case.model, case.scenario, case.dtype)


def print_published(as_json: bool = False) -> int:
    """Predict every published case and print predicted against published."""
    results = [(case, predict_case(case)) for case in CASES]
    if as_json:
        payload = [
            {"key": c.key, "published_s": c.published_s, "source": c.source, **r.as_dict()}
            for c, r in results
        ]
        print(json.dumps(payload, indent=2))
        return 0
    rows = [
        [
            case.system,
            f"{case.published_s:.2f}",
            f"{result.timing.seconds:.2f}",
            f"{(result.timing.seconds - case.published_s) / case.published_s:+.0%}",
            result.timing.bottleneck,
        ]
        for case, result in results
    ]
    print_table(["case", "published s", "predicted s", "error", "bottleneck"], rows)
    return 0
