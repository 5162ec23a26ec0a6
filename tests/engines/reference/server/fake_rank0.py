"""The API server in-process (real uvicorn, real HTTP) linked to a scripted rank 0.

`FakeRank0` connects to the API server's ZMQ `ipc://` sockets exactly as a worker does and speaks
`engine.messages` in msgpack, so the admin routes' round trips (results, weights states,
aborted requests, versions changing mid-sequence) can be driven message by message before the
real worker answers them.
"""

import queue
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable

import httpx
import uvicorn
import zmq

from weightbus.engines.reference.engine import messages
from weightbus.engines.reference.engine.rollback import NOT_YET
from weightbus.engines.reference.engine.worker import ipc_addresses
from weightbus.engines.reference.server.admin import AdminConfig
from weightbus.engines.reference.server.api import AppConfig, create_app
from weightbus.engines.reference.server.launcher import Server

Handler = Callable[[messages.ToEngine], list[messages.FromEngine]]
POLL_MS = 10
WAIT_S = 10.0


# What `GET /v1/weights` adds for fleets, on an engine that never replaced a version.
AT_REST_FLEET_INFO = {
    "rollback": None,
    "rollback_unavailable": NOT_YET,
    "staged_version": None,
    "waiting_for_initial_weights": False,
    "two_phase_aborts": 0,
    "rollbacks": 0,
    "draft": None,
    "adapter": None,
    "base_fingerprint": None,
}


def weights_state(**changes: object) -> messages.WeightsState:
    """A `WeightsState` at rest (version "init"), with `changes` applied."""
    fields = {
        "version": "init",
        "step": None,
        "status": "NORMAL",
        "fingerprint": None,
        "generation": "running",
        "released": [],
        "history": [],
        "rollback_unavailable": NOT_YET,
    }
    return messages.WeightsState(**(fields | changes))


def wait_until(predicate: Callable[[], object], timeout_s: float = WAIT_S) -> None:
    """Poll `predicate` until it is true; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


class FakeRank0:
    """Rank 0's end of the link, in a thread: sends `Ready`, then answers with `handler`
    (every message but `Shutdown`).

    Args:
        ipc_dir: the API server's socket directory.
        weight_version: the version `Ready` reports.
    """

    def __init__(self, ipc_dir: str, weight_version: str = "init") -> None:
        self._addresses = ipc_addresses(ipc_dir)
        self._ready = messages.Ready(
            protocol_version=messages.PROTOCOL_VERSION,
            tp_size=1,
            vocab_size=512,
            max_model_len=64,
            eos_token_ids=[257],
            weight_version=weight_version,
        )
        self.handler: Handler = lambda message: []
        self.received: list[messages.ToEngine] = []
        self._outbox: queue.Queue[messages.FromEngine] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-rank0", daemon=True)
        self._thread.start()

    def send(self, message: messages.FromEngine) -> None:
        """Send a message to the API server on its own (not as an answer)."""
        self._outbox.put(message)

    def received_of(self, kind: type) -> list:
        """The messages of type `kind` received so far."""
        return [m for m in list(self.received) if isinstance(m, kind)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=WAIT_S)
        assert not self._thread.is_alive()

    def _run(self) -> None:
        context = zmq.Context()
        requests = context.socket(zmq.PULL)
        requests.connect(self._addresses[0])
        outputs = context.socket(zmq.PUSH)
        outputs.connect(self._addresses[1])
        outputs.send(messages.encode(self._ready))
        # what the real rank 0 sends right after Ready (the API server waits for it)
        outputs.send(messages.encode(weights_state(version=self._ready.weight_version)))
        try:
            while not self._stop.is_set():
                while not self._outbox.empty():
                    outputs.send(messages.encode(self._outbox.get()))
                if requests.poll(POLL_MS):
                    message = messages.decode_to_engine(requests.recv())
                    self.received.append(message)
                    if isinstance(message, messages.Shutdown):  # the server is closing
                        continue
                    for reply in self.handler(message):
                        outputs.send(messages.encode(reply))
        finally:
            requests.close(linger=0)
            outputs.close(linger=0)
            context.term()


class FakeHooks:
    """`EngineHooks` whose engine failure a test sets."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.ready = threading.Event()
        self.failures: list[str] = []

    def failure(self) -> str | None:
        return self.reason

    def stop_requested(self) -> bool:
        return False

    def on_ready(self) -> None:
        self.ready.set()

    def on_failure(self, reason: str) -> None:
        self.failures.append(reason)


class InProcessServer:
    """`create_app` under uvicorn in a thread on an OS-assigned port, with a `FakeRank0`.

    Args:
        api_token: the admin routes' token (None: open).
        update_margin_s, control_timeout_s, request_timeout_s: bounds, small for tests.
    """

    def __init__(
        self,
        *,
        api_token: str | None = None,
        update_margin_s: float = 0.3,
        control_timeout_s: float = 1.0,
        request_timeout_s: float = 10.0,
    ) -> None:
        # short: a unix socket path must fit in ~107 bytes
        self.ipc_dir = tempfile.mkdtemp(prefix="wbt-")
        self.rank0 = FakeRank0(self.ipc_dir)
        self.hooks = FakeHooks()
        config = AppConfig(
            model="tiny",
            served_model_name="tiny",
            ipc_dir=self.ipc_dir,
            bos_token_id=256,
            ready_timeout_s=WAIT_S,
            request_timeout_s=request_timeout_s,
            api_token=api_token,
            admin=AdminConfig(update_margin_s=update_margin_s, control_timeout_s=control_timeout_s),
        )
        self._sock = socket.create_server(("127.0.0.1", 0))
        host, port = self._sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        uvicorn_config = uvicorn.Config(
            create_app(config, self.hooks), log_config=None, access_log=False
        )
        self._server = Server(uvicorn_config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()
        assert self.hooks.ready.wait(WAIT_S), "app did not start"
        self.client = httpx.Client(base_url=self.url, timeout=30.0)

    def close(self) -> None:
        self.client.close()
        self._server.should_exit = True
        self._thread.join(timeout=WAIT_S)
        assert not self._thread.is_alive()
        self._sock.close()
        self.rank0.close()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
