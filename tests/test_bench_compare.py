"""`weightbus bench --quick`: the full comparison runs end to end on tiny weights."""

import json
import subprocess
import sys

from weightbus.bench.compare import BASELINES, cases


def test_quick_comparison_times_every_case_and_writes_json_and_png(tmp_path):
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "weightbus",
            "bench",
            "--quick",
            "--json",
            str(out),
            "--plot",
            str(plot),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    payload = json.loads(out.read_text())
    (size_result,) = payload["results"]
    rows = {row["kind"]: row for row in size_result["rows"]}
    assert {"floor", *BASELINES, "weightbus"} <= set(rows)
    assert len(size_result["rows"]) == len(cases())
    for row in size_result["rows"]:
        assert row["seconds"], row
        assert all(s > 0 for s in row["seconds"]), row
        assert row["median_s"] > 0
        assert row["gb_per_s"] > 0
        if row["kind"] == "weightbus":
            assert set(row["speedup"]) == set(BASELINES)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "weightbus shm direct verify=full" in result.stdout
    assert "weightbus shm slots verify=none" in result.stdout
