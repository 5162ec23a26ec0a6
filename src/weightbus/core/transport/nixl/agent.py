"""The NIXL agents of this process, with the memory they registered and the peers they know.

Agents live as long as the process: each engine rank keeps one (`rank_agent`), its parameter
arenas registered once and kept registered while they exist; publishers share one per UCX
setting (`publisher_agent`), each sender registering its own send buffers. (Destroying an agent
while the interpreter collects garbage can crash it, and a UCX context is costly to make.)
Importing NIXL happens here, on first use.
"""

import atexit
import contextlib
import fcntl
import logging
import os
import re
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from weightbus.core.fixes import with_fix
from weightbus.core.transport.parts.arena import on_arena_close

logger = logging.getLogger(__name__)

# Between two looks at the transfers' state, when none finished (NIXL has no blocking wait).
POLL_PAUSE_S = 0.0002


def _nixl_api() -> Any:
    # NIXL logs every agent it makes at INFO on stdout, which is the trainer's (and the engine
    # prints its URL there): warnings and worse only, unless the user chose a level
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        from nixl import _api
    except ImportError as exc:
        raise ValueError(
            with_fix(
                f"transport nixl needs NIXL, which this Python cannot import: {exc}",
                "pip install 'weightbus[nixl]' (or pick another transport, e.g. 'shm')",
            )
        ) from None
    return _api


@contextlib.contextmanager
def _ucx_environment(settings: dict[str, str]) -> Iterator[None]:
    """UCX reads its settings from the environment when the backend is created: set the
    non-empty ones for that moment only."""
    settings = {name: value for name, value in settings.items() if value}
    previous = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# NIXL's progress thread with a delay of 0 (what its Python wrapper hard-codes) polls without
# blocking: ~20% of a core per agent, forever, in every engine rank and trainer that pushed over
# nixl (measured on this 2-core machine, where it slowed the whole test suite ~2x). With any
# delay the thread blocks in poll() until its sockets have work, so transfers are progressed
# as soon as bytes arrive; idle it costs ~0.5% of a core.
PROGRESS_THREAD_DELAY_US = 1000
_CONFIG_SWAP = threading.Lock()


def _agent_with_a_waiting_progress_thread(api: Any, name: str, config: Any) -> Any:
    """`api.nixl_agent(name, config)`, its progress thread given `PROGRESS_THREAD_DELAY_US`
    (the wrapper sets the C++ config's `pthrDelay` to 0; a NIXL without that field: as is)."""
    bindings = getattr(api, "nixlBind", None)
    base = getattr(bindings, "nixlAgentConfig", None)
    delay = getattr(base, "pthrDelay", None) if base is not None else None
    if not isinstance(delay, property):
        return api.nixl_agent(name, config)

    class _Config(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 - NIXL's field name
            return delay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:  # noqa: N802
            delay.__set__(self, max(value, PROGRESS_THREAD_DELAY_US))

    with _CONFIG_SWAP:  # agents made on other threads meanwhile see NIXL's own class again
        bindings.nixlAgentConfig = _Config
        try:
            return api.nixl_agent(name, config)
        finally:
            bindings.nixlAgentConfig = base


# UCX transports unless told otherwise: all but the shared-memory (mm) ones, which open
# abstract unix sockets any local process can reach. On one host CMA then copies each WRITE
# once, process to process; across hosts RDMA or TCP carry it as before.
DEFAULT_UCX_TLS = "^sysv,posix"
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def _interface_address(sock: socket.socket, name: str) -> str | None:
    request = struct.pack("256s", name.encode()[:15])
    try:
        reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
    except OSError:  # no IPv4 address on this interface
        return None
    return socket.inet_ntoa(reply[20:24])


def interface_towards(host: str) -> str:
    """The name of the local network interface that traffic to `host` leaves from ("" when
    it cannot be told, e.g. IPv6): UCX is kept to it, so its sockets listen there only."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, 9))  # a UDP connect sends nothing: it only picks the route
            local = sock.getsockname()[0]
        except OSError:
            return ""
        for _, name in socket.if_nameindex():
            if _interface_address(sock, name) == local:
                return name
    return ""


class Agent:
    """One NIXL agent with a UCX backend, and the memory it registered (by key).

    Args:
        role: part of the agent's name (`publisher`, `rank0`, ...).
        ucx_devices: network devices UCX may use (`UCX_NET_DEVICES`, e.g. "eth1"; "" = all).
        ucx_tls: UCX transports (`UCX_TLS`, e.g. "tcp"; "all" = UCX's choice).

    Raises:
        ValueError: NIXL is not installed or has no UCX backend.
    """

    def __init__(self, role: str, *, ucx_devices: str = "", ucx_tls: str = DEFAULT_UCX_TLS) -> None:
        api = _nixl_api()
        host = re.sub(r"[^0-9A-Za-z_.-]", "_", socket.gethostname())[:40]
        self.name = f"weightbus-{role}-{host}-{os.getpid()}-{secrets.token_hex(4)}"
        # several senders (and their threads) may share one agent: NIXL serialises the calls
        config = api.nixl_agent_config(
            backends=[], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        )
        self._agent = _agent_with_a_waiting_progress_thread(api, self.name, config)
        if "UCX" not in self._agent.get_plugin_list():
            raise ValueError("transport nixl: this NIXL build has no UCX backend")
        with _ucx_environment({"UCX_TLS": ucx_tls, "UCX_NET_DEVICES": ucx_devices}):
            self._agent.create_backend("UCX")
        self._registered: dict[str, tuple[Any, torch.Tensor]] = {}
        self._remotes: dict[str, bytes] = {}  # peer agent name -> the metadata loaded
        self._lock = threading.Lock()

    @property
    def nixl(self) -> Any:
        """The `nixl_agent` itself (transfers, descriptor lists, remote agents)."""
        return self._agent

    def metadata(self) -> bytes:
        """What a peer needs to write into this agent's registered memory."""
        return self._agent.get_agent_metadata()

    def register(self, key: str, memory: torch.Tensor) -> None:
        """Register `memory` (a contiguous CPU tensor) under `key`, once; the agent keeps a
        reference, so the memory stays mapped while registered."""
        with self._lock:
            if key in self._registered and self._registered[key][1] is memory:
                return
            self._forget(key)
            descs = self._agent.register_memory(memory)
            self._registered[key] = (descs, memory)

    def forget(self, key: str) -> None:
        """Deregister the memory registered under `key` (if any)."""
        with self._lock:
            self._forget(key)

    def _forget(self, key: str) -> None:
        entry = self._registered.pop(key, None)
        if entry is not None:
            self._agent.deregister_memory(entry[0])

    def load_remote(self, name: str, metadata: bytes, peer: str) -> None:
        """Know agent `name` by its metadata (again when it changed: it registered more
        memory); `peer` names its owner (e.g. "engine 0 rank 1") in errors.

        Raises:
            RuntimeError: NIXL cannot load it (e.g. no UCX transport reaches the peer).
            ValueError: the metadata is another agent's.
        """
        with self._lock:
            if self._remotes.get(name) == metadata:
                return
            self._forget_remote(name)
            try:
                loaded = self._agent.add_remote_agent(metadata)
            except Exception as exc:  # noqa: BLE001 - NIXL raises its own error types
                raise RuntimeError(f"{peer}: cannot reach its NIXL agent: {exc}") from None
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            if loaded != name:
                self._agent.remove_remote_agent(loaded)
                raise ValueError(f"{peer}: it sent the metadata of agent {loaded!r}, not {name!r}")
            self._remotes[name] = metadata

    def write(self, local: Any, remote: Any, peer: str, what: str) -> Any:
        """Post one WRITE of `local` onto `remote` in agent `peer`'s memory (descriptor rows:
        address, bytes, device 0); its transfer handle.

        Raises:
            RuntimeError: NIXL refused it (it names `what`; the handle released).
        """
        nixl = self._agent
        handle = nixl.initialize_xfer(
            "WRITE", nixl.get_xfer_descs(local, "DRAM"), nixl.get_xfer_descs(remote, "DRAM"), peer
        )
        state = "ERR"
        try:
            state = nixl.transfer(handle)
        finally:
            if state == "ERR":  # refused, or the call raised
                release(handle)
        if state == "ERR":
            raise RuntimeError(f"NIXL refused the write of {what}")
        return handle

    def reap(self, pending: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """The transfers of `pending` (handle, what it writes, ...) that ended, released and
        taken out of it.

        Raises:
            RuntimeError: NIXL failed one (named; released and taken out).
        """
        ended = []
        for item in list(pending):
            state = self._agent.check_xfer_state(item[0])
            if state != "PROC":
                pending.remove(item)
                item[0].release()
                if state != "DONE":
                    raise RuntimeError(f"NIXL write of {item[1]} failed ({state})")
                ended.append(item)
        return ended

    def wait(self, pending: list[tuple[Any, str]], deadline: float) -> float:
        """Until every transfer of `pending` (`reap`) ended; the `time.perf_counter()` when
        the last one had, before they are released (`pending` is then empty).

        Raises:
            TimeoutError: one did not complete by `deadline` (`time.monotonic()`; named).
            RuntimeError: NIXL failed one (named).
        """
        while late := [w for h, w in pending if self._agent.check_xfer_state(h) == "PROC"]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"NIXL write of {late[0]} not complete in time")
            time.sleep(POLL_PAUSE_S)
        ended = time.perf_counter()
        self.reap(pending)
        return ended

    def forget_remote(self, name: str) -> None:
        """Disconnect from peer `name` (cancelling what is in flight to it)."""
        with self._lock:
            self._forget_remote(name)

    def close(self) -> None:
        """Destroy the agent. NIXL then releases the transfers a failure left behind before
        it deregisters their memory, which stays mapped until then (referenced here)."""
        with self._lock:
            self._agent = None
            self._remotes.clear()
            self._registered.clear()

    def _forget_remote(self, name: str) -> None:
        if self._remotes.pop(name, None) is None:
            return
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own error types
            logger.warning("nixl: cannot disconnect from %s: %s", name, exc)


def release(handle: Any) -> None:
    """Release a transfer handle, cancelling the transfer if it is still in flight."""
    try:
        handle.release()
    except Exception as exc:  # noqa: BLE001 - NIXL raises its own error types
        logger.warning("nixl: a transfer could not be released: %s", exc)


class SendBuffers:
    """Registered send buffers of an agent (`key` names their registrations), kept across
    pushes and made anew when a push needs other ones."""

    def __init__(self, agent: Agent, key: str) -> None:
        self._agent, self._key = agent, key
        self._buffers: list[torch.Tensor] = []

    def ready(self, count: int, nbytes: int) -> list[torch.Tensor]:
        """`count` registered buffers of `nbytes` at least."""
        if len(self._buffers) != count or self._buffers[0].numel() < nbytes:
            self.close()
            for index in range(count):
                buffer = torch.zeros(nbytes, dtype=torch.uint8)  # pages faulted in once, here
                self._agent.register(f"{self._key}-{index}", buffer)
                self._buffers.append(buffer)
        return self._buffers

    def close(self) -> None:
        """Deregister and free the buffers."""
        for index in range(len(self._buffers)):
            self._agent.forget(f"{self._key}-{index}")
        self._buffers = []


_rank_agents: dict[str, Agent] = {}
_publisher_agents: dict[tuple[str, str], Agent] = {}
_agents_lock = threading.Lock()


@atexit.register
def _close_agents() -> None:
    """Destroy the agents while the interpreter still stands (at its teardown, UCX crashes)."""
    with _agents_lock:
        agents = [*_publisher_agents.values(), *_rank_agents.values()]
        _publisher_agents.clear()
        _rank_agents.clear()
    for agent in agents:
        agent.close()


def publisher_agent(host: str, *, ucx_devices: str = "", ucx_tls: str = DEFAULT_UCX_TLS) -> Agent:
    """This process's publisher agent for these UCX settings, made on first use (`ucx_devices`
    "": UCX kept to the interface that reaches `host`, the address engines reach it at)."""
    ucx_devices = ucx_devices or interface_towards(host)
    with _agents_lock:
        key = (ucx_devices, ucx_tls)
        if key not in _publisher_agents:
            _publisher_agents[key] = Agent("publisher", ucx_devices=ucx_devices, ucx_tls=ucx_tls)
        return _publisher_agents[key]


def _forget_arena(name: str) -> None:
    """A closed arena (memory released, engine stopping) is deregistered at once: the agent's
    reference would keep its memory mapped."""
    with _agents_lock:
        agents = list(_rank_agents.values())
    for agent in agents:
        agent.forget(name)


def rank_agent(rank: int, publisher_host: str) -> Agent:
    """This engine rank's agent towards a publisher at `publisher_host`, made on first use.

    UCX is kept to the interface that reaches the publisher and to `DEFAULT_UCX_TLS`, unless
    the rank's environment sets `UCX_NET_DEVICES` or `UCX_TLS`.
    """
    devices = os.environ.get("UCX_NET_DEVICES") or interface_towards(publisher_host)
    transports = os.environ.get("UCX_TLS") or DEFAULT_UCX_TLS
    on_arena_close(_forget_arena)
    with _agents_lock:
        if devices not in _rank_agents:
            _rank_agents[devices] = Agent(f"rank{rank}", ucx_devices=devices, ucx_tls=transports)
            logger.info(
                "NIXL agent %s ready (network devices: %s)",
                _rank_agents[devices].name,
                devices or "all",
            )
        return _rank_agents[devices]
