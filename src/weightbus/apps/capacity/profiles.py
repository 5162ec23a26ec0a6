"""Hardware profiles for `weightbus plan --hardware NAME`: vendor bandwidths, each with its source.

Bandwidths are per GPU and per direction (NVIDIA quotes NVLink as the sum of both directions:
halved here). Per-tensor, per-bucket and per-push costs are not vendor figures: they are this
project's assumptions, named as such, and `docs/scale.md` shows how much of each prediction
they make up. The GPU profiles do not hash (`hash_gb_per_s` None): they model systems that push
without a fingerprint; weightbus's own fingerprint pass on GPU tensors is not modelled.
"""

import math
from dataclasses import replace

from weightbus.apps.capacity.timing import Hardware

_NVLINK_H100 = "https://www.nvidia.com/en-us/data-center/h100/ (NVLink 900 GB/s, both directions)"
_CX7 = "ConnectX-7: 400 Gb/s = 50 GB/s (NVIDIA MLNX_OFED release notes; DeepEP README for H800)"
_PCIE5 = "PCI-SIG: PCIe 5.0 x16, 32 GT/s x 16 lanes = 64 GB/s per direction (~50 GB/s achieved)"
_ASSUMED = "assumed (not a vendor figure): see docs/scale.md"

# GPU-side costs every GPU profile shares: a load_weights dispatch per tensor (Python + a copy
# kernel launch), a synchronisation per bucket, and a fixed cost per push.
_GPU_COSTS = {"tensor_s": 20e-6, "bucket_s": 100e-6, "push_s": 0.05}


def _gpu(
    name: str, nvlink_both_gb_per_s: float, hbm_gb_per_s: float, hbm_source: str, nvlink_source: str
) -> Hardware:
    return Hardware(
        name=name,
        nic_gb_per_s=50.0,
        local_gb_per_s=nvlink_both_gb_per_s / 2,
        stage_gb_per_s=50.0,
        copy_gb_per_s=hbm_gb_per_s / 2,  # a copy reads and writes device memory
        **_GPU_COSTS,
        sources={
            "nic_gb_per_s": _CX7 + ", one NIC per GPU",
            "local_gb_per_s": nvlink_source,
            "stage_gb_per_s": _PCIE5,
            "copy_gb_per_s": hbm_source + " (a copy reads and writes: half)",
            "tensor_s, bucket_s, push_s": _ASSUMED,
        },
    )


PROFILES: dict[str, Hardware] = {
    "h100": _gpu(
        "h100",
        900.0,
        3350.0,
        "https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM HBM3 3.35 TB/s)",
        _NVLINK_H100,
    ),
    "h800": _gpu(
        "h800",
        400.0,
        3350.0,
        "H800 SXM5 HBM3 3.35 TB/s (secondary sources quoting NVIDIA; as H100)",
        "H800 SXM5 NVLink 400 GB/s, both directions (secondary sources quoting NVIDIA)",
    ),
    "h20": _gpu(
        "h20",
        900.0,
        4000.0,
        "H20 HBM3 4.0 TB/s (secondary sources quoting NVIDIA)",
        "H20 NVLink 900 GB/s, both directions (secondary sources quoting NVIDIA)",
    ),
    # A CPU host where the trainer and every rank share the cores, as on this project's 2-core
    # CI machine (figures measured there; `weightbus bench plan` measures your own).
    "cpu-host": Hardware(
        name="cpu-host",
        nic_gb_per_s=2.1,
        local_gb_per_s=10.7,
        broadcast_gb_per_s=1.1,
        copy_gb_per_s=10.7,
        hash_gb_per_s=13.9,
        push_s=0.05,
        shared_cpu=True,
        sources={
            "all": "measured by `weightbus bench plan` at 1 GiB on the 2-core CI machine "
            "(docs/scale.md section 4): memcpy into shared memory, xxh3 on one thread, gloo "
            "broadcast to 2 peers and point-to-point sends over loopback, a push's fixed cost",
        },
    ),
}
# `weightbus bench cluster`'s hosts: this machine's cores (cpu-host's figures) behind links that
# a rate limit makes the bound (set `--link nic=GB/s`: the link's payload rate). gloo, the
# `dist` transport's backend on CPU, broadcasts by binomial tree; bytes wait in the links'
# shapers, not on a core, so the stages overlap.
PROFILES["cpu-cluster"] = replace(
    PROFILES["cpu-host"],
    name="cpu-cluster",
    nic_gb_per_s=0.125,
    broadcast_gb_per_s=None,
    broadcast_algorithm="binomial",
    shared_cpu=False,
    sources={
        **PROFILES["cpu-host"].sources,
        "nic_gb_per_s": "a 1 Gbit/s link (weightbus bench cluster sets the measured rate)",
    },
)

LINK_FIELDS = {
    "nic": "nic_gb_per_s",
    "local": "local_gb_per_s",
    "broadcast": "broadcast_gb_per_s",
    "stage": "stage_gb_per_s",
    "copy": "copy_gb_per_s",
    "hash": "hash_gb_per_s",
}
COST_FIELDS = {"tensor": "tensor_s", "bucket": "bucket_s", "push": "push_s"}


def hardware(
    name: str, links: dict[str, float] | None = None, costs: dict[str, float] | None = None
) -> Hardware:
    """A profile with some bandwidths (`links`, GB/s, by short name) or costs (`costs`,
    seconds) replaced.

    Raises:
        ValueError: an unknown profile, link or cost name, or a value <= 0 (costs: < 0).
    """
    if name not in PROFILES:
        raise ValueError(f"unknown hardware {name!r}; choose one of {', '.join(PROFILES)}")
    changes = {}
    for key, value in (links or {}).items():
        if key not in LINK_FIELDS:
            raise ValueError(f"unknown link {key!r}; choose from {', '.join(LINK_FIELDS)}")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"link {key} must be a finite number > 0 GB/s, got {value}")
        changes[LINK_FIELDS[key]] = value
    for key, value in (costs or {}).items():
        if key not in COST_FIELDS:
            raise ValueError(f"unknown cost {key!r}; choose from {', '.join(COST_FIELDS)}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"cost {key} must be a finite number >= 0 s, got {value}")
        changes[COST_FIELDS[key]] = value
    profile = PROFILES[name]
    if changes:
        sources = {**profile.sources, **dict.fromkeys(changes, "set on the command line")}
        profile = replace(profile, **changes, sources=sources)
    return profile
