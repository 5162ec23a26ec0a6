"""Rendezvous stores (torch `TCPStore`) that listen only where they are asked to.

A `TCPStore` server listens on every interface whatever host it is given: the engine's
launcher (`127.0.0.1`) and a publisher serving a weights group on a loopback address would be
reachable from other machines. `serve_store` binds the listening socket itself and hands it to
the store, so a loopback host means a loopback-only store.
"""

import ipaddress
import os
import socket
from datetime import timedelta

from torch.distributed import TCPStore


def is_loopback_host(host: str) -> bool:
    """Whether every address `host` resolves to is a loopback address (False if it does not
    resolve)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(
        ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos
    )


def _listener(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.bind(address)
        listener.listen()
    except OSError:
        listener.close()
        raise
    return listener


def serve_store(host: str, port: int, *, world_size: int | None, timeout_s: float) -> TCPStore:
    """Serve a `TCPStore` on `host:port` (0: a port from the OS; read `store.port`).

    A loopback `host` gets a store listening on that address only; any other host, a store
    listening on every interface (torch's behaviour: the address engines use may be one this
    host cannot bind, behind NAT).

    Args:
        host: the address clients connect to.
        port: the port, 0 for any free one.
        world_size: clients + 1, or None for any number.
        timeout_s: bound of the store's operations.

    Returns:
        The master store (it does not wait for its clients).
    """
    timeout = timedelta(seconds=timeout_s)
    if not is_loopback_host(host):
        return TCPStore(
            host, port, world_size, is_master=True, wait_for_workers=False, timeout=timeout
        )
    listener = _listener(host, port)
    bound_port = listener.getsockname()[1]
    fd = listener.detach()  # the store owns the socket from here (it closes it)
    try:
        return TCPStore(
            host,
            bound_port,
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=timeout,
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise
