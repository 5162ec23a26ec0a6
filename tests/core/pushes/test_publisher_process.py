"""The Publisher as its own process: killed mid-push, the `push` command, and the admin token."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from engine_harness import ServedEngine
from safetensors.torch import save_file
from update_harness import weights_state

from weightbus import Publisher, PushError
from weightbus.core.digest import fingerprint
from weightbus.core.transport.disk import DISK_ROOT_PREFIX
from weightbus.engines.reference.models.config import tiny_config
from weightbus.engines.reference.models.loader import random_hf_weights

TOKEN = "s3cret-admin-token"
PROMPT = [9, 8, 7]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    served = ServedEngine(
        "--api-token", TOKEN, log_path=tmp_path_factory.mktemp("log") / "serve.log"
    )
    served.client.headers["Authorization"] = f"Bearer {TOKEN}"
    yield served
    served.stop()


def _tiny(seed: int) -> list[tuple[str, torch.Tensor]]:
    return list(random_hf_weights(tiny_config(), seed))


def test_publisher_needs_the_token(engine):
    for token, status in ((None, 401), ("wrong", 403)):
        refused = pytest.raises(PushError, match=f"HTTP {status}")
        with Publisher([engine.url], token=token, timeout_s=30) as pub, refused:
            pub.push(_tiny(1), version="refused")
    with Publisher([engine.url], token=TOKEN, timeout_s=30) as pub:
        assert pub.push(_tiny(1), version="with-token").fingerprint == fingerprint(_tiny(1))


_KILLED_PUBLISHER = textwrap.dedent(
    """
    import sys
    from weightbus import Publisher
    from weightbus.engines.reference.models.config import tiny_config
    from weightbus.engines.reference.models.loader import random_hf_weights

    url, token, version = sys.argv[1:]
    with Publisher([url], token=token, timeout_s=60) as pub:
        print(pub.sink.root, flush=True)
        pub.push(list(random_hf_weights(tiny_config(), 7)), version=version, pause_mode="drain")
    """
)


def _long_request(engine: ServedEngine) -> threading.Thread:
    thread = threading.Thread(
        target=lambda: engine.complete(prompt=PROMPT, max_tokens=300, ignore_eos=True)
    )
    thread.start()
    # admitted in order: once a later one-token request is done, the long one runs
    assert engine.complete(prompt=[1], max_tokens=1).status_code == 200
    return thread


def test_publisher_killed_mid_push_leaves_a_serving_engine_and_no_files(engine):
    before = weights_state(engine)
    running = _long_request(engine)  # drain keeps the update in flight while it runs
    publisher = subprocess.Popen(
        [sys.executable, "-c", _KILLED_PUBLISHER, engine.url, TOKEN, "killed"],
        stdout=subprocess.PIPE,
        text=True,
    )
    root = Path(publisher.stdout.readline().strip())
    assert root.name.startswith(f"{DISK_ROOT_PREFIX}{publisher.pid}-")
    deadline = time.monotonic() + 60
    while weights_state(engine)["status"] != "UPDATING":
        assert time.monotonic() < deadline, "the push never reached the engine"
    os.kill(publisher.pid, signal.SIGKILL)
    publisher.wait(10)
    running.join(60)
    # disk sessions are complete before the request is sent: the engine finishes the update
    deadline = time.monotonic() + 60
    while (state := weights_state(engine))["status"] == "UPDATING":
        assert time.monotonic() < deadline, "the engine never settled"
    assert state["status"] == "NORMAL"
    assert state["version"] in {before["version"], "killed"}
    assert root.exists()  # nobody cleaned up after the killed publisher ...
    with Publisher([engine.url], token=TOKEN, timeout_s=30) as pub:
        assert not root.exists()  # ... until the next publisher starts on this host
        result = pub.push(_tiny(8), version="after-kill")
    assert weights_state(engine)["fingerprint"] == result.fingerprint
    assert engine.complete(prompt=PROMPT, max_tokens=2).status_code == 200


def test_push_command_pushes_a_checkpoint_directory(engine, tmp_path):
    weights = dict(_tiny(9))
    save_file(weights, str(tmp_path / "model.safetensors"))
    env = {**os.environ, "WEIGHTBUS_API_TOKEN": TOKEN}
    cmd = [sys.executable, "-m", "weightbus", "push", "--engine", engine.url]
    done = subprocess.run(
        [*cmd, "--from", str(tmp_path), "--version", "from-dir", "--step", "5"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert f'"fingerprint": "{fingerprint(weights.items())}"' in done.stdout
    state = weights_state(engine)
    assert (state["version"], state["step"]) == ("from-dir", 5)
    again = subprocess.run(
        [*cmd, "--from", str(tmp_path), "--version", "from-dir"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert again.returncode == 1
    assert "HTTP 409: version 'from-dir' is already being served" in again.stderr
