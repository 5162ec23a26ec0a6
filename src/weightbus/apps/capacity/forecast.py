"""`forecast`: the bytes per rank and the predicted time of one push, for a model on a cluster."""

from dataclasses import asdict, dataclass
from pathlib import Path

from weightbus.apps.capacity.shapes import ModelTensors, model_tensors
from weightbus.apps.capacity.sharding import EngineLayout
from weightbus.apps.capacity.timing import Hardware, Timing, predict
from weightbus.apps.capacity.traffic import Traffic, as_delta, traffic
from weightbus.core.plan.planner import DEFAULT_BUCKET_BYTES

_LOCAL_TRANSPORTS = ("shm", "shm-slots")


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """What is pushed, from where, to which engines, over what."""

    engine: EngineLayout
    transport: str
    hardware: Hardware
    replicas: int = 1
    trainer_ranks: int = 1
    trainer_layout: str = "owners"  # or "fsdp": every tensor's rows over the ranks
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    cross_node: bool | None = None  # None: False for shm transports, else True
    staged_from_host: bool = False  # the trainer's bytes wait in host memory
    stage_overlaps: bool = True  # staging bucket k+1 overlaps the wire (see timing.predict)
    verify: bool = True  # engines re-check digests (the Publisher's default, verify="full")
    engine_ranks_per_nic: int = 1  # engine ranks of a replica sharing one NIC (one host)
    delta_bytes: int | None = None  # a delta push: the bytes its encoding carries, not the model

    @property
    def crosses_nodes(self) -> bool:
        if self.cross_node is not None:
            return self.cross_node
        return self.transport not in _LOCAL_TRANSPORTS


@dataclass(frozen=True, slots=True)
class Forecast:
    """A push of `model` in `scenario`: its traffic and predicted timing."""

    model: ModelTensors
    scenario: Scenario
    traffic: Traffic
    timing: Timing

    def as_dict(self) -> dict:
        """Everything, JSON-ready (`weightbus plan --json`)."""
        scenario = asdict(self.scenario)
        scenario["cross_node"] = self.scenario.crosses_nodes
        return {
            "model": {
                "name": self.model.name,
                "params": self.model.num_params,
                "tensors": len(self.model.metas),
                "bytes": self.model.total_bytes,
                "dtypes": sorted({str(m.dtype).removeprefix("torch.") for m in self.model.metas}),
            },
            "scenario": scenario,
            "traffic": asdict(self.traffic),
            "timing": self.timing.as_dict(),
        }


def forecast(
    model: ModelTensors | str | Path, scenario: Scenario, dtype: str | None = None
) -> Forecast:
    """Bytes per rank and predicted time of one push of `model` (tensors, a config path or a
    preset name) in `scenario`.

    Raises:
        ValueError: the layout does not fit the model, or an unknown transport or dtype.
        FileNotFoundError: no such config or preset.
    """
    if not isinstance(model, ModelTensors):
        model = model_tensors(model, dtype)
    moved = traffic(
        model,
        scenario.engine,
        scenario.transport,
        replicas=scenario.replicas,
        trainer_ranks=scenario.trainer_ranks,
        trainer_layout=scenario.trainer_layout,
        bucket_bytes=scenario.bucket_bytes,
        verify=scenario.verify,
        engine_ranks_per_nic=scenario.engine_ranks_per_nic,
    )
    if scenario.delta_bytes is not None:
        moved = as_delta(moved, scenario.delta_bytes)
    timing = predict(
        moved,
        scenario.hardware,
        cross_node=scenario.crosses_nodes,
        staged_from_host=scenario.staged_from_host,
        # a delta is encoded whole before its stream starts
        stage_overlaps=scenario.stage_overlaps and scenario.delta_bytes is None,
    )
    return Forecast(model=model, scenario=scenario, traffic=moved, timing=timing)
