"""The roofline of `bench update`: each path's bound from its passes and the measured rates."""

import pytest

from weightbus.apps.bench.roofline import PathPasses, Rates

GB = 10**9
RATES = Rates(
    copy_all_cores=20 * GB,  # 2 cores: 10 GB/s each
    hash_one_core=40 * GB,
    check_one_core=40 * GB,
    prepass_all=10 * GB,
    verify_one_core=10 * GB,
    cores=2,
)


def test_a_copy_alone_is_bound_by_the_floor() -> None:
    path = PathPasses(copies=1, hashes=0, check="off", verify=False)
    assert RATES.bound_s(20 * GB, path) == pytest.approx(1.0)


def test_passes_in_cache_spread_their_cpu_seconds_over_the_cores() -> None:
    # copy 2 CPU-s + hash 0.5 + check 0.5 over 2 cores
    path = PathPasses(copies=1, hashes=1, check="in copy", verify=False)
    assert RATES.bound_s(20 * GB, path) == pytest.approx(1.5)


def test_the_gil_serialises_hashing_when_it_outweighs_the_rest() -> None:
    slow_hash = Rates(20 * GB, 5 * GB, 40 * GB, 10 * GB, 10 * GB, cores=2)
    path = PathPasses(copies=1, hashes=2, check="off", verify=False)
    assert slow_hash.bound_s(20 * GB, path) == pytest.approx(8.0)  # 40 GB hashed at 5 GB/s


def test_a_pre_pass_adds_its_seconds_before_the_stream() -> None:
    path = PathPasses(copies=2, hashes=1, check="pre-pass", verify=True)
    # copies 4 CPU-s + hash 0.5 + verify 2 over 2 cores = 3.25; the pre-pass 2 s first
    assert RATES.bound_s(20 * GB, path) == pytest.approx(3.25 + 2.0)
