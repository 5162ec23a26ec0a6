"""The torch build (CUDA, ROCm or CPU) and the devices it sees."""

import os
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class Device:
    index: int
    name: str
    memory_bytes: int


@dataclass(frozen=True, slots=True)
class TorchBuild:
    """Attributes:
    version: torch's version (`2.13.0+cpu`).
    build: `cuda 12.8`, `rocm 6.4` or `cpu`.
    devices: the accelerators torch sees (none on a CPU build).
    cpu_count: CPUs this process may run on.
    """

    version: str
    build: str
    devices: list[Device] = field(default_factory=list)
    cpu_count: int = 0

    @property
    def cpu_build(self) -> bool:
        return self.build == "cpu"


def build_name() -> str:
    if torch.version.cuda:
        return f"cuda {torch.version.cuda}"
    if getattr(torch.version, "hip", None):
        return f"rocm {torch.version.hip}"
    return "cpu"


def cuda_devices() -> list[Device]:
    if not torch.cuda.is_available():
        return []
    devices = []
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        devices.append(Device(index, properties.name, properties.total_memory))
    return devices


def torch_build() -> TorchBuild:
    return TorchBuild(
        version=torch.__version__,
        build=build_name(),
        devices=cuda_devices(),
        cpu_count=len(os.sched_getaffinity(0)),
    )
