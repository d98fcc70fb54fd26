"""The pure parts of etcd_rdzv.inprocess: reading /proc's TCP table and fd links,
choosing a process group's connections, telling a peer's close, when a round
is broken, the arguments a round's group takes itself; and a real cut of a connected
socket pair over loopback."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from etcd_rdzv.inprocess import Round
from etcd_rdzv.inprocess.guard import Guard, round_broken
from etcd_rdzv.inprocess.sockets import (
    ESTABLISHED,
    LISTEN,
    Conn,
    closed_by_peer,
    cut,
    group_connections,
    open_sockets,
    parse_tcp_table,
    read_tcp_table,
    socket_inode,
)

HEADER = (
    "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt"
    "   uid  timeout inode"
)
TAIL = "00000000:00000000 00:00000000 00000000     0        0"
TABLE = "\n".join(
    [
        HEADER,
        f"   0: 0100007F:0CEA 00000000:0000 0A {TAIL} 101 1 0000000000000000 100 0 0 10 0",
        f"   1: 0100007F:D431 0100007F:0CEA 01 {TAIL} 102 1 0000000000000000 20 4 30 10 -1",
        f"   2: 0100007F:0CEA 0100007F:D431 08 {TAIL} 103 1 0000000000000000 20 4 30 10 -1",
        f"   3: 0100007F:D432 0100007F:0CEB 06 {TAIL} 0 3 0000000000000000",
    ]
)
V6 = "\n".join(
    [
        HEADER,
        "   0: 0000000000000000FFFF00000100007F:DBD3 0000000000000000FFFF00000100007F:C3E2"
        f" 01 {TAIL} 201 1 0",
        "   1: 00000000000000000000000001000000:1F90 00000000000000000000000000000000:0000"
        f" 0A {TAIL} 202 1 0",
    ]
)


def test_the_tcp_table_is_read_by_inode() -> None:
    table = parse_tcp_table(TABLE)
    assert sorted(table) == [101, 102, 103]  # inode 0 (no process holds it) left out
    assert table[101] == Conn(101, ("127.0.0.1", 3306), ("0.0.0.0", 0), LISTEN)
    assert table[102] == Conn(102, ("127.0.0.1", 54321), ("127.0.0.1", 3306), ESTABLISHED)
    assert table[103].state == 0x08


def test_ipv6_addresses_and_mapped_ipv4() -> None:
    table = parse_tcp_table(V6)
    assert table[201].local == ("127.0.0.1", 56275)
    assert table[201].remote == ("127.0.0.1", 50146)
    assert table[202].local == ("::1", 8080)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not a header\n",
        HEADER + "\n   0: 0100007F:0CEA 00000000:0000 0A",  # too short
        HEADER + f"\n   0: 0100007G:0CEA 00000000:0000 0A {TAIL} 5 1",  # not hex
        HEADER + f"\n   0: 0100007F:CEA 00000000:0000 0A {TAIL} 5 1",  # short port
        HEADER + f"\n   0: 0100007F0CEA 00000000:0000 0A {TAIL} 5 1",  # no colon
        HEADER + f"\n   0: 0100007F:0CEA 00000000:0000 0A {TAIL} x5 1",  # inode
        HEADER + f"\n   0: 0100:0CEA 00000000:0000 0A {TAIL} 5 1",  # address length
        HEADER + f"\n   0 0100007F:0CEA 00000000:0000 0A {TAIL} 5 1",  # no "sl:"
    ],
)
def test_a_table_not_in_the_kernel_s_format_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_tcp_table(text)


@pytest.mark.parametrize(
    ("link", "inode"),
    [
        ("socket:[12345]", 12345),
        ("socket:[]", None),
        ("socket:[12a]", None),
        ("pipe:[12345]", None),
        ("/dev/null", None),
        ("socket:[1] ", None),
    ],
)
def test_fd_links(link: str, inode: int | None) -> None:
    assert socket_inode(link) == inode


ETCD = ("127.0.0.1", 2379)


def _conn(inode: int, remote: tuple[str, int], state: int = ESTABLISHED) -> Conn:
    return Conn(inode, ("127.0.0.1", 40000 + inode), remote, state)


@pytest.mark.parametrize(
    ("case", "conn", "before", "chosen"),
    [
        ("a new connection to a peer", _conn(7, ("127.0.0.1", 5000)), set(), True),
        ("open before the group", _conn(7, ("127.0.0.1", 5000)), {7}, False),
        ("the group's listening socket", _conn(7, ("0.0.0.0", 0), LISTEN), set(), False),
        ("to an etcd endpoint", _conn(7, ETCD), set(), False),
        ("to an etcd port of a host not resolved", _conn(7, ("10.0.0.9", 2380)), set(), False),
        ("not TCP (not in the table)", None, set(), False),
    ],
)
def test_which_connections_are_the_group_s(
    case: str, conn: Conn | None, before: set[int], chosen: bool
) -> None:
    table = {} if conn is None else {7: conn}
    found = group_connections(before, {12: 7}, table, {ETCD}, {2380})
    assert (found == {12: conn}) if chosen else (found == {}), case


def test_a_peer_s_close_is_told_apart_from_our_own_connections() -> None:
    mine = {3: _conn(1, ("127.0.0.1", 5000)), 4: _conn(2, ("127.0.0.1", 5001))}
    assert not closed_by_peer(mine, {1: mine[3], 2: mine[4]})
    assert closed_by_peer(mine, {1: mine[3]})  # reset: gone from the table
    half = _conn(2, ("127.0.0.1", 5001), 0x08)  # CLOSE_WAIT: the peer closed
    assert closed_by_peer(mine, {1: mine[3], 2: half})


@pytest.mark.parametrize(
    ("world", "waiting", "live", "broken"),
    [
        (3, 0, 2, False),  # all there
        (3, 1, 2, False),  # a node waits to join: a scale-up, not broken
        (3, 1, 1, True),  # a member gone
        (3, 2, 0, True),  # two gone
        (3, 0, 0, False),  # the run closed (a member finished first)
        (1, 1, 0, False),  # alone, a node waiting
    ],
)
def test_when_a_round_is_broken(world: int, waiting: int, live: int, broken: bool) -> None:
    assert round_broken(world, waiting, live) is broken


def test_the_guard_fires_once_when_the_round_breaks_and_stops_when_asked() -> None:
    counts = [(0, 2)]
    fired: list[float] = []
    guard = Guard(3, lambda: counts[-1], lambda: fired.append(time.monotonic()), interval=0.01)
    guard.start()
    time.sleep(0.1)
    assert fired == [] and not guard.fired.is_set()
    counts.append((1, 1))
    assert guard.fired.wait(5)
    guard.stop()
    assert len(fired) == 1
    idle = Guard(3, lambda: (0, 2), lambda: fired.append(0.0), interval=0.01)
    idle.start()
    idle.stop()
    assert len(fired) == 1


def test_a_guard_whose_counts_fail_ends_without_firing() -> None:
    def counts() -> tuple[int, int]:
        raise RuntimeError("boom")

    guard = Guard(3, counts, lambda: None, interval=0.01)
    guard.start()
    guard.stop()
    assert not guard.fired.is_set()


def test_a_cut_connection_fails_a_blocked_receive_on_both_ends() -> None:
    """What the guard does to a collective blocked on a frozen peer, with a plain
    socket pair over loopback: the connection is found as new since a snapshot,
    cut through its descriptor, and a receive blocked on the other end returns."""
    server = socket.create_server(("127.0.0.1", 0))
    before = set((open_sockets() or {}).values())
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    fds = open_sockets()
    assert fds is not None
    found = group_connections(before, fds, read_tcp_table(), set(), set())
    assert client.fileno() in found and peer.fileno() in found
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(peer.recv(10)))
    reader.start()
    time.sleep(0.05)
    assert reader.is_alive()  # blocked, as on a frozen peer
    assert not closed_by_peer({client.fileno(): found[client.fileno()]}, read_tcp_table())
    assert cut(client.fileno(), found[client.fileno()].inode)
    reader.join(5)
    assert not reader.is_alive() and got == [b""]  # the other end sees the close
    assert closed_by_peer({peer.fileno(): found[peer.fileno()]}, read_tcp_table())
    # A descriptor that is not that socket any more is never touched.
    assert not cut(peer.fileno(), found[client.fileno()].inode)
    for s in (client, peer, server):
        s.close()


@pytest.mark.parametrize("given", ["store", "rank", "world_size", "timeout", "init_method"])
def test_the_round_s_group_takes_its_own_store_rank_size_and_timeout(given: str) -> None:
    rnd = Round(
        None,  # type: ignore[arg-type]  # never reached: the arguments are refused first
        rank=0,
        world_size=1,
        round_no=1,
        call=0,
        failures=0,
        store=None,  # type: ignore[arg-type]
        members=("a",),
        pg_timeout=30.0,
        etcd=(set(), set()),
    )
    with pytest.raises(ValueError, match=rf"sets \['{given}'\] itself.*pg_timeout"):
        rnd.init_process_group("gloo", **{given: 1})
