"""What a link carries: one TCP stream between two hosts, timed at the receiver.

`measure` runs this file (standard library only, so it starts fast) in both hosts: the receiver
listens on a port the OS picks and prints it, the sender connects and sends `nbytes`, the
receiver prints the payload rate from its first received chunk to its last (the tbf bucket's
burst in the first chunk is left out). Payload: TCP and IP headers are not counted, so an
Ethernet link at rate r carries about 0.96 r of payload (1448 of 1514 bytes per frame).
"""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

_CHUNK_BYTES = 1 << 20
_TIMEOUT_S = 120.0


def measure(cluster, sender, receiver, nbytes: int) -> float:
    """Payload bits per second of one TCP stream of `nbytes` from `sender` to `receiver`
    (hosts of `cluster`; None: this namespace, over the unlimited gateway).

    Raises:
        RuntimeError: either side failed or did not finish within its timeout.
    """
    script = [sys.executable, "-I", str(Path(__file__))]
    address = cluster.gateway if receiver is None else receiver.address
    listener = _start(cluster, receiver, [*script, "receive", address, str(nbytes)])
    port = listener.stdout.readline().decode().strip()
    if not port:
        raise RuntimeError(f"the receiver on {_name(receiver)} did not start")
    talker = _start(cluster, sender, [*script, "send", address, port, str(nbytes)])
    try:
        out, _ = listener.communicate(timeout=_TIMEOUT_S)
        talker.wait(timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(
            f"{nbytes} bytes from {_name(sender)} to {_name(receiver)} "
            f"did not arrive within {_TIMEOUT_S} s"
        ) from exc
    if listener.returncode or talker.returncode:
        raise RuntimeError(f"a transfer side failed: {listener.returncode}, {talker.returncode}")
    return json.loads(out)["bits_per_s"]


def _start(cluster, host, argv: list[str]) -> subprocess.Popen:
    if host is None:
        return subprocess.Popen(argv, stdout=subprocess.PIPE)  # noqa: S603 - our own script
    return cluster.popen(host, argv, stdout=subprocess.PIPE)


def _name(host) -> str:
    return "this namespace" if host is None else f"host {host.index}"


def _receive(address: str, nbytes: int) -> None:
    with socket.create_server((address, 0)) as server:
        server.settimeout(_TIMEOUT_S)
        print(server.getsockname()[1], flush=True)
        conn, _ = server.accept()
    buffer = memoryview(bytearray(_CHUNK_BYTES))
    with conn:
        conn.settimeout(_TIMEOUT_S)
        first_bytes = conn.recv_into(buffer)
        start = time.perf_counter()
        received = first_bytes
        while received < nbytes:
            got = conn.recv_into(buffer)
            if not got:
                raise ConnectionError(f"the sender stopped after {received} of {nbytes} bytes")
            received += got
        seconds = time.perf_counter() - start
    print(json.dumps({"bits_per_s": (received - first_bytes) * 8 / seconds}), flush=True)


def _send(address: str, port: int, nbytes: int) -> None:
    chunk = bytes(_CHUNK_BYTES)
    with socket.create_connection((address, port), timeout=_TIMEOUT_S) as conn:
        sent = 0
        while sent < nbytes:
            part = min(_CHUNK_BYTES, nbytes - sent)
            conn.sendall(chunk[:part])
            sent += part


if __name__ == "__main__":
    role, args = sys.argv[1], sys.argv[2:]
    if role == "receive":
        _receive(args[0], int(args[1]))
    else:
        _send(args[0], int(args[1]), int(args[2]))
