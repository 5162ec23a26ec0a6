"""The public API is what a user types, and import paths from before the three wings still
reach the same modules (docs/development.md, "Import paths")."""

import importlib
import re

import pytest

import weightbus


def test_the_top_level_exports_what_a_user_types():
    assert {"Publisher", "EngineTarget", "HttpEngineTarget", "PushResult", "PushError"} <= set(
        weightbus.__all__
    )
    assert "plan_buckets" not in weightbus.__all__
    assert {"disk", "hf_dir", "shm", "dist", "nixl"} <= set(weightbus.transport_names())


def test_a_planner_name_from_the_top_level_warns_and_still_works():
    from weightbus.core.plan import FlatBucket

    with pytest.warns(DeprecationWarning, match="import it from weightbus.core.plan"):
        assert weightbus.FlatBucket is FlatBucket


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("weightbus.publisher", "weightbus.core.publisher"),
        ("weightbus.transport.disk", "weightbus.core.transport.disk"),
        ("weightbus.transport.dist.messages", "weightbus.core.transport.distributed.messages"),
        ("weightbus.transport.shared_memory", "weightbus.core.transport.parts.shared_memory"),
        ("weightbus.models.loader", "weightbus.engines.reference.models.loader"),
        ("weightbus.server.api", "weightbus.engines.reference.server.api"),
        ("weightbus.publisher.targets.vllm", "weightbus.engines.vllm.target"),
        ("weightbus.integrations.vllm", "weightbus.engines.vllm"),
        ("weightbus.capacity", "weightbus.apps.capacity"),
    ],
)
def test_an_old_path_is_the_same_module_as_its_new_one(old: str, new: str):
    moved = importlib.import_module(old)
    assert moved is importlib.import_module(new)
    assert moved.__name__ == new
    assert moved.__spec__.name == new


def test_an_unknown_old_path_still_fails_to_import():
    missing = re.escape("weightbus.core.publisher.nothing_here")
    with pytest.raises(ModuleNotFoundError, match=missing):
        importlib.import_module("weightbus.publisher.nothing_here")
