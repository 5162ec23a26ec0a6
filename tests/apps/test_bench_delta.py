"""`weightbus bench delta` runs end to end on a small model: every row pushes into a real TP-2
engine, the delta rows go as deltas, and a sparse delta carries fewer bytes than a full push."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e  # starts `weightbus serve` (through the bench)

ROWS = ("full", "tensor-skip", "sparse", "sparse, atomic")
RUNS = {"demo lr 3e-3", "lr 1e-6", "lr 1e-6, frozen embeddings"}


def test_bench_delta_reports_every_row(tmp_path):
    out = tmp_path / "delta.json"
    command = [sys.executable, "-m", "weightbus", "--log-level", "WARNING", "bench", "delta"]
    command += ["--sizes", "8MiB", "--steps", "2", "--repeat", "1", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "unchanged elements" in result.stdout
    assert "target: over dist, sparse at 2%" in result.stdout
    report = json.loads(out.read_text())

    steps = report["steps"]
    assert {s["run"] for s in steps} == RUNS
    assert all(0 <= s["unchanged_fraction"] <= 1 and s["logprob_gap"] < 1e-4 for s in steps)

    (size,) = report["results"]
    assert 0.015 < size["changed_fraction"] < 0.02  # 2% of every tensor but the embeddings
    rows = {(r["transport"], r["row"]): r for r in size["rows"]}
    assert set(rows) == {(t, row) for t in ("dist", "shm") for row in ROWS}
    for transport in ("dist", "shm"):
        full = rows[transport, "full"]
        assert not full["sent_as_delta"]
        assert full["nbytes"] == size["size"]
        for name in ROWS[1:]:
            assert rows[transport, name]["sent_as_delta"], (transport, name)
        assert rows[transport, "tensor-skip"]["tensors"]["same"] == 1  # the frozen embeddings
        for name in ("sparse", "sparse, atomic"):
            sparse = rows[transport, name]
            assert sparse["nbytes"] < full["nbytes"] / 5
            assert sparse["changed_fraction"] == pytest.approx(size["changed_fraction"])
