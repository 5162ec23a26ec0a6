"""`weightbus bench cluster --cases experts`, bounded: a small Qwen3-MoE (4 experts, 49 MiB)
into one engine at TP 2 with EP 2 (and at TP 2 without EP) behind a 200 Mbit/s link, checked for
outcomes, never times: the engine serves the pushed fingerprint (the bench fails otherwise),
each engine rank receives the bytes `weightbus plan` says, and the engine's NIC carries the
planner's bytes (both ranks' shares; gloo's broadcast twice)."""

import json
import subprocess
import sys

import pytest

from weightbus.apps.bench.cluster.experts import PATHS
from weightbus.apps.cluster import unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")

# control messages and frame headers (GSO: few)
_OVERHEAD, _CONTROL_BYTES = 1.05, 1 << 20


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("bench") / "experts.json"
    command = [sys.executable, "-m", "weightbus", "bench", "cluster", "--cases", "experts"]
    command += ["--moe-size", "48MiB", "--moe-experts", "4", "--link", "200mbit"]
    # one push per path (no warm-up): these checks are of bytes and fingerprints, never of times
    command += ["--repeat", "1", "--warmups", "0", "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {row["path"]: row for row in json.loads(out.read_text())["cases"]["experts"]["rows"]}


def test_every_path_served_the_pushed_fingerprint(rows):
    assert set(rows) == set(PATHS)
    assert not {path: row["failures"] for path, row in rows.items() if row["failures"]}


def test_each_engine_rank_receives_the_planners_bytes(rows):
    for path, row in rows.items():
        assert row["engine_rank_bytes"] == [row["predicted_rank_bytes"]], path
    # every byte to every rank, against each rank its experts and its dense share
    assert rows["dist broadcast"]["engine_rank_bytes"] == [[rows["nixl"]["model_bytes"]] * 2]
    for path in ("dist parts", "nixl"):
        ranks = rows[path]["engine_rank_bytes"][0]
        assert sum(ranks) < _OVERHEAD * rows[path]["model_bytes"], path


def test_the_engines_nic_carries_the_planners_bytes(rows):
    for path, row in rows.items():
        received = row["host_bytes"]["engine0"][1]
        expected = row["predicted_engine_nic_bytes"]
        assert expected <= received <= _OVERHEAD * expected + _CONTROL_BYTES, (path, received)
