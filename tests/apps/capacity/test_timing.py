"""`weightbus.apps.capacity.timing`: the documented schedule model, stage by stage."""

from dataclasses import replace
from pathlib import Path

import pytest

from weightbus.apps.capacity.profiles import PROFILES, hardware
from weightbus.apps.capacity.shapes import model_tensors
from weightbus.apps.capacity.sharding import EngineLayout
from weightbus.apps.capacity.timing import GB, predict
from weightbus.apps.capacity.traffic import traffic

MOE = model_tensors(Path(__file__).parent / "configs" / "small-qwen3-moe.json", "bfloat16")
BUCKET = 64 * 1024
H100 = PROFILES["h100"]


def test_sharded_wire_is_the_busiest_endpoint_over_its_link() -> None:
    moved = traffic(MOE, EngineLayout(2), "nixl", replicas=4, bucket_bytes=BUCKET)
    across = predict(moved, H100, cross_node=True)
    within = predict(moved, H100, cross_node=False)
    busiest = max(*moved.trainer_send_bytes, *moved.receive_bytes)
    assert max(moved.trainer_send_bytes) > max(moved.receive_bytes)  # one trainer, 4 replicas
    assert across.wire_s == pytest.approx(busiest / (H100.nic_gb_per_s * GB))
    assert within.wire_s == pytest.approx(busiest / (H100.local_gb_per_s * GB))
    assert across.apply_s == 0.0  # direct writes land in the parameters


def test_broadcast_wire_and_apply() -> None:
    moved = traffic(MOE, EngineLayout(2), "dist-broadcast", bucket_bytes=BUCKET)
    timing = predict(moved, H100, cross_node=True)
    assert timing.wire_s == pytest.approx(MOE.total_bytes / (H100.nic_gb_per_s * GB))
    copy = max(moved.share_bytes) / (H100.copy_gb_per_s * GB)
    assert timing.apply_s == pytest.approx(copy + len(MOE.metas) * H100.tensor_s)


def test_pipelined_stages_overlap_and_shared_cores_add_up() -> None:
    moved = traffic(MOE, EngineLayout(2), "dist-broadcast", bucket_bytes=BUCKET)
    assert moved.sequential_buckets == moved.num_buckets > 1
    gpu = replace(H100, stage_gb_per_s=10.0)
    timing = predict(moved, gpu, cross_node=True, staged_from_host=True)
    stages = [timing.stage_s, timing.wire_s, timing.apply_s]
    assert timing.stage_s == pytest.approx(MOE.total_bytes / 10e9)
    assert timing.fill_s == pytest.approx((sum(stages) - max(stages)) / moved.num_buckets)
    buckets_s = moved.num_buckets * gpu.bucket_s
    assert timing.seconds == pytest.approx(max(stages) + timing.fill_s + buckets_s + gpu.push_s)
    serial = predict(moved, gpu, cross_node=True, staged_from_host=True, stage_overlaps=False)
    later = [serial.wire_s, serial.apply_s]
    assert serial.seconds == pytest.approx(
        serial.stage_s + max(later) + min(later) / moved.num_buckets + buckets_s + gpu.push_s
    )
    shared = predict(moved, replace(gpu, shared_cpu=True), cross_node=True, staged_from_host=True)
    assert shared.seconds == pytest.approx(sum(stages) + buckets_s + gpu.push_s)


def test_parallel_trainer_ranks_send_their_own_buckets() -> None:
    one = traffic(MOE, EngineLayout(2), "nixl", replicas=2, bucket_bytes=BUCKET)
    many = traffic(MOE, EngineLayout(2), "nixl", replicas=2, trainer_ranks=8, bucket_bytes=BUCKET)
    assert one.sequential_buckets == one.num_buckets
    assert many.sequential_buckets == -(-max(many.trainer_own_bytes) // BUCKET) < one.num_buckets


def test_hardware_overrides_are_checked() -> None:
    assert hardware("h20", {"nic": 25.0}).nic_gb_per_s == 25.0
    assert hardware("h20", costs={"tensor": 0.0}).tensor_s == 0.0
    with pytest.raises(
        ValueError, match="unknown hardware 'tpu'; choose one of h100, h800, h20, cpu-host"
    ):
        hardware("tpu")
    with pytest.raises(
        ValueError,
        match="unknown link 'pcie'; choose from nic, local, broadcast, stage, copy, hash",
    ):
        hardware("h20", {"pcie": 1.0})
    with pytest.raises(ValueError, match=r"link nic must be a finite number > 0 GB/s, got 0\.0"):
        hardware("h20", {"nic": 0.0})
