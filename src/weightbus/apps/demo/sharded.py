"""`weightbus demo --trainer-ranks N`: the RL loop with an FSDP2 trainer on N processes.

The demo process starts the engine from the trainer's initial checkpoint and N trainer
processes (one gloo group). Every rank builds the same `transformers` model (`--model`), shards
it with FSDP2's `fully_shard` on a CPU mesh, and runs every step: rank 0 samples the rollouts
from the engine and hands them to the others over the group (msgpack, no pickle); every rank
takes the same update (FSDP2 all-gathers the parameters for its forward and reduce-scatters
the gradients); then every rank pushes its own shards with a `Publisher` on the group, no
gather. A Qwen3-MoE's fused expert tensors are cut by expert, so each rank holds and sends
whole experts (expert parallel), into an engine at TP N with `--expert-parallel`. Rank 0 checks
the engine's version and fingerprint, prints the step with what each trainer rank sent (beside
`weightbus plan`'s figure) and each engine rank received, and writes the run's record for the
demo process to summarize.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from weightbus.apps.demo.served import print_expert_layout
from weightbus.apps.demo.task import Rollout, prompts, render
from weightbus.apps.demo.trainer import DEMO_MODELS, Trainer
from weightbus.apps.launch import run_rank_processes, start_engine, stop_engine
from weightbus.core.units import format_bytes

_RECORD = "record.json"
_STEP_TIMEOUT_S = 600.0  # bound of one step's collectives on the trainer group


def run_sharded(args: argparse.Namespace) -> int:
    """The demo process: engine, trainer ranks, summary."""
    from weightbus.apps.demo.records import DemoRecord, StepRecord, finish

    with tempfile.TemporaryDirectory(prefix="weightbus-demo-") as tmp:
        Trainer(DEMO_MODELS[args.model].hf_config(), seed=args.seed, lr=args.lr).save(
            Path(tmp) / "model"
        )
        extra = ["--expert-parallel"] if args.expert_parallel else []
        print(
            f"starting an engine: weightbus serve --model <trainer's HF dir> --tp {args.tp}"
            f"{''.join(f' {flag}' for flag in extra)}; {args.trainer_ranks} trainer processes "
            "(FSDP2, gloo CPU mesh)"
        )
        print_expert_layout(args)
        proc, url = start_engine(str(Path(tmp) / "model"), args.tp, extra=extra)
        try:
            codes = _run_ranks(args, url, Path(tmp))
        finally:
            stop_engine(proc)
        path = Path(tmp) / _RECORD
        if not path.exists():
            record = DemoRecord(transport="shm", tp=args.tp, model=args.model)
            record.failures.append(f"trainer rank 0 exited with {codes[0]} before its record")
        else:
            raw = json.loads(path.read_text())
            steps = [StepRecord(**step) for step in raw.pop("steps")]
            record = DemoRecord(**raw, steps=steps)
        if any(codes) and not record.failures:
            record.failures.append(f"trainer ranks exited with {codes}")
    return finish(record, args)


# the trainer ranks of one demo run, stopped after this long (a demo of a few minutes at most)
RANKS_TIMEOUT_S = 3600.0


def _run_ranks(args: argparse.Namespace, url: str, directory: Path) -> list[int]:
    payload = json.dumps({**vars(args), "handler": None, "url": url, "out": str(directory)})
    return run_rank_processes(
        "weightbus.apps.demo.sharded", payload, args.trainer_ranks, RANKS_TIMEOUT_S
    )


class _Round(msgspec.Struct, frozen=True):
    """Rank 0's word at the start of a step: the rollouts, or stop (and why)."""

    rollouts: list[Rollout]
    stop: str = ""


def _broadcast(round_: _Round | None) -> _Round:
    """Rank 0's `round_` on every rank (length, then bytes, on the trainer group)."""
    timeout = timedelta(seconds=_STEP_TIMEOUT_S)
    data = msgspec.msgpack.encode(round_) if round_ is not None else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=0, async_op=True).wait(timeout)
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
    if buffer is None:
        buffer = torch.empty(int(size[0]), dtype=torch.uint8)
    dist.broadcast(buffer, src=0, async_op=True).wait(timeout)
    return msgspec.msgpack.decode(buffer.numpy().tobytes(), type=_Round)


class _RankLoop:
    """One trainer rank's RL loop (rank 0 also talks to the engine and keeps the record)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from weightbus.apps.demo.records import DemoRecord
        from weightbus.apps.demo.rollout import RolloutClient
        from weightbus.core.digest import fingerprint
        from weightbus.core.publisher import Publisher

        self.args = args
        self.rank = dist.get_rank()
        self.trainer = Trainer(DEMO_MODELS[args.model].hf_config(), seed=args.seed, lr=args.lr)
        state = self.trainer.model.state_dict()
        self.initial_fingerprint = fingerprint(state.items())
        self.record = DemoRecord(
            transport="shm", tp=args.tp, model=args.model,
            full_model_bytes=sum(t.nbytes for t in state.values()),
            expert_bytes=sum(t.nbytes for name, t in state.items() if ".experts." in name),
            planned_trainer_rank_bytes=planned_sends(self.trainer.model, args),
        )  # fmt: skip
        del state
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in self.trainer.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.trainer.model, mesh=mesh)
        # fully_shard swapped the parameters for DTensors: the optimizer steps those
        self.trainer.optimizer = torch.optim.Adam(self.trainer.model.parameters(), lr=args.lr)
        self.publisher = Publisher(
            [args.url], group=dist.group.WORLD, transport="shm", timeout_s=120
        )
        self.client = None
        if self.rank == 0:
            self.client = RolloutClient(
                args.url, max_tokens=args.max_tokens, temperature=args.temperature
            )

    def run(self) -> None:
        from weightbus.apps.demo.records import DemoCheckError

        version = self._initial_version()
        for step in range(1, self.args.steps + 1):
            round_ = _broadcast(self._rollouts(step, version) if self.rank == 0 else None)
            if round_.stop:
                break
            try:
                version = self._step(step, round_.rollouts)
            except (DemoCheckError, RuntimeError, ConnectionError, ValueError) as exc:
                self.record.failures.append(str(exc))
                if self.rank == 0:
                    print(f"FAILED: {exc}", flush=True)
                break
        if self.rank == 0:
            (Path(self.args.out) / _RECORD).write_text(json.dumps(asdict(self.record)))

    def _initial_version(self) -> str:
        if self.client is None:
            return ""
        state = self.client.weights()
        if state["fingerprint"] != self.initial_fingerprint:
            self.record.failures.append(
                f"engine serves {state['fingerprint']}, the trainer {self.initial_fingerprint}"
            )
        print(f"engine {state['version']!r} serves the trainer's weights", flush=True)
        return state["version"]

    def _rollouts(self, step: int, version: str) -> _Round:
        if self.record.failures:
            return _Round([], stop=self.record.failures[-1])
        args = self.args
        assert self.client is not None
        seed = args.seed * 10**6 + step * args.prompts * args.samples
        tick = time.perf_counter()
        rollouts = self.client.sample(prompts(args.prompts), args.samples, seed=seed)
        self._rollout_s = time.perf_counter() - tick
        stale = {r.weight_version for r in rollouts} - {version}
        if stale:
            return _Round([], stop=f"step {step}: rollouts from {stale}, expected {version!r}")
        return _Round(rollouts)

    def _step(self, step: int, rollouts: list[Rollout]) -> str:
        """One update and one push on every rank; rank 0 checks and prints."""
        from weightbus.apps.demo.records import (
            LOGPROB_TOLERANCE,
            DemoCheckError,
            StepRecord,
            print_step,
        )

        reward, gap = self.trainer.step(rollouts, self.args.samples)
        if gap > LOGPROB_TOLERANCE:
            raise DemoCheckError(f"step {step}: engine and trainer logprobs differ by {gap:.2e}")
        new_version = f"demo-sharded-step-{step}"
        result = self.publisher.push(self.trainer.model, version=new_version, step=step)
        if self.rank != 0:
            return new_version
        assert self.client is not None
        state = self.client.weights()
        matched = (state["version"], state["fingerprint"]) == (new_version, result.fingerprint)
        entry = StepRecord(
            step=step,
            version=new_version,
            reward=reward,
            logprob_gap=gap,
            rollout_tokens_per_s=sum(len(r.token_ids) for r in rollouts) / self._rollout_s,
            push_s=result.seconds,
            push_bytes=result.nbytes,
            fingerprint=result.fingerprint,
            fingerprint_matched=matched,
            push_rank_bytes=[list(engine.rank_nbytes) for engine in result.engines],
            push_trainer_rank_bytes=list(result.rank_sent_bytes),
        )
        self.record.steps.append(entry)
        print_step(entry, self.args.steps, render(rollouts[0].token_ids))
        sent = " / ".join(format_bytes(nbytes) for nbytes in result.rank_sent_bytes)
        [received] = [" / ".join(format_bytes(n) for n in e.rank_nbytes) for e in result.engines]
        print(
            f"          trainer ranks sent {sent} (no gather); engine ranks received {received}",
            flush=True,
        )
        if not matched:
            raise DemoCheckError(f"step {step}: the engine serves {state}, not {new_version!r}")
        return new_version


def planned_sends(model: torch.nn.Module, args: argparse.Namespace) -> list[int]:
    """Each trainer rank's bytes in a push of `model` (not yet sharded) into the engine, as
    `weightbus plan --trainer-ranks N --trainer-layout fsdp` (`ep` for an MoE: its experts cut
    by expert, as FSDP2 cuts the fused expert tensors) plans them."""
    from weightbus.apps.capacity.shapes import ModelTensors
    from weightbus.apps.capacity.sharding import EngineLayout
    from weightbus.apps.capacity.traffic import traffic
    from weightbus.core.meta import metas_of
    from weightbus.core.plan.planner import DEFAULT_BUCKET_BYTES
    from weightbus.core.weights import normalize_weights

    metas = tuple(metas_of(normalize_weights(model)))
    tensors = ModelTensors(args.model, metas, model.config.to_dict())
    experts = any(".experts." in meta.name for meta in metas)
    plan = traffic(
        tensors, EngineLayout(args.tp, args.tp if args.expert_parallel else 1), "shm",
        trainer_ranks=args.trainer_ranks, trainer_layout="ep" if experts else "fsdp",
        bucket_bytes=DEFAULT_BUCKET_BYTES,
    )  # fmt: skip
    return list(plan.trainer_send_bytes)


def main() -> None:
    args = argparse.Namespace(**json.loads(sys.argv[1]))
    dist.init_process_group("gloo", timeout=timedelta(seconds=_STEP_TIMEOUT_S))
    torch.set_num_threads(1)  # the engine's ranks need the cores more than the tiny trainer
    loop = _RankLoop(args)
    loop.run()
    if loop.client is not None:
        loop.client.close()
    loop.publisher.close()
    os._exit(0)  # gloo's teardown waits for peers that may have stopped


if __name__ == "__main__":
    main()
