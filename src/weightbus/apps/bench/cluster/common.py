"""What the cluster cases share: a checkpoint, pushes timed with every host's NIC bytes, the
engines' own fingerprints, and one row of results."""

import json
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from weightbus.apps.bench.dist import write_model
from weightbus.apps.bench.llama_weights import hf_config, llama_shape, llama_weights
from weightbus.apps.bench.moe_weights import moe_config, moe_shape, moe_weights
from weightbus.apps.capacity.forecast import Scenario, forecast
from weightbus.apps.capacity.profiles import hardware
from weightbus.apps.capacity.shapes import ModelTensors
from weightbus.apps.cluster.hosts import Cluster, Host
from weightbus.apps.cluster.ranks import TrainerRanks
from weightbus.core.digest import fingerprint
from weightbus.core.meta import TensorMeta, metas_of
from weightbus.core.publisher.targets import EngineWeights, HttpEngineTarget

GB = 1e9
T = TypeVar("T")
_READ_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Checkpoint:
    """A Llama-shaped bf16 checkpoint on disk, its tensors' metas and its fingerprint."""

    directory: Path
    model: ModelTensors
    fingerprint: str

    @property
    def nbytes(self) -> int:
        return self.model.total_bytes


def write_checkpoint(directory: Path, size: int) -> Checkpoint:
    """Llama-shaped bf16 weights of about `size` bytes as a checkpoint in `directory`."""
    weights = llama_weights(size)
    write_model(weights, size, directory.parent, directory.name)
    config = hf_config(llama_shape(size))
    model = ModelTensors(f"llama {size >> 20} MiB", tuple(metas_of(weights)), config)
    return Checkpoint(directory, model, fingerprint(weights))


def write_moe_checkpoint(directory: Path, size: int, num_experts: int, seed: int = 0) -> Checkpoint:
    """A Qwen3-MoE of at least `size` bytes (bf16, `num_experts` experts, top 4; per-expert
    tensors, as checkpoints name them; random weights from `seed`) in `directory`."""
    from safetensors.torch import save_file

    shape = moe_shape(size, num_experts)
    weights = moe_weights(shape, seed)
    directory.mkdir(parents=True)
    config = moe_config(shape)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(dict(weights), str(directory / "model.safetensors"))
    model = ModelTensors(f"qwen3-moe {size >> 20} MiB", tuple(metas_of(weights)), config)
    return Checkpoint(directory, model, fingerprint(weights))


def read_checkpoint(directory: Path) -> Checkpoint:
    """A checkpoint's tensors as a bf16 engine serves them (from its safetensors header and
    config; no tensor is read); no fingerprint."""
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        metas = tuple(
            TensorMeta(name, torch.bfloat16, tuple(handle.get_slice(name).get_shape()))
            for name in handle.keys()  # noqa: SIM118 - a safetensors handle, not a dict
        )
    config = json.loads((directory / "config.json").read_text())
    return Checkpoint(directory, ModelTensors(directory.name, metas, config), "")


def served(urls: Sequence[str], token: str) -> list[str]:
    """The fingerprint each engine says it serves (asked over the gateway)."""
    return [weights.fingerprint for weights in served_weights(urls, token)]


def served_weights(urls: Sequence[str], token: str) -> list[EngineWeights]:
    """The version and fingerprint each engine says it serves (asked over the gateway)."""
    answers = []
    for url in urls:
        target = HttpEngineTarget(url, token=token)
        try:
            answers.append(target.weights(_READ_TIMEOUT_S))
        finally:
            target.close()
    return answers


def start_engines(
    cluster: Cluster, hosts: Sequence[Host], model: str, tp: int, extra: Sequence[str] = ()
) -> list[str]:
    """`Cluster.start_engine` on every host in `hosts` at the same time (an engine's start is
    mostly its imports: they overlap); their URLs, in `hosts`' order. One that fails to start
    raises once all have been waited for (`Cluster.close` stops those that did start)."""
    with ThreadPoolExecutor(max_workers=max(1, len(hosts))) as pool:
        started = [pool.submit(cluster.start_engine, host, model, tp, extra) for host in hosts]
    return [future.result()[1] for future in started]


def engine_labels(cluster: Cluster, urls: Sequence[str]) -> dict[str, Host]:
    """`engine<j>` -> the host engine j listens on (by its URL's address)."""
    by_address = {host.address: host for host in cluster.hosts}
    return {
        f"engine{j}": by_address[url.split("//", 1)[1].rsplit(":", 1)[0]]
        for j, url in enumerate(urls)
    }


@dataclass
class Row:
    """One case, one path: its pushes' seconds, bytes per host and rank, and the prediction."""

    case: str
    path: str
    trainer_hosts: int
    engine_hosts: int
    model_bytes: int
    delivered_bytes: int  # model bytes the engines received per push (all replicas)
    link_bound_gb_per_s: float  # what the links allow this case (see each case)
    seconds: list[float] = field(default_factory=list)
    host_bytes: dict[str, list[int]] = field(default_factory=dict)  # host -> [tx, rx] per push
    sent_bytes: list[int] = field(default_factory=list)  # per trainer rank, one push
    engine_rank_bytes: list[list[int]] = field(default_factory=list)
    predicted_s: float = 0.0
    predicted_bottleneck: str = ""
    predicted_sent_bytes: list[int] = field(default_factory=list)
    predicted_engine_nic_bytes: int = 0
    predicted_rank_bytes: list[int] = field(default_factory=list)  # by engine TP rank
    predicted_nic_bytes: int = 0  # the planner's busiest NIC, one direction
    failures: list[str] = field(default_factory=list)
    version: str = ""  # the last push's

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def gb_per_s(self) -> float:
        return self.delivered_bytes / self.median_s / GB

    def as_dict(self) -> dict:
        return {**asdict(self), "median_s": self.median_s, "gb_per_s": self.gb_per_s}


def during(hosts: dict[str, Host], work: Callable[[], T]) -> tuple[T, dict[str, list[int]]]:
    """`work()`, and the bytes each host's NIC sent and received meanwhile (`[tx, rx]`)."""
    before = {label: host.nic_bytes() for label, host in hosts.items()}
    result = work()
    moved = {
        label: [after - was for after, was in zip(host.nic_bytes(), before[label], strict=True)]
        for label, host in hosts.items()
    }
    return result, moved


def timed_pushes(
    hosts: dict[str, Host], push: Callable[[str], float], row: Row, repeat: int, warmups: int = 1
) -> None:
    """`push(version)` `warmups` times to warm up, then `repeat` times: each push's seconds, and
    the bytes every host's NIC moved during the last one, into `row`."""
    for index in range(warmups + repeat):
        version = f"{row.case}-{row.path}-{row.trainer_hosts}-{row.engine_hosts}-{index}"
        seconds, moved = during(hosts, lambda v=version: push(v))
        row.version = version
        if index >= warmups:
            row.seconds.append(seconds)
            row.host_bytes = moved


def measure_pushes(
    ranks: TrainerRanks, key: str, hosts: dict[str, Host], row: Row, args
) -> list[dict]:
    """`timed_pushes` through publisher `key` of every rank (`ranks.command("open")` made it):
    the ranks' answers to the last push."""
    answers: list[dict] = []

    def push(version: str) -> float:
        answers[:] = ranks.command(
            "push", key=key, version=version, options={}, timeout_s=args.timeout + 60
        )
        return answers[0]["seconds"]

    timed_pushes(hosts, push, row, args.repeat, args.warmups)
    row.engine_rank_bytes = answers[0]["engine_rank_bytes"]
    return answers


def check_served(row: Row, urls: Sequence[str], token: str, expected: str) -> None:
    """A failure on `row` unless every engine serves its last push (`row.version`) with
    fingerprint `expected`."""
    answers = [(w.version, w.fingerprint) for w in served_weights(urls, token)]
    if set(answers) != {(row.version, expected)}:
        row.failures.append(f"engines serve {answers}, expected {(row.version, expected)}")


def cluster_hardware(link_bits_per_s: float):
    """`weightbus plan`'s `cpu-cluster` profile at a link's measured payload rate."""
    return hardware("cpu-cluster", links={"nic": link_bits_per_s / 8 / GB})


def predict(row: Row, checkpoint: Checkpoint, link_bits_per_s: float, **scenario) -> None:
    """`weightbus plan`'s prediction for `row`'s push, from the same layout and link rate."""
    planned = forecast(
        checkpoint.model, Scenario(hardware=cluster_hardware(link_bits_per_s), **scenario)
    )
    row.predicted_s = planned.timing.seconds
    row.predicted_bottleneck = planned.timing.bottleneck
    row.predicted_sent_bytes = list(planned.traffic.trainer_send_bytes)
    row.predicted_engine_nic_bytes = planned.traffic.nic_receive_bytes
    row.predicted_rank_bytes = list(planned.traffic.receive_bytes)
    row.predicted_nic_bytes = round(planned.timing.wire_s * link_bits_per_s / 8)
