"""The TCP connections of a round's process group, found in ``/proc`` and cut.

gloo cannot be aborted: a collective blocked on a frozen peer returns only at the
group's timeout. Shutting down (``shutdown(SHUT_RDWR)``) this process's own
connections of the group makes every blocked collective on either side fail at once
("Connection closed by peer"), which turns a frozen peer into a dead one.

Which connections belong to the group is found strictly: the socket descriptors of
this process that appeared while the group was built (``/proc/self/fd``), connected
over TCP (``/proc/self/net/tcp`` and ``tcp6``), and not to an etcd endpoint (the
rendezvous client's own connections, which may open at the same moment). The
choice (:func:`group_connections`) and the reading of ``/proc`` text
(:func:`parse_tcp_table`, :func:`socket_inode`) are pure and tested with plain data.
Linux only: where ``/proc/self/fd`` does not exist :func:`snapshot` returns ``None``
and nothing is cut (the group's timeout is then the bound).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ESTABLISHED",
    "LISTEN",
    "Conn",
    "closed_by_peer",
    "cut",
    "group_connections",
    "open_sockets",
    "parse_tcp_table",
    "read_tcp_table",
    "snapshot",
    "socket_inode",
]

log = logging.getLogger(__name__)

#: TCP states as ``/proc/net/tcp`` writes them (include/net/tcp_states.h).
ESTABLISHED = 0x01
CLOSE_WAIT = 0x08
LISTEN = 0x0A

_PROC_FD = Path("/proc/self/fd")
_PROC_TCP = (Path("/proc/self/net/tcp"), Path("/proc/self/net/tcp6"))
_SOCKET_LINK = re.compile(r"socket:\[([0-9]{1,20})\]")
_HEX = re.compile(r"[0-9A-Fa-f]+")

_V4_MAPPED = bytes(10) + b"\xff\xff"

Addr = tuple[str, int]


@dataclass(frozen=True)
class Conn:
    """One TCP socket of this host, as ``/proc/net/tcp`` lists it."""

    inode: int
    local: Addr
    remote: Addr
    state: int


def socket_inode(link: str) -> int | None:
    """The inode of a ``/proc/self/fd`` link ``socket:[N]``; ``None`` for anything else."""
    found = _SOCKET_LINK.fullmatch(link)
    return int(found.group(1)) if found else None


def _hex(text: str, digits: int, what: str) -> int:
    if len(text) != digits or not _HEX.fullmatch(text):
        raise ValueError(f"bad {what} {text!r} in the TCP table")
    return int(text, 16)


def _address(text: str) -> Addr:
    """``0100007F:0CEA`` (IPv4) or 32 hex digits ``:port`` (IPv6), each 32-bit word
    in the host's byte order, as the kernel writes them (little-endian on the
    machines this runs on); an IPv4-mapped IPv6 address as its IPv4 address."""
    host, sep, port = text.partition(":")
    if not sep:
        raise ValueError(f"bad address {text!r} in the TCP table")
    number = _hex(port, 4, "port")
    if len(host) not in (8, 32):
        raise ValueError(f"bad address {text!r} in the TCP table")
    words = [_hex(host[i : i + 8], 8, "address") for i in range(0, len(host), 8)]
    raw = b"".join(w.to_bytes(4, "little") for w in words)
    if raw[:12] == _V4_MAPPED:  # ::ffff:a.b.c.d is the IPv4 address a.b.c.d
        raw = raw[12:]
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, raw), number


def parse_tcp_table(text: str) -> dict[int, Conn]:
    """The sockets of one ``/proc/net/tcp`` or ``tcp6`` text, by inode (inode 0, a
    socket no process holds any more, left out).

    Raises:
        ValueError: a line that is not the kernel's format.
    """
    lines = text.splitlines()
    if not lines or not lines[0].split() or lines[0].split()[0] != "sl":
        raise ValueError("the TCP table has no header line")
    table: dict[int, Conn] = {}
    for line in lines[1:]:
        fields = line.split()
        if not fields:
            continue
        if len(fields) < 10 or not fields[0].endswith(":") or not fields[9].isdigit():
            raise ValueError(f"bad line in the TCP table: {line!r}")
        local, remote = _address(fields[1]), _address(fields[2])
        state = _hex(fields[3], 2, "state")
        inode = int(fields[9])
        if inode:
            table[inode] = Conn(inode, local, remote, state)
    return table


def group_connections(
    before: Iterable[int],
    fds: Mapping[int, int],
    table: Mapping[int, Conn],
    excluded: Iterable[Addr],
    excluded_ports: Iterable[int] = (),
) -> dict[int, Conn]:
    """The connections of a process group built between two snapshots: of the
    descriptors ``fds`` (fd -> socket inode) after it was built, those whose socket
    was not open before (``before``: inodes), is TCP and connected (not listening),
    and whose remote end is neither an address of ``excluded`` nor (for endpoints
    whose address is not known) a port of ``excluded_ports``; by fd."""
    old, avoid, ports = set(before), set(excluded), set(excluded_ports)
    chosen: dict[int, Conn] = {}
    for fd, inode in sorted(fds.items()):
        conn = table.get(inode)
        if inode in old or conn is None or conn.state == LISTEN or conn.remote[1] == 0:
            continue
        if conn.remote in avoid or conn.remote[1] in ports:
            continue
        chosen[fd] = conn
    return chosen


def closed_by_peer(conns: Mapping[int, Conn], table: Mapping[int, Conn]) -> bool:
    """Whether a peer closed one of ``conns`` (its socket gone from ``table``, a reset,
    or half-closed by the other end, ``CLOSE_WAIT``): read before this process cuts
    any of them itself."""
    for conn in conns.values():
        now = table.get(conn.inode)
        if now is None or now.state == CLOSE_WAIT:
            return True
    return False


# -- reading /proc and cutting (Linux) ---------------------------------------------------


def open_sockets() -> dict[int, int] | None:
    """This process's socket descriptors (fd -> inode); ``None`` without ``/proc``."""
    try:
        names = os.listdir(_PROC_FD)
    except OSError:
        return None
    found: dict[int, int] = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            inode = socket_inode(os.readlink(_PROC_FD / name))
        except OSError:  # closed since the listing
            continue
        if inode is not None:
            found[int(name)] = inode
    return found


def read_tcp_table() -> dict[int, Conn]:
    """This network namespace's TCP sockets (IPv4 and IPv6), by inode.

    Raises:
        OSError: ``/proc`` cannot be read.
        ValueError: its text is not the kernel's format.
    """
    table: dict[int, Conn] = {}
    for path in _PROC_TCP:
        if path.exists():
            table.update(parse_tcp_table(path.read_text(encoding="ascii")))
    return table


def snapshot() -> set[int] | None:
    """The socket inodes this process holds now; ``None`` where ``/proc`` is missing."""
    fds = open_sockets()
    return None if fds is None else set(fds.values())


def cut(fd: int, inode: int) -> bool:
    """Shut down (both directions) the connection on ``fd`` if it still is socket
    ``inode``; the descriptor stays open (its owner closes it). Returns whether it was
    cut. Works on a duplicate, so a descriptor closed and reused meanwhile is never
    touched."""
    try:
        dup = os.dup(fd)
    except OSError:
        return False
    try:
        info = os.fstat(dup)
        if not stat.S_ISSOCK(info.st_mode) or info.st_ino != inode:
            return False
        sock = socket.socket(fileno=dup)
        dup = -1  # the socket object owns it now
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed by the other end
            return False
        finally:
            sock.close()
        return True
    finally:
        if dup >= 0:
            os.close(dup)
