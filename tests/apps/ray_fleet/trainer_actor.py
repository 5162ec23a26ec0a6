"""A trainer placed by Ray (a test actor): it holds a `transformers` policy, trains it a step at
a time and pushes each version to a `RayFleet` from its own process, over the transports its
node allows (`publisher_for`)."""

import time

import ray
import torch
from update_harness import hf_greedy, trained_copy

from weightbus import PushError
from weightbus.apps.ray import FleetHandles, publisher_for

BUCKET_BYTES = 64 * 1024  # many buckets: a fault lands mid-push


class Trainer:
    def __init__(self, model_dir: str, timeout_s: float) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.timeout_s = timeout_s
        self.publishers = {}  # by cross-node transport

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def step_and_push(
        self, handles: FleetHandles, version: str, seed: int, victim=None, cross_node="auto"
    ) -> dict:
        """Train one step and push it, to replicas on other nodes over `cross_node`; `victim`
        (an actor) is killed once the first bytes of the push were handed over. Returns the
        outcome and what transformers decodes."""
        self.model = trained_copy(self.model, seed)
        if cross_node not in self.publishers:
            self.publishers[cross_node] = publisher_for(
                handles, cross_node=cross_node, bucket_bytes=BUCKET_BYTES, timeout_s=self.timeout_s
            )
        publisher = self.publishers[cross_node]
        killed = []

        def kill_once(nbytes: int) -> None:
            if victim is not None and not killed:
                ray.kill(victim)
                killed.append(time.perf_counter())

        start = time.perf_counter()
        outcome = {"routes": dict(publisher.transport), "greedy": hf_greedy(self.model)}
        try:
            result = publisher.push(self.model, version=version, progress=kill_once)
        except PushError as exc:
            return outcome | {
                "error": str(exc),
                "failures": exc.failures,
                "seconds_after_kill": time.perf_counter() - killed[0] if killed else None,
            }
        finally:
            outcome["seconds"] = time.perf_counter() - start
        return outcome | {
            "fingerprint": result.fingerprint,
            "local_fingerprint": publisher.fingerprint(self.model),
            "engines": {e.url: e.fingerprint for e in result.engines},
            "mode": result.mode,
        }

    def remove_engine(self, url: str) -> list[str]:
        publisher = self.publishers["auto"]
        publisher.remove_engine(url)
        return publisher.engines

    def close(self) -> None:
        for publisher in self.publishers.values():
            publisher.close()
        self.publishers.clear()
