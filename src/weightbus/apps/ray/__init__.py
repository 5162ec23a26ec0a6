"""Fleets of reference-engine replicas placed by Ray (`pip install weightbus[ray]`).

`RayFleet.start(RayFleetConfig(...))` places one actor per TP rank on placement-group bundles
(groups weightbus owns, or the caller's with its bundle indices kept in order) and returns
handles a `Publisher` pushes to; `publisher_for(fleet.handles)` builds one in any process of the
cluster, each replica over the transport its placement allows. docs/ray.md walks through it.
"""

from weightbus.apps.ray.fleet import (
    FleetHandles,
    RayFleet,
    RayFleetConfig,
    Replica,
    ReplicaInfo,
    cross_node_transport,
    publisher_for,
    routes_for,
)
from weightbus.apps.ray.placement import check_bundle_indices
from weightbus.apps.ray.rank import EngineRank, RankPlacement
from weightbus.engines.reference.server.launcher import ServeConfig

__all__ = [
    "EngineRank",
    "FleetHandles",
    "RankPlacement",
    "RayFleet",
    "RayFleetConfig",
    "Replica",
    "ReplicaInfo",
    "ServeConfig",
    "check_bundle_indices",
    "cross_node_transport",
    "publisher_for",
    "routes_for",
]
