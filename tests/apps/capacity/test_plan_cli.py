"""`weightbus plan` as users run it: a config path or a preset, a table or JSON, clear errors,
and a 1T-parameter model planned without its weights in memory (its own process, for its peak
RSS; the others run the CLI's `main` in this process: each child would import transformers
again, ~6 s)."""

import contextlib
import io
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

from weightbus.apps.capacity.forecast import Scenario, forecast
from weightbus.apps.capacity.profiles import PROFILES
from weightbus.apps.capacity.published import CASES
from weightbus.apps.capacity.sharding import EngineLayout
from weightbus.apps.cli import main

CONFIG = Path(__file__).parent / "configs" / "small-qwen3-moe.json"


# `weightbus plan ARGS` in a child process, then the process's own peak RSS on stderr
_MAIN = (
    "import resource, sys\n"
    "from weightbus.apps.cli import main\n"
    "code = main(['plan', *sys.argv[1:]])\n"
    "print('peak_rss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
    "sys.exit(code)\n"
)


@dataclass(frozen=True)
class Done:
    """What a `weightbus plan` run returned and printed."""

    returncode: int
    stdout: str
    stderr: str


def _plan(*args: str) -> Done:
    """`weightbus plan ARGS` through the CLI's `main` here (the process's logging untouched)."""
    out, err = io.StringIO(), io.StringIO()
    with (
        mock.patch("weightbus.apps.cli.setup_logging"),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        try:
            code = main(["plan", *args])
        except SystemExit as exc:  # a refusal, as the interpreter would report it
            code = exc.code if isinstance(exc.code, int) else 1
            if isinstance(exc.code, str):
                print(exc.code, file=err)
    return Done(code, out.getvalue(), err.getvalue())


def _plan_in_child(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _MAIN, *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_json_is_the_python_api_result() -> None:
    args = [
        "--model",
        str(CONFIG),
        "--engine-tp",
        "2",
        "--engine-ep",
        "2",
        "--replicas",
        "3",
        "--transport",
        "nixl",
        "--hardware",
        "h100",
        "--bucket-bytes",
        "64KiB",
        "--json",
    ]
    done = _plan(*args)
    assert done.returncode == 0, done.stderr
    planned = json.loads(done.stdout)
    scenario = Scenario(
        engine=EngineLayout(2, 2),
        transport="nixl",
        hardware=PROFILES["h100"],
        replicas=3,
        bucket_bytes=64 * 1024,
    )
    expected = forecast(CONFIG, scenario)
    assert planned["traffic"]["share_bytes"] == list(expected.traffic.share_bytes)
    assert planned["traffic"]["trainer_send_bytes"] == list(expected.traffic.trainer_send_bytes)
    assert planned["timing"]["seconds"] == expected.timing.seconds
    assert planned["model"]["tensors"] == len(expected.model.metas)


def test_table_names_bytes_per_rank_and_the_prediction() -> None:
    done = _plan("--model", str(CONFIG), "--engine-tp", "2", "--transport", "dist-broadcast")
    assert done.returncode == 0, done.stderr
    assert "engine rank receives" in done.stdout
    assert "trainer rank sends" in done.stdout
    assert "predicted push:" in done.stdout


def test_bad_arguments_exit_with_the_reason() -> None:
    done = _plan("--model", str(CONFIG), "--link", "nic=fast")
    assert done.returncode == 1
    assert "weightbus plan: --link 'nic=fast': expected NAME=NUMBER" in done.stderr
    done = _plan("--model", str(CONFIG), "--engine-tp", "3")
    assert "weightbus plan: num_attention_heads (4) is not divisible by 3 ranks" in done.stderr
    done = _plan("--model", str(CONFIG), "--link", "nic=nan")
    assert "weightbus plan: link nic must be a finite number > 0 GB/s, got nan" in done.stderr
    assert "--model is required" in _plan().stderr


@pytest.mark.e2e  # a child process: its own peak RSS
def test_a_trillion_parameter_push_plans_without_its_weights() -> None:
    done = _plan_in_child(
        "--model",
        "kimi-k2",
        "--engine-tp",
        "16",
        "--replicas",
        "16",
        "--trainer-ranks",
        "256",
        "--transport",
        "dist-broadcast",
        "--hardware",
        "h20",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    planned = json.loads(done.stdout)
    assert planned["model"]["params"] > 1.0e12
    assert planned["model"]["bytes"] > 1.0e12  # FP8 weights and their block scales
    assert planned["traffic"]["receive_bytes"] == [planned["model"]["bytes"]] * 16
    peak_kib = int(done.stderr.rsplit("peak_rss_kib", 1)[1].split()[0])
    assert peak_kib < 4 * 2**20  # under 4 GiB for a ~1 TB model


def test_published_cases_are_predicted_with_their_sources() -> None:
    done = _plan("--published", "--json")
    assert done.returncode == 0, done.stderr
    cases = json.loads(done.stdout)
    assert [case["key"] for case in cases] == [case.key for case in CASES]
    for case in cases:
        assert case["source"].startswith("https://")
        assert case["timing"]["seconds"] > 0
        assert case["traffic"]["total_bytes"] == case["model"]["bytes"]
