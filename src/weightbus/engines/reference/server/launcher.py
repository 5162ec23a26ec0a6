"""`serve`: start the worker processes and the API server, supervise them, stop them all.

Process tree: this process runs the API server (uvicorn, main thread) and owns the rendezvous
TCPStore (on an OS-assigned port) and a private directory for the ZMQ sockets; it starts one
`python -m weightbus.engines.reference.engine.worker` process per rank. A worker dies with its
launcher (Linux
parent-death signal). SIGINT/SIGTERM make uvicorn stop; then rank 0 is told to shut down (it
stops all ranks through the TP group), stragglers are terminated, the directory is removed.
"""

import contextlib
import errno
import logging
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import uvicorn
from fastapi import FastAPI

from weightbus.core.fixes import with_fix
from weightbus.engines.reference.engine.worker import WorkerConfig
from weightbus.engines.reference.models.config import ModelConfig
from weightbus.engines.reference.models.experts import ExpertLayout
from weightbus.engines.reference.models.loader import (
    QUANTIZATIONS,
    TINY,
    expert_layout,
    lora_shape,
    resolve_config,
)
from weightbus.engines.reference.server.admin import AdminConfig
from weightbus.engines.reference.server.api import AppConfig, create_app
from weightbus.engines.reference.server.auth import is_loopback

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16")
DEFAULT_MAX_MODEL_LEN = 2048
# draft tokens proposed per step, at most (each is one forward pass of the draft)
MAX_SPECULATIVE_TOKENS = 16
# Rank 0 answers a timed-out update 5 s after its `timeout_s`; the Publisher gives up 10 s after.
UPDATE_MARGIN_S = 8.0
# A control action may wait for running sequences, which `request_timeout_s` bounds.
CONTROL_MARGIN_S = 10.0
# How often `--exit-with-parent` checks the parent where pidfds are missing. (Not a parent-death
# signal: that fires when the parent's spawning *thread* exits, not the parent.)
PARENT_POLL_S = 0.5
# How long the ranks left after a failure (a rank died, or start-up failed) may take to exit on
# their own before SIGTERM. An idle rank sees the dead peer in its next collective and exits at
# once; one mid-update waits on it until the TP group's timeout: longer is a wait for nothing.
FAILED_STOP_GRACE_S = 2.0


@dataclass(kw_only=True, slots=True)
class ServeConfig:
    """Flags of `weightbus serve`; `__post_init__` names the flag to fix.

    Raises:
        ValueError: a flag is out of range.
    """

    model: str = TINY
    tp_size: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "float32"
    quantization: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    seed: int = 0
    served_model_name: str | None = None
    ready_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    dist_timeout_s: float = 60.0
    idle_wait_s: float = 0.05
    shutdown_timeout_s: float = 10.0
    api_token: str | None = field(default=None, repr=False)
    shm_weights: bool = True
    exit_with_parent: bool = False
    wait_for_initial_weights: bool = False
    draft_model: str | None = None
    draft_seed: int | None = None
    num_speculative_tokens: int = 0
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    lora_dtype: str = "float32"
    expert_parallel: bool = False
    expert_placement: str = "linear"
    redundant_experts: int = 0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.model != TINY and not (Path(self.model) / "config.json").is_file():
            raise ValueError(
                f"--model must be 'tiny' or a directory with config.json: {self.model}"
            )
        if self.tp_size < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp_size}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(
                f"--quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        self._check_draft()
        if self.lora_rank:
            lora_shape(self.lora_rank, self.lora_targets, self.lora_dtype)  # names a bad flag
        elif self.lora_targets:
            raise ValueError("--lora-targets needs --lora-rank")
        self.expert_layout()  # names a bad flag
        for name in ("ready_timeout_s", "request_timeout_s", "dist_timeout_s", "idle_wait_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        self._check_access()

    def expert_layout(self) -> ExpertLayout:
        """How a mixture-of-experts model holds its experts (`--expert-parallel`, ...)."""
        return expert_layout(self.expert_parallel, self.expert_placement, self.redundant_experts)

    def _check_draft(self) -> None:
        draft = self.draft_model
        if draft is not None and draft != TINY and not (Path(draft) / "config.json").is_file():
            raise ValueError(
                f"--draft-model must be 'tiny' or a directory with config.json: {draft}"
            )
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"--num-speculative-tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], got "
                f"{self.num_speculative_tokens}"
            )
        if (draft is None) != (self.num_speculative_tokens == 0):
            raise ValueError(
                "--draft-model and --num-speculative-tokens go together: a draft model "
                "proposes --num-speculative-tokens tokens per step"
            )

    def _check_access(self) -> None:
        token = self.api_token
        # visible ASCII: what an HTTP header carries unchanged
        if token is not None and re.fullmatch(r"[\x21-\x7e]+", token) is None:
            raise ValueError("--api-token must be non-empty visible ASCII without spaces")
        if token is None and not is_loopback(self.host):
            raise ValueError(
                f"--host {self.host} is reachable from other machines, which could then change "
                "the engine's weights: set --api-token (or WEIGHTBUS_API_TOKEN) to protect the "
                "admin routes, or bind a loopback address such as 127.0.0.1"
            )


def worker_config(
    config: ServeConfig,
    tp_rank: int,
    max_model_len: int,
    store: tuple[str, int],
    ipc_dir: str,
    *,
    parent_pid: int,
) -> WorkerConfig:
    """Rank `tp_rank`'s config: the serve flags, where the TP group meets (`store`: host and
    port of its TCPStore) and rank 0's socket directory."""
    return WorkerConfig(
        tp_rank=tp_rank,
        tp_size=config.tp_size,
        model=config.model,
        dtype=config.dtype,
        quantization=config.quantization,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens,
        seed=config.seed,
        store_host=store[0],
        store_port=store[1],
        ipc_dir=ipc_dir,
        dist_timeout_s=config.dist_timeout_s,
        idle_wait_s=config.idle_wait_s,
        parent_pid=parent_pid,
        shm_weights=config.shm_weights,
        wait_for_initial_weights=config.wait_for_initial_weights,
        draft_model=config.draft_model,
        draft_seed=config.seed if config.draft_seed is None else config.draft_seed,
        num_speculative_tokens=config.num_speculative_tokens,
        lora_rank=config.lora_rank,
        lora_targets=config.lora_targets,
        lora_dtype=config.lora_dtype,
        expert_parallel=config.expert_parallel,
        expert_placement=config.expert_placement,
        redundant_experts=config.redundant_experts,
        enable_prefix_caching=config.enable_prefix_caching,
    )


def checked_model(config: ServeConfig) -> tuple[ModelConfig, int]:
    """The model's config and the engine's max model length, checked against the flags.

    Raises:
        ValueError: the model cannot be served with these flags (names the flag or field).
    """
    lora = lora_shape(config.lora_rank, config.lora_targets, config.lora_dtype)
    model_config = resolve_config(config.model, config.quantization, lora, config.expert_layout())
    model_config.validate_tp(config.tp_size)
    max_model_len = config.max_model_len or min(
        model_config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN
    )
    if max_model_len > model_config.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings "
            f"({model_config.max_position_embeddings})"
        )
    if config.draft_model is not None:
        _check_draft_model(resolve_config(config.draft_model), model_config, config, max_model_len)
    return model_config, max_model_len


def _check_draft_model(
    draft: ModelConfig, main: ModelConfig, config: ServeConfig, max_model_len: int
) -> None:
    """A draft must share the main model's vocabulary, shard over the same TP ranks and hold
    a whole sequence."""
    if draft.quantization is not None:
        raise ValueError(
            "--draft-model is an FP8 checkpoint: a draft is served and pushed in the serving "
            "dtype (pushes quantize the policy only); give an unquantized draft"
        )
    if draft.vocab_size != main.vocab_size:
        raise ValueError(
            f"--draft-model has vocab_size {draft.vocab_size}, the model {main.vocab_size}: "
            "a draft proposes tokens of the main model's vocabulary"
        )
    try:
        draft.validate_tp(config.tp_size)
    except ValueError as exc:
        raise ValueError(f"--draft-model: {exc}") from None
    if max_model_len > draft.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {max_model_len} exceeds the draft model's "
            f"max_position_embeddings ({draft.max_position_embeddings})"
        )


def app_config(config: ServeConfig, model_config: ModelConfig, ipc_dir: str) -> AppConfig:
    """The API server's settings for these flags (rank 0's sockets under `ipc_dir`)."""
    return AppConfig(
        model=config.model,
        served_model_name=config.served_model_name or Path(config.model).name,
        ipc_dir=ipc_dir,
        bos_token_id=model_config.bos_token_id,
        ready_timeout_s=config.ready_timeout_s,
        request_timeout_s=config.request_timeout_s,
        api_token=config.api_token,
        admin=AdminConfig(
            update_margin_s=UPDATE_MARGIN_S,
            control_timeout_s=config.request_timeout_s + CONTROL_MARGIN_S,
        ),
    )


def http_server(app: FastAPI, config: ServeConfig) -> "Server":
    """uvicorn serving `app`, with weightbus's log format and no signal handling of its own."""
    return Server(
        uvicorn.Config(
            app,
            log_config=None,  # keep weightbus.core.log's format
            access_log=False,
            timeout_graceful_shutdown=int(config.shutdown_timeout_s),
        )
    )


class Launcher:
    """The worker processes and what they share: the TCPStore and the socket directory."""

    def __init__(self, config: ServeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.ipc_dir = ""
        self.store = None
        self.procs: list[subprocess.Popen] = []
        self.stop_requested = False

    def start_workers(self) -> None:
        """Create the socket directory and the rendezvous store; start one process per rank."""
        from weightbus.core.store import serve_store

        self.ipc_dir = tempfile.mkdtemp(prefix="weightbus-")  # mode 0700: private
        # loopback only; the OS picks a free port, workers learn it from their config
        self.store = serve_store(
            "127.0.0.1", 0, world_size=None, timeout_s=self.config.dist_timeout_s
        )
        env = dict(os.environ)
        env.setdefault("WEIGHTBUS_LOG_LEVEL", logging.getLevelName(logging.getLogger().level))
        if sys.platform.startswith("linux"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all ranks share this host
        for rank in range(self.config.tp_size):
            worker_config = self._worker_config(rank)
            cmd = [sys.executable, "-m", "weightbus.engines.reference.engine.worker", worker_config]
            # own session: a terminal's Ctrl-C reaches the launcher only, which stops the ranks
            proc = subprocess.Popen(  # noqa: S603 - argv is this interpreter, our module, our JSON
                cmd, env=env, start_new_session=True
            )
            self.procs.append(proc)
        logger.info("started %d worker(s): pids %s", len(self.procs), [p.pid for p in self.procs])

    def _worker_config(self, rank: int) -> str:
        store = ("127.0.0.1", self.store.port)
        config = worker_config(
            self.config, rank, self.max_model_len, store, self.ipc_dir, parent_pid=os.getpid()
        )
        return msgspec.json.encode(config).decode()

    def failure(self) -> str | None:
        """Why the engine cannot serve: a worker exited (None while all run)."""
        exited = [
            f"worker rank {rank} exited with code {proc.returncode}"
            for rank, proc in enumerate(self.procs)
            if proc.poll() is not None
        ]
        return "; ".join(exited) or None

    def stop_workers(self) -> None:
        """Wait for the workers to exit after Shutdown (`shutdown_timeout_s`; after a failure,
        at most `FAILED_STOP_GRACE_S`: the TP group lost a rank); terminate, then kill,
        stragglers."""
        timeout_s = self.config.shutdown_timeout_s
        grace_s = timeout_s if self.stop_requested else min(timeout_s, FAILED_STOP_GRACE_S)
        for stop in (None, subprocess.Popen.terminate, subprocess.Popen.kill):
            alive = [p for p in self.procs if p.poll() is None]
            if not alive:
                break
            for proc in alive:
                if stop is not None:
                    logger.warning("worker pid %d still running: %s", proc.pid, stop.__name__)
                    stop(proc)
            deadline = time.monotonic() + (grace_s if stop is None else timeout_s)
            for proc in alive:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop the workers and remove what the launcher created."""
        self.stop_workers()
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


class _Hooks:
    """`EngineHooks` of the app: ties engine events to the launcher and the uvicorn server."""

    def __init__(self, launcher: Launcher, url: str, on_ready: Callable[[str], None]) -> None:
        self.launcher = launcher
        self.url = url
        self._on_ready = on_ready
        self.server: Server | None = None
        self.exit_code = 0

    def failure(self) -> str | None:
        return self.launcher.failure()

    def stop_requested(self) -> bool:
        return self.launcher.stop_requested

    def on_ready(self) -> None:
        self._on_ready(self.url)

    def on_failure(self, reason: str) -> None:
        self.exit_code = 1
        if self.server is not None:
            self.server.should_exit = True


class Server(uvicorn.Server):
    """uvicorn, leaving signals to its owner (`serve`: `_handle_stop_signals`).

    (uvicorn's own handling re-raises a caught SIGTERM after shutdown, which would kill this
    process before the launcher's cleanup runs.)
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.contextmanager
def _handle_stop_signals(launcher: "Launcher", hooks: _Hooks) -> Iterator[None]:
    # Installed before anything is created, so a stop at any point runs the cleanup.
    def handle(sig: int, frame: object) -> None:
        launcher.stop_requested = True
        if hooks.server is not None:
            hooks.server.handle_exit(sig, frame)  # a second Ctrl-C forces the exit

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_when_orphaned(parent_pid: int) -> None:
    # Runs as a daemon thread: SIGTERM to itself takes the same clean stop as a user's SIGTERM.
    try:
        pidfd = os.pidfd_open(parent_pid)  # Linux >= 5.3
    except (AttributeError, OSError):
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
    else:
        select.select([pidfd], [], [])  # readable once the parent has exited
        os.close(pidfd)
    logger.warning("parent process %d exited: stopping", parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)


def listen(host: str, port: int) -> tuple[socket.socket, str]:
    """A listening socket on `host:port` (0: from the OS) and the URL it serves.

    Bound before any worker starts: a taken port fails fast, and `--port 0` is known.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        fix = f"stop what serves on port {port}, or pass another --port (--port 0: a free one)"
        # create_server's strerror names the address
        raise OSError(exc.errno, with_fix(exc.strerror, fix)) from None
    # Accepted connections inherit TCP_NODELAY (Linux): without it a response written as
    # headers then body waits ~40 ms for the client's delayed ACK on every keep-alive request.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    bound_host, bound_port = sock.getsockname()[:2]
    url_host = f"[{bound_host}]" if family == socket.AF_INET6 else bound_host
    return sock, f"http://{url_host}:{bound_port}"


def serve(config: ServeConfig, on_ready: Callable[[str], None]) -> int:
    """Run the engine until SIGINT/SIGTERM or a worker failure.

    Args:
        config: flags.
        on_ready: called with the server's URL once it accepts requests.

    Returns:
        Process exit code: 0 after a requested stop, 1 after a failure.

    Raises:
        ValueError: the model cannot be served with these flags (names the flag or field).
        OSError: the port cannot be bound.
    """
    parent_pid = os.getppid()  # before anything slow: a parent gone already is seen at once
    model_config, max_model_len = checked_model(config)
    sock, url = listen(config.host, config.port)
    launcher = Launcher(config, max_model_len)
    hooks = _Hooks(launcher, url, on_ready)
    with _handle_stop_signals(launcher, hooks):
        if config.exit_with_parent:
            threading.Thread(
                target=_stop_when_orphaned, args=(parent_pid,), name="parent-watch", daemon=True
            ).start()
        try:
            launcher.start_workers()
            app = create_app(app_config(config, model_config, launcher.ipc_dir), hooks)
            hooks.server = http_server(app, config)
            if not launcher.stop_requested:
                hooks.server.run(sockets=[sock])
        except SystemExit:  # uvicorn's exit when the app's start-up failed
            hooks.exit_code = 0 if launcher.stop_requested else 1
        finally:
            launcher.close()
            sock.close()
    logger.info("stopped")
    return hooks.exit_code
