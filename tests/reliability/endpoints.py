"""What processes really bound: their sockets, read from /proc (Linux), and their /dev/shm files.

`open_sockets(pids)` joins each process's socket descriptors (`/proc/<pid>/fd`) with the kernel's
socket tables (`/proc/<pid>/net/{tcp,tcp6,udp,udp6,unix}`), so a test sees every endpoint a
process holds, whoever created it (weightbus, ZMQ, gloo, torch's TCPStore).
"""

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

TCP_LISTEN = "0A"
_SOCKET_LINK = re.compile(r"socket:\[(\d+)\]")
_INET_TABLES = ("tcp", "tcp6", "udp", "udp6")


@dataclass(frozen=True, slots=True)
class OpenSocket:
    """One socket of a process: `address` is an IP address, a unix path or '' (unnamed)."""

    pid: int
    table: str  # tcp, tcp6, udp, udp6 or unix
    address: str
    port: int | None
    listening: bool

    def describe(self) -> str:
        where = self.address if self.port is None else f"[{self.address}]:{self.port}"
        return f"pid {self.pid} {self.table} {where}{' LISTEN' if self.listening else ''}"


def _inet_address(hex_address: str) -> str:
    # /proc shows addresses as host-order 32-bit words
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def _inet_table(pid: int, table: str) -> dict[int, tuple[str, int, bool]]:
    entries = {}
    path = Path(f"/proc/{pid}/net/{table}")
    for line in path.read_text().splitlines()[1:]:
        fields = line.split()
        address, port = fields[1].split(":")
        entries[int(fields[9])] = (_inet_address(address), int(port, 16), fields[3] == TCP_LISTEN)
    return entries


def _unix_table(pid: int) -> dict[int, tuple[str, bool]]:
    entries = {}
    for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        listening = int(fields[3], 16) & 0x10000 != 0  # __SO_ACCEPTCON
        entries[int(fields[6])] = (fields[7] if len(fields) > 7 else "", listening)
    return entries


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            match = _SOCKET_LINK.fullmatch(str(fd.readlink()))
        except FileNotFoundError:  # closed meanwhile
            continue
        if match:
            inodes.add(int(match.group(1)))
    return inodes


def open_sockets(pids: list[int]) -> list[OpenSocket]:
    """Every socket the processes hold (TCP, UDP and unix; others such as netlink skipped)."""
    found = []
    for pid in pids:
        inodes = _socket_inodes(pid)
        for table in _INET_TABLES:
            for inode, (address, port, listening) in _inet_table(pid, table).items():
                if inode in inodes:
                    found.append(OpenSocket(pid, table, address, port, listening))
        for inode, (path, listening) in _unix_table(pid).items():
            if inode in inodes:
                found.append(OpenSocket(pid, "unix", path, None, listening))
    return found


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4-mapped loopback address."""
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)
