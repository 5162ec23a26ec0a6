"""One tensor-parallel rank of a reference engine replica, as a Ray actor.

The actor's process is the rank: its `Worker` runs the same step loop as a `weightbus serve`
worker process, in a thread of the actor. Rank 0's actor also serves the replica's HTTP API
(the same app, on its node's address, behind the fleet's token) and the TCPStore where the
replica's TP group meets. Killing an actor kills its rank: the replica's other ranks fail
their next collective, rank 0's API server answers 503 (or is gone with it), and a push in
flight fails at once.

Methods that wait take a `timeout_s` (the others return at once); the actor runs them on a
small thread pool (`max_concurrency`), so `failure` and `stop` answer while `wait_ready` waits.
"""

import logging
import os
import shutil
import socket
import threading
import time

import msgspec
import ray
import torch

from weightbus.apps.ray.placement import bundle_of
from weightbus.core.log import setup_logging
from weightbus.core.store import is_loopback_host, serve_store
from weightbus.core.transport.parts.shared_memory import private_ipc_dir
from weightbus.engines.reference.engine.worker import WorkerConfig, run_worker
from weightbus.engines.reference.server.api import create_app
from weightbus.engines.reference.server.launcher import (
    ServeConfig,
    app_config,
    checked_model,
    http_server,
    listen,
    worker_config,
)

logger = logging.getLogger(__name__)

# Methods the fleet may call at once: wait_ready, failure, stop, placement.
MAX_CONCURRENCY = 4


class RankPlacement(msgspec.Struct, frozen=True, kw_only=True):
    """Where a rank runs, as the actor sees it from inside."""

    node_id: str
    node_ip: str
    pid: int
    placement_group_id: str | None
    bundle_index: int | None


class EngineRank:
    """Rank `tp_rank` of a replica (wrap with `ray.remote` to place it; see `fleet.py`).

    Args:
        serve_json: the replica's `ServeConfig`, JSON-encoded.
        tp_rank: this rank.
        num_threads: torch threads of the forward pass (the CPUs its bundle holds).
    """

    def __init__(self, serve_json: str, tp_rank: int, num_threads: int) -> None:
        self.config = msgspec.json.decode(serve_json, type=ServeConfig)
        self.tp_rank = tp_rank
        setup_logging(rank=tp_rank)
        torch.set_num_threads(max(1, num_threads))
        self._state = _RankState()
        self._worker_thread: threading.Thread | None = None
        self._server_thread: threading.Thread | None = None
        self._store = None
        self._ipc_dir = ""
        self._url = ""

    def placement(self) -> RankPlacement:
        """Where this actor runs: its node, and the bundle Ray gave it."""
        context = ray.get_runtime_context()
        # Ray exposes no public bundle index; the resources it assigned name the bundle
        core_worker = ray._private.worker.global_worker.core_worker
        bundle = bundle_of(core_worker.resource_ids())
        return RankPlacement(
            node_id=context.get_node_id(),
            node_ip=ray.util.get_node_ip_address(),
            pid=os.getpid(),
            placement_group_id=bundle[0] if bundle else None,
            bundle_index=bundle[1] if bundle else None,
        )

    def serve_store(self, host: str) -> int:
        """Rank 0: serve the TCPStore of the replica's TP group on `host`; returns its port."""
        self._store = serve_store(host, 0, world_size=None, timeout_s=self.config.dist_timeout_s)
        return self._store.port

    def start(self, store_host: str, store_port: int) -> None:
        """Start the rank's step loop (rank 0: and the API server); returns at once."""
        if is_loopback_host(store_host):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the whole replica on this host
        model_config, max_model_len = checked_model(self.config)
        if self.tp_rank == 0:
            # 0700, named after this process: swept on its node if the actor is killed
            self._ipc_dir = str(private_ipc_dir())
            self._start_server(model_config)
        config = worker_config(
            self.config,
            self.tp_rank,
            max_model_len,
            (store_host, store_port),
            self._ipc_dir,
            parent_pid=os.getppid(),  # the raylet: the rank stops if it is gone
        )
        self._worker_thread = threading.Thread(
            target=self._run_worker, args=(config,), name="rank", daemon=True
        )
        self._worker_thread.start()

    def _start_server(self, model_config: object) -> None:
        host = ray.util.get_node_ip_address()
        sock, self._url = listen(host, 0)
        app = create_app(app_config(self.config, model_config, self._ipc_dir), self._state)
        self._state.server = http_server(app, self.config)
        self._server_thread = threading.Thread(
            target=self._serve, args=(sock,), name="api", daemon=True
        )
        self._server_thread.start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            self._state.server.run(sockets=[sock])
        except SystemExit:  # uvicorn's exit when the app's start-up failed
            self._state.fail("the API server could not start")
        finally:
            sock.close()
            if not self._state.stopping.is_set():
                self._state.fail("the API server stopped")

    def _run_worker(self, config: WorkerConfig) -> None:
        try:
            run_worker(config)
        except Exception as exc:
            logger.exception("rank %d failed", self.tp_rank)
            self._state.fail(f"rank {self.tp_rank} failed: {exc}")
        if not self._state.stopping.is_set():
            self._state.fail(f"rank {self.tp_rank} stopped")

    def failure(self) -> str | None:
        """Why this rank cannot serve (None while it runs)."""
        return self._state.reason

    def wait_ready(self, timeout_s: float) -> str:
        """Rank 0: wait until the API server accepts requests; returns its URL.

        Raises:
            RuntimeError: the replica failed or did not start within `timeout_s`.
        """
        state = self._state
        if not state.ready.wait(timeout_s):
            raise RuntimeError(
                f"rank 0 not ready within {timeout_s} s: {state.reason or 'still starting'}"
            )
        if state.reason is not None:
            raise RuntimeError(state.reason)
        return self._url

    def stop(self, timeout_s: float) -> bool:
        """Stop the rank (rank 0: the API server, which stops every rank of the replica).

        Returns:
            Whether the step loop ended within `timeout_s`.
        """
        state = self._state
        state.stopping.set()
        state.fail("stopped")
        if state.server is not None:
            state.server.should_exit = True
        deadline = time.monotonic() + timeout_s
        for thread in (self._server_thread, self._worker_thread):
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
        self._store = None  # the TP group's store stops serving
        if self._ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        return self._worker_thread is None or not self._worker_thread.is_alive()


class _RankState:
    """What the actor's threads share; also the `EngineHooks` of rank 0's API server (the
    engine it watches is this actor's step loop)."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.stopping = threading.Event()
        self.ready = threading.Event()
        self.server = None

    def fail(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.ready.set()  # a wait_ready returns at once, with the reason

    def failure(self) -> str | None:
        return self.reason

    def stop_requested(self) -> bool:
        return self.stopping.is_set()

    def on_ready(self) -> None:
        self.ready.set()

    def on_failure(self, reason: str) -> None:
        self.fail(reason)
        if self.server is not None:
            self.server.should_exit = True
