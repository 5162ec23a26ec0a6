"""`weightbus bench status`: what the live-update machinery costs a decode step at rest.

A real rank-0 worker (tiny model by default, TP 1, in this process, its requests arriving over
ZMQ `ipc://` as from the API server) decodes a batch; rounds alternate between the worker as
shipped and the same worker with the weights-status steps (`_plan_weights_action`,
`_apply_weights_action`) removed. While the status is NORMAL the status rides in the step
header rank 0 broadcasts anyway, so the machinery adds no collective at any TP size: its cost
is the Python of those two steps, which this measures.
"""

import argparse
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import zmq

from weightbus.apps.progress import StepsProgress
from weightbus.engines.reference.engine import messages
from weightbus.engines.reference.engine.worker import Worker, WorkerConfig, ipc_addresses

TARGET_OVERHEAD = 0.03


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=16, help="sequences decoding together")
    parser.add_argument("--steps", type=int, default=200, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=10, help="rounds per variant (median)")


class _WorkerWithoutUpdates(Worker):
    """The same worker with the weights-status steps removed: the baseline."""

    def _plan_weights_action(self) -> None:
        pass

    def _apply_weights_action(self) -> None:
        pass


def _worker(ipc_dir: str, store_port: int, batch: int) -> Worker:
    config = WorkerConfig(
        tp_rank=0,
        tp_size=1,
        model="tiny",
        dtype="float32",
        max_num_seqs=batch,
        max_model_len=1024,
        max_num_batched_tokens=4096,
        seed=0,
        store_host="127.0.0.1",
        store_port=store_port,
        ipc_dir=ipc_dir,
        dist_timeout_s=60.0,
        idle_wait_s=0.05,
        parent_pid=0,
    )
    return Worker(config)


def _time_steps(worker: Worker, requests: zmq.Socket, batch: int, steps: int) -> float:
    """Seconds per decode step, with `batch` long sequences running."""
    for i in range(batch):
        request = messages.AddRequest(
            request_id=f"r{time.monotonic_ns()}-{i}",
            prompt_token_ids=[1 + i, 2, 3],
            max_tokens=steps + 2,
            temperature=0.0,
            top_p=1.0,
            ignore_eos=True,
        )
        requests.send(messages.encode(request))
    worker.step()  # prefill of the whole batch (not timed)
    start = time.perf_counter()
    for _ in range(steps):
        worker.step()
    elapsed = time.perf_counter() - start
    worker.step()  # the last token: every sequence finishes, its slot is free again
    return elapsed / steps


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    store = torch.distributed.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    with tempfile.TemporaryDirectory(prefix="weightbus-bench-") as ipc_dir:
        context = zmq.Context()
        requests_addr, outputs_addr = ipc_addresses(ipc_dir)
        requests = context.socket(zmq.PUSH)
        requests.bind(requests_addr)
        outputs = context.socket(zmq.PULL)
        outputs.bind(outputs_addr)
        worker = _worker(ipc_dir, store.port, args.batch)
        try:
            samples = _measure(worker, requests, outputs, args)
        finally:
            worker.close()
            requests.close(linger=0)
            outputs.close(linger=0)
            context.term()
    _report(samples, args)
    return 0


def _measure(worker: Worker, requests: zmq.Socket, outputs: zmq.Socket, args) -> dict:
    bare = _WorkerWithoutUpdates.__new__(_WorkerWithoutUpdates)
    bare.__dict__.update(worker.__dict__)  # the very same model, cache and sockets
    samples: dict[str, list[float]] = {"with": [], "without": []}
    variants = [("with", worker), ("without", bare)]
    with StepsProgress(args.rounds * len(variants), label="bench status") as progress:
        for index in range(args.rounds):
            # alternate which variant goes first, so neither always runs on a warmer cache
            for name, variant in variants[:: 1 if index % 2 else -1]:
                progress.step(f"round {index + 1}/{args.rounds}: {name} update machinery")
                samples[name].append(_time_steps(variant, requests, args.batch, args.steps))
                while outputs.poll(0):
                    outputs.recv()
    return samples


def _report(samples: dict, args: argparse.Namespace) -> None:
    with_s = statistics.median(samples["with"])
    without_s = statistics.median(samples["without"])
    overhead = with_s / without_s - 1
    verdict = "meets" if overhead <= TARGET_OVERHEAD else "MISSES"
    print(
        f"decode step, tiny model, batch {args.batch}, median of {args.rounds} rounds "
        f"x {args.steps} steps (interleaved)"
    )
    print(f"  without update machinery: {1000 * without_s:.3f} ms/step")
    print(f"  with update machinery:    {1000 * with_s:.3f} ms/step")
    print(f"  overhead: {100 * overhead:+.2f}% ({verdict} target <= {100 * TARGET_OVERHEAD:.0f}%)")
