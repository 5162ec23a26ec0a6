"""Fixtures of the live-update tests."""

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from netns_harness import namespaces  # noqa: F401 - the fixture, for the modules here

if TYPE_CHECKING:
    from engine_harness import ServedEngine


@pytest.fixture(scope="module")
def engines(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, "ServedEngine"]]:
    """`update_harness.targets_and_reference` for the module: `tp2` and `tp1` to push into, and
    `reference_tp2` started with the tiny weights of the module's `SEED`."""
    from update_harness import targets_and_reference

    with targets_and_reference(tmp_path_factory.mktemp("log"), request.module.SEED) as started:
        yield started
