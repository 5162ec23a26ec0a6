"""`weightbus bench`: the full comparison runs end to end on tiny weights (`--quick`), and still
writes its table and JSON when matplotlib is missing."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from weightbus.apps.bench import compare
from weightbus.apps.bench.compare import BASELINES, Row, cases


@pytest.mark.e2e  # runs `python -m weightbus bench` (tiers: tests/conftest.py)
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


def _fake_bench_size(size: int, args: argparse.Namespace, workdir: Path) -> dict:
    # what `_bench_size` measures, without weights or an engine
    del args, workdir
    rows = [
        Row("floor: memcpy into preallocated", "floor", [0.1]),
        *(Row(kind, kind, [0.5]) for kind in BASELINES),
        Row("weightbus shm direct verify=full", "weightbus", [0.2]),
    ]
    return {"size": size, "num_tensors": 3, "rows": rows}


def test_missing_matplotlib_skips_the_plot_after_the_table_and_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    monkeypatch.setattr(compare, "_bench_size", _fake_bench_size)
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    args = parser.parse_args(["--sizes", "1MiB", "--repeat", "1", "--json", str(out)])
    args.plot = str(plot)
    threads = torch.get_num_threads()
    try:
        assert compare.run(args) == 0
    finally:
        torch.set_num_threads(threads)  # `run` uses every core
    captured = capsys.readouterr()
    assert "weightbus shm direct verify=full" in captured.out  # the table
    payload = json.loads(out.read_text())
    (size_result,) = payload["results"]
    assert [row["kind"] for row in size_result["rows"]] == ["floor", *BASELINES, "weightbus"]
    assert not plot.exists()
    assert captured.out.endswith(f"wrote {out}\n")
    skipped = [line for line in captured.err.splitlines() if "plot skipped" in line]
    message = (
        f"weightbus bench: plot skipped ({plot}): matplotlib is not installed; "
        "pip install 'weightbus[bench]' to get it"
    )
    assert skipped == [message]
