"""What `weightbus demo` records and prints: each step, the run, the summary (shared by the
single-process loop and `--trainer-ranks`)."""

import argparse
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from weightbus.core.units import format_bytes

# Engine (TP, float32) and trainer compute the same logprobs in a different summation order;
# float32 rounding differences stay far below this, a stale or wrong weight is far above it.
LOGPROB_TOLERANCE = 1e-3


@dataclass(slots=True)
class StepRecord:
    step: int
    version: str
    reward: float
    logprob_gap: float
    rollout_tokens_per_s: float
    push_s: float
    push_bytes: int
    fingerprint: str
    fingerprint_matched: bool
    push_delta: bool = False  # the push carried changes only (`PushResult.delta`)
    push_adapter: bool = False  # --lora: the push carried the LoRA adapter alone
    # by engine, the bytes that reached each of its ranks (`PushResult.engines[i].rank_nbytes`)
    push_rank_bytes: list[list[int]] = field(default_factory=list)
    # --trainer-ranks: the bytes each trainer rank sent (`PushResult.rank_sent_bytes`)
    push_trainer_rank_bytes: list[int] = field(default_factory=list)
    changed_fraction: float | None = None  # of the elements, against the last push
    # --draft: the engine's acceptance rate over the step's rollouts, and the expected rates
    # of the draft kept in step and of the draft frozen at step 0 under the updated policy
    draft_acceptance: float | None = None
    draft_in_step: float | None = None
    draft_frozen: float | None = None


@dataclass(slots=True)
class DemoRecord:
    transport: str
    tp: int | None
    steps: list[StepRecord] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    model: str = "tiny"  # --model
    lora_rank: int | None = None  # --lora: the adapter's rank
    full_model_bytes: int | None = None  # what a whole push of the served model sends
    expert_bytes: int = 0  # of `full_model_bytes`: the experts' (a mixture-of-experts model)
    # --trainer-ranks: each rank's bytes as `weightbus plan --trainer-layout fsdp` (ep for an
    # MoE) plans a push into the engine
    planned_trainer_rank_bytes: list[int] = field(default_factory=list)


class DemoCheckError(RuntimeError):
    """A check of the demo failed (the message says which)."""


def finish(record: DemoRecord, args: argparse.Namespace) -> int:
    _summarize(record)
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(record), indent=2) + "\n")
    return 1 if record.failures else 0


def print_step(entry: StepRecord, num_steps: int, sample: str) -> None:
    print(
        f"step {entry.step:>3}/{num_steps}  reward {entry.reward:.3f}  "
        f"push {entry.push_s:.3f} s {_push_kind(entry)}  version {entry.version}  "
        f"fingerprint {'ok' if entry.fingerprint_matched else 'MISMATCH'}  "
        f"rollout {entry.rollout_tokens_per_s:.0f} tok/s  "
        f"logprob gap {entry.logprob_gap:.1e}  {_draft_text(entry)}sample {sample!r}",
        flush=True,
    )


def _draft_text(entry: StepRecord) -> str:
    """With --draft: the engine's acceptance rate, and the expected rates of both drafts."""
    if entry.draft_in_step is None:
        return ""
    measured = "-" if entry.draft_acceptance is None else f"{entry.draft_acceptance:.2f}"
    return (
        f"accepted {measured} (expected: in step {entry.draft_in_step:.2f}, "
        f"frozen {entry.draft_frozen:.2f})  "
    )


def _push_kind(entry: StepRecord) -> str:
    """`adapter`, `delta` or `whole`, with the changed share of the elements when they were
    compared."""
    if entry.push_adapter:
        return "adapter"
    kind = "delta" if entry.push_delta else "whole"
    changed = entry.changed_fraction
    return kind if changed is None else f"{kind} ({changed:.1%} changed)"


def _summarize(record: DemoRecord) -> None:
    steps = record.steps
    print("\nsummary")
    if steps:
        matched = sum(s.fingerprint_matched for s in steps)
        push_s = statistics.median(s.push_s for s in steps)
        print(
            f"  reward:         {steps[0].reward:.3f} (step 1) -> {steps[-1].reward:.3f} "
            f"(step {steps[-1].step})"
        )
        every = max(1, len(steps) // 10)
        curve = " ".join(f"{s.reward:.2f}" for s in steps[::every])
        print(f"  reward curve:   {curve} (every {every} step(s))")
        push_bytes = statistics.median(s.push_bytes for s in steps)
        print(
            f"  pushes:         {len(steps)} over {record.transport}, "
            f"median {format_bytes(push_bytes)} and {push_s:.3f} s each"
        )
        _summarize_adapter(record, push_bytes)
        _summarize_ranks(record)
        _summarize_trainer_ranks(record)
        deltas = sum(s.push_delta for s in steps)
        print(f"  deltas:         {deltas}/{len(steps)} pushes sent as changes to the last one")
        print(f"  fingerprints:   {matched}/{len(steps)} matched the trainer's")
        _summarize_draft(steps)
        print(
            f"  logprob gap:    max {max(s.logprob_gap for s in steps):.1e} "
            f"(tolerance {LOGPROB_TOLERANCE:g})"
        )
    print(f"  result:         {'FAILED: ' + record.failures[0] if record.failures else 'ok'}")


def _summarize_adapter(record: DemoRecord, push_bytes: float) -> None:
    """With --lora: the adapter's bytes per push against the whole model's."""
    if record.lora_rank is None or record.full_model_bytes is None:
        return
    print(
        f"  adapter:        rank {record.lora_rank}, {format_bytes(push_bytes)} per push; the "
        f"whole model is {format_bytes(record.full_model_bytes)} "
        f"({record.full_model_bytes / push_bytes:.1f}x the bytes)"
    )


def _summarize_ranks(record: DemoRecord) -> None:
    """The bytes each engine rank received on the last push, beside the whole model's: under
    TP a rank gets its slices, under expert parallelism only its own experts."""
    last = record.steps[-1]
    if record.full_model_bytes is None or not any(last.push_rank_bytes):
        return
    engines = [", ".join(format_bytes(n) for n in ranks) for ranks in last.push_rank_bytes]
    if len(set(engines)) == 1:
        received = engines[0] + (f" in each of {len(engines)} engines" if len(engines) > 1 else "")
    else:
        received = "; ".join(f"engine {i}: {ranks}" for i, ranks in enumerate(engines))
    model = format_bytes(record.full_model_bytes)
    if record.expert_bytes:
        model += f", {format_bytes(record.expert_bytes)} of it experts"
    print(f"  rank bytes:     {received} (last push, by rank); the whole model is {model}")


def _summarize_trainer_ranks(record: DemoRecord) -> None:
    """With --trainer-ranks: what each trainer rank sent on the last push, beside the plan."""
    sent = record.steps[-1].push_trainer_rank_bytes
    if not sent:
        return
    planned = " / ".join(format_bytes(n) for n in record.planned_trainer_rank_bytes)
    print(
        f"  trainer ranks:  sent {' / '.join(format_bytes(n) for n in sent)} (last push, by "
        f"rank, no gather); weightbus plan: {planned}"
    )


def _summarize_draft(steps: list[StepRecord]) -> None:
    drafted = [s for s in steps if s.draft_in_step is not None]
    if not drafted:
        return
    measured = [s.draft_acceptance for s in drafted if s.draft_acceptance is not None]
    engine = f"{statistics.mean(measured):.2f}" if measured else "-"
    last = drafted[-1]
    print(
        f"  draft:          accepted {engine} of the draft tokens (engine, mean over steps); "
        f"expected at step {last.step}: {last.draft_in_step:.2f} kept in step, "
        f"{last.draft_frozen:.2f} frozen at step 0"
    )
