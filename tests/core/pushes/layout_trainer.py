"""One rank of the feature x layout matrix (test_layout_matrix.py): the same model held one
way -- `plain` (one process holding every tensor: a group of one), `fsdp` (FSDP2 `fully_shard`
over every rank) or `fsdp_tp` (DTensors on a 2x2 (dp, tp) mesh, row-parallel layers split by
columns) -- pushed through every feature in turn with one `Publisher` per engine. Every rank
writes one JSON line per step to `<out>/rank<r>.jsonl`; rank 0 also saves the gathered weights
a step pushed (`<out>/<step>.pt`) and what the main engine served after it."""

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist
from layout_parts import ADAPTER_CONFIG, PROMPT, adapter_state, draft_weights

from weightbus.core.publisher import Publisher
from weightbus.core.publisher.probe import LogprobProbe

# a Megatron-style tensor-parallel plan on the mesh's second dimension
_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
_ROWWISE = ("o_proj", "down_proj")


class Rank:
    """This rank's model, how it holds it, and its publishers."""

    def __init__(self, args: dict) -> None:
        from transformers import AutoModelForCausalLM

        self.args, self.layout = args, args["layout"]
        self.group = None
        if self.layout != "plain":
            dist.init_process_group("gloo", timeout=timedelta(seconds=120))
            self.group = dist.group.WORLD
        self.rank = dist.get_rank() if self.group else 0
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(args["model_dir"], dtype=torch.float32)
        self.model = model.eval()
        if self.layout != "plain":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.5)
        self.publishers: dict[str, Publisher] = {}

    def publisher(self, engine: str, **options: Any) -> Publisher:
        key = json.dumps([engine, options], sort_keys=True)
        if key not in self.publishers:  # every rank builds it at the same step
            url = self.args["engines"][engine]
            options = {"transport": "shm", "timeout_s": 60, **options}
            self.publishers[key] = Publisher([url], group=self.group, **options)
        return self.publishers[key]

    def train(self, seed: int) -> None:
        ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(seed))
        self.model.train()
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.model.eval()

    def weights(self) -> Any:
        """What this rank pushes: the model as it holds it (2x2 mesh: redistributed)."""
        if self.layout != "fsdp_tp":
            return self.model
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        held = {}
        for name, param in self.model.state_dict().items():
            full = param.full_tensor()
            second = Replicate()
            if full.dim() == 2 and any(part in name for part in _ROWWISE):
                second = Shard(1)
            elif full.dim() == 2 and any(part in name for part in _COLWISE):
                second = Shard(0)
            held[name] = distribute_tensor(full, mesh, [Shard(0), second])
        return held

    def adapter(self) -> dict[str, Any]:
        """The adapter's matrices as this rank holds them (row shards over every rank)."""
        state = adapter_state(self.model.config)
        if self.group is None:
            return state
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        return {name: distribute_tensor(t, mesh, [Shard(0)]) for name, t in state.items()}

    def gathered(self) -> dict[str, torch.Tensor]:
        state = self.model.state_dict()
        if self.layout == "plain":
            return {name: t.detach().clone() for name, t in state.items()}
        return {name: t.full_tensor() for name, t in state.items()}

    def probe(self) -> LogprobProbe:
        """Logprobs of the model as it is now (every rank runs the forward: FSDP2's)."""
        return LogprobProbe.of_model(self.model, PROMPT, tolerance=1e-4)


def _served(url: str) -> dict:
    state = httpx.get(f"{url}/v1/weights", timeout=30).json()
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    return {"version": state["version"], "fingerprint": state["fingerprint"],
            "tokens": choice["token_ids"]}  # fmt: skip


def _result(result: Any) -> dict:
    if result is None or isinstance(result, str):
        return {"fingerprint": result}
    return {
        "fingerprint": result.fingerprint,
        "sent_bytes": getattr(result, "rank_sent_bytes", None),
        "rank_nbytes": [e.rank_nbytes for e in getattr(result, "engines", [])]
        if hasattr(result, "engines")
        else [],
        "delta": None if getattr(result, "delta", None) is None else result.delta.sent,
    }


def steps(rank: Rank) -> list[tuple[str, Any]]:
    """Every feature, in order: (step name, what it does)."""
    main, before, tag = rank.publisher("main", delta="always"), {}, rank.layout

    def hf_dir() -> Any:
        publisher = rank.publisher("main", transport="hf_dir")
        return publisher.push(rank.weights(), version=f"{tag}-hf-dir")

    def lora() -> Any:  # into the engine that joined, on the base it serves: the delta's
        return rank.publisher("join").push(
            rank.adapter(), version=f"{tag}-lora", adapter=ADAPTER_CONFIG,
            base_fingerprint=before["delta"].fingerprint,
        )  # fmt: skip

    def delta() -> Any:
        before["delta"] = main.push(rank.weights(), version=f"{tag}-delta")
        return before["delta"]

    def probe_bad() -> Any:
        before["probe"] = rank.probe()  # of the weights the engine serves now
        rank.train(seed=3)
        return main.push(rank.weights(), version=f"{tag}-probe-bad", probe=before["probe"])

    return [
        ("whole", lambda: main.push(rank.weights(), version=f"{tag}-whole")),
        ("train", lambda: rank.train(seed=1)),
        ("delta", delta),
        ("join", lambda: main.add_engine(rank.args["engines"]["join"], rank.weights())),
        ("leave", lambda: main.remove_engine(rank.args["engines"]["join"])),
        ("probe-bad", probe_bad),
        ("probe-good", lambda: main.push(
            rank.weights(), version=f"{tag}-probe-good", probe=rank.probe())),
        ("rollback", main.rollback),
        ("train", lambda: rank.train(seed=4)),
        ("hf_dir", hf_dir),
        ("draft", lambda: rank.publisher("draft").push(
            {**_named(rank.weights()), **draft_weights(rank.args["draft_dir"])},
            version=f"{tag}-draft")),
        ("lora", lora),
        ("fp8", lambda: rank.publisher("fp8", quantize="fp8-block").push(
            rank.weights(), version=f"{tag}-fp8")),
    ]  # fmt: skip


def _named(weights: Any) -> dict[str, Any]:
    return dict(weights.state_dict()) if isinstance(weights, torch.nn.Module) else dict(weights)


def main() -> None:
    args = json.loads(sys.argv[1])
    out = Path(args["out"])
    rank = Rank(args)
    with (out / f"rank{rank.rank}.jsonl").open("w") as records:
        for name, step in steps(rank):
            record: dict = {"step": name}
            try:
                record |= {"ok": True, **_result(step())}
            except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
                record |= {"ok": False, "error": type(exc).__name__, "message": str(exc)}
                if not isinstance(exc, ValueError | RuntimeError | OSError):
                    record["trace"] = traceback.format_exc()
            if name != "train":
                weights = rank.gathered() if name not in ("join", "leave", "rollback") else None
                if rank.rank == 0:
                    if weights is not None:
                        torch.save(weights, out / f"{name}.pt")
                    record["served"] = _served(args["engines"]["main"])
                records.write(json.dumps(record) + "\n")
                records.flush()
    for publisher in rank.publishers.values():
        publisher.close()
    os._exit(0)


if __name__ == "__main__":
    main()
