"""A Ray cluster of three nodes on this machine (`ray.cluster_utils.Cluster`), each with a
custom resource naming it (`n0`, `n1`, `n2`) so a bundle can be pinned to a node."""

import os
import sys
from collections.abc import Iterator

import pytest
from ray_harness import NODES

NODE_CPUS = 4  # logical: Ray's bookkeeping, not this machine's cores
OBJECT_STORE_BYTES = 80 * 1024 * 1024  # Ray's minimum; nothing large travels through it


def _node_args(name: str) -> dict:
    return {
        "num_cpus": NODE_CPUS,
        "resources": {name: 8},
        "object_store_memory": OBJECT_STORE_BYTES,
    }


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[object]:
    """The cluster, with this process connected as its driver; actors import what the tests
    import (the driver's `sys.path`)."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={**_node_args(NODES[0]), "include_dashboard": False}
    )
    try:
        for name in NODES[1:]:
            cluster.add_node(**_node_args(name))
        ray.init(
            address=cluster.address,
            runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}},
        )
        yield cluster
    finally:  # both are no-ops once the last test shut them down
        ray.shutdown()
        cluster.shutdown()
