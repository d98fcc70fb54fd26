"""``etcd-rdzv status`` on a real etcd: what it shows of forged keys (escaped), of a
torch dynamic state written into etcd (decoded, never run), and ``--watch`` (one etcd
watch, a new drawing per change, Ctrl-C ends it with 0).

The CLI runs as users run it: ``python -m etcd_rdzv`` in a subprocess, every one with a
timeout; nothing waits on a fixed sleep.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import pickle
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousParameters, _keys
from etcd_rdzv._kv import KV
from etcd_rdzv.runs.status import DYNAMIC, NATIVE, RunStatus, read_run, watch_run
from etcd_rdzv.testing import CliProcess, EtcdRdzvCli, EtcdServer

from ..unit.test_torch_state import GOLDEN_COMPLETE, GOLDEN_FORMING

Params = Callable[..., RendezvousParameters]

TIMEOUT = 60  # seconds any one CLI call, or one expected line, may take


@pytest.fixture
def conn(etcd_server: EtcdServer, etcd_key_prefix: str) -> list[str]:
    return ["--endpoint", etcd_server.endpoint, "--key-prefix", etcd_key_prefix]


@pytest.fixture
def kv(etcd_params: Params) -> Iterator[KV]:
    client = etcd_rdzv.create_client(etcd_params("raw"))
    yield client
    client.close()


def _join_key(prefix: str, run: str, round_no: int, node: str, addr: str) -> tuple[str, str]:
    value = json.dumps({"id": node, "addr": addr, "prev_rank": None})
    return _keys.node_key(prefix, run, round_no, node), value


# -- escaping ----------------------------------------------------------------------------

FORGED = "a\n  0  fake  10.0.0.9  yes"
ANSI = "\x1b[2J\x1b[31mred\x1b[0m"
BIDI = "evil\u202etxt.exe"


def test_forged_node_ids_and_addresses_are_escaped(
    etcd_rdzv_cli: EtcdRdzvCli, conn: list[str], kv: KV, etcd_key_prefix: str
) -> None:
    run = "forged"
    # A completed round whose members are a forged id and an id with escape codes,
    # both alive, and a forged waiting node; all written raw, as an attacker would.
    result = {"members": [FORGED, ANSI], "addrs": ["h1", "h2"], "as_of": 1, "max_nodes": 3}
    kv.put(_keys.result_key(etcd_key_prefix, run, 1), json.dumps(result), 600)
    kv.put(*_join_key(etcd_key_prefix, run, 1, FORGED, "10.0.0.1\r\n  1  x  y  yes"), 600)
    kv.put(*_join_key(etcd_key_prefix, run, 1, ANSI, ANSI), 600)
    kv.put(*_join_key(etcd_key_prefix, run, 2, BIDI, "10.0.0.3"), 600)
    # A key that is no record, with control characters in its name: a warning names it.
    kv.put(_keys.rdzv_dir(etcd_key_prefix, run) + "/r1/nodes/x\x1b[2Jy\nz", "junk", 600)

    text = etcd_rdzv_cli.run("status", "--run-id", run, *conn)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert "\x1b" not in text.stdout and "\r" not in text.stdout
    assert "\u202e" not in text.stdout
    rows = [line for line in lines if line.startswith("  ")]
    rows = [row for row in rows if row.split()[0] not in ("rank", "round")]  # headers
    # Two member rows, one waiting row: no line drawn by the forged id.
    assert len(rows) == 3, text.stdout
    assert not any(line.strip().startswith("0  fake") for line in lines)
    assert "  0     a\\n  0  fake  10.0.0.9  yes" in text.stdout
    assert "10.0.0.1\\r\\n  1  x  y  yes" in text.stdout
    assert "\\x1b[2J\\x1b[31mred\\x1b[0m" in text.stdout
    assert "evil\\u202etxt.exe" in text.stdout
    assert "world size 2" in text.stdout
    # The warning about the stray key is escaped too, and nothing else is on stderr.
    assert "\x1b" not in text.stderr
    assert "x\\x1b[2Jy\\nz" in text.stderr

    # JSON keeps the values exactly (json.dumps escapes them), in plain ASCII.
    done = etcd_rdzv_cli.run("status", "--run-id", run, "--json", *conn)
    assert done.returncode == 0, done.stderr
    assert done.stdout.isascii() and "\x1b" not in done.stdout
    data = json.loads(done.stdout)
    assert [m["node"] for m in data["members"]] == [FORGED, ANSI]
    assert data["handler"] == NATIVE
    assert data["members"][0]["last_heartbeat"] is None  # a native run: no heartbeats
    assert data["members"][1]["addr"] == ANSI
    assert [w["node"] for w in data["waiting"]] == [BIDI]


def test_printable_escapes_what_a_terminal_acts_on() -> None:
    from etcd_rdzv.cli.status import printable

    assert printable("host-a_3f2c") == "host-a_3f2c"
    assert printable("nœud-é") == "nœud-é"  # printable non-ASCII stays
    assert printable("a\nb\tc\x00\x7f\x9b") == "a\\nb\\tc\\x00\\x7f\\x9b"
    assert printable("\u2028\u00a0") == "\\u2028\\xa0"
    # A literal backslash is doubled, so "\\n" (two characters) and "\n" differ.
    assert printable("a\\nb") == "a\\\\nb"
    assert printable("a\\nb") != printable("a\nb")


# -- torch's dynamic state, without torch --------------------------------------------------


def test_a_dynamic_state_in_etcd_is_shown_with_ranks_and_spares(
    etcd_rdzv_cli: EtcdRdzvCli, conn: list[str], kv: KV, etcd_key_prefix: str
) -> None:
    kv.put(_keys.state_key(etcd_key_prefix, "dyn"), GOLDEN_COMPLETE, 600)
    done = etcd_rdzv_cli.run("status", "--run-id", "dyn", "--json", *conn)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["handler"] == DYNAMIC
    assert (data["round"], data["completed_round"], data["closed"]) == (2, 2, False)
    assert [(m["rank"], m["node"], m["addr"]) for m in data["members"]] == [
        (0, "host-a_101_0", "host-a"),
        (1, "host-b_202_0", "host-b"),
    ]
    assert data["members"][0]["last_heartbeat"] == "2025-01-02T03:04:01.123456+00:00"
    assert [(w["round"], w["node"], w["spare"]) for w in data["waiting"]] == [
        (3, "host-w_303_1", False),
        (3, "host-s_404_2", True),
    ]
    text = etcd_rdzv_cli.run("status", "--run-id", "dyn", *conn)
    assert text.returncode == 0, text.stderr
    assert "handler: etcd-rdzv-dynamic (torch's DynamicRendezvousHandler)" in text.stdout
    assert "round: 2 (completed)" in text.stdout
    assert "waiting: 2 node(s), 1 of them spare(s)" in text.stdout
    assert "last heartbeat" in text.stdout

    kv.put(_keys.state_key(etcd_key_prefix, "forming"), GOLDEN_FORMING, 600)
    text = etcd_rdzv_cli.run("status", "--run-id", "forming", *conn)
    assert "round: 1 (forming)" in text.stdout
    assert "last call ends: 2025-01-02T03:04:30.123456+00:00" in text.stdout


class _Payload:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (self.command,))


def test_a_hostile_state_in_etcd_is_refused_and_never_run(
    etcd_rdzv_cli: EtcdRdzvCli, conn: list[str], kv: KV, etcd_key_prefix: str, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    payload = base64.b64encode(pickle.dumps(_Payload(f"touch {marker}"))).decode()
    key = _keys.state_key(etcd_key_prefix, "evil")
    kv.put(key, payload, 600)
    done = etcd_rdzv_cli.run("status", "--run-id", "evil", "--json", *conn)
    assert done.returncode == 0, done.stderr
    assert not marker.exists()
    data = json.loads(done.stdout)
    assert data["handler"] is None and data["members"] == []
    assert len(data["problems"]) == 1 and key in data["problems"][0]
    assert "'posix'" in data["problems"][0]
    assert f"skipped The value of {key!r}" in done.stderr
    assert not marker.exists()


def test_a_run_id_used_by_both_handlers_shows_the_native_one(kv: KV, etcd_key_prefix: str) -> None:
    kv.put(_keys.state_key(etcd_key_prefix, "both"), GOLDEN_COMPLETE, 600)
    kv.put(*_join_key(etcd_key_prefix, "both", 1, "n1", "10.0.0.1"), 600)
    status = read_run(kv, etcd_key_prefix, "both")
    assert status.handler == NATIVE
    assert [w.node for w in status.waiting] == ["n1"]
    assert any("used by both handlers" in p for p in status.problems)


# -- --watch --------------------------------------------------------------------------------


@pytest.fixture
def watching(conn: list[str], etcd_rdzv_cli: EtcdRdzvCli) -> Callable[..., CliProcess]:
    """``watching(*options)`` starts ``etcd-rdzv status --watch *options`` on ``conn``."""

    def start(*args: str) -> CliProcess:
        return etcd_rdzv_cli.start("status", "--watch", *args, *conn)

    return start


def test_watch_json_follows_joins_and_ctrl_c_ends_it(
    etcd_rdzv_cli: EtcdRdzvCli,
    watching: Callable[..., CliProcess],
    etcd_params: Params,
    kv: KV,
    etcd_key_prefix: str,
) -> None:
    proc = watching("--run-id", "w", "--json")

    def next_status() -> dict[str, Any]:
        data: dict[str, Any] = json.loads(proc.readline())
        return data

    def until(check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The drawings until one passes ``check`` (a join makes several changes)."""
        for _ in range(50):
            status = next_status()
            if check(status):
                return status
        raise AssertionError("no such drawing")

    first = next_status()
    assert (first["round"], first["waiting"], first["members"]) == (0, [], [])

    params = etcd_params("w", min_nodes=2, max_nodes=2, local_addr="10.1.1.1")
    handlers = [etcd_rdzv.create_handler(params) for _ in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            first_join = pool.submit(handlers[0].next_rendezvous)
            # One node waits in round 1: the watch shows it before the round completes.
            status = until(lambda s: bool(s["waiting"]))
            assert [w["addr"] for w in status["waiting"]] == ["10.1.1.1"]
            assert status["completed_round"] is None
            second_join = pool.submit(handlers[1].next_rendezvous)
            first_join.result(TIMEOUT)
            second_join.result(TIMEOUT)
        status = until(lambda s: s["completed_round"] == 1 and len(s["members"]) == 2)
        assert sorted(m["rank"] for m in status["members"]) == [0, 1]
        assert all(m["alive"] for m in status["members"])
        # A write to the round's store changes nothing shown: the next drawing is the
        # close, not a copy of the last one.
        store_key = _keys.store_dir(etcd_key_prefix, "w") + "/r1/x"
        kv.put(store_key, "v", 600)
        cli_close = etcd_rdzv_cli.run(
            "close",
            "--run-id",
            "w",
            "--endpoint",
            params.endpoint,
            "--key-prefix",
            etcd_key_prefix,
        )
        assert cli_close.returncode == 0, cli_close.stderr
        # Joining makes more changes after completion (the round hint, say): read
        # on to the close; no drawing repeats the one before it.
        drawings = [status]
        while not drawings[-1]["closed"]:
            drawings.append(next_status())
        assert all(a != b for a, b in itertools.pairwise(drawings)), drawings
        assert len(drawings) < 10, drawings
        assert drawings[-1]["members"] == status["members"]
    finally:
        for handler in handlers:
            handler.shutdown()

    proc.send_signal(signal.SIGINT)
    stopped = proc.finish()
    assert stopped.returncode == 0, stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert "stopped watching" in stopped.stderr


def test_watch_text_redraws_and_sigterm_ends_it(
    watching: Callable[..., CliProcess], kv: KV, etcd_key_prefix: str
) -> None:
    proc = watching("--run-id", "t")

    def drawing() -> list[str]:
        """One drawing: its lines up to the waiting line (and its table)."""
        block = [proc.readline()]
        while not block[-1].startswith("waiting:"):
            block.append(proc.readline())
        return block

    first = drawing()
    assert first[0] == "run: t" and "round: none (no node has joined this run)" in first
    kv.put(*_join_key(etcd_key_prefix, "t", 1, "n\x1b[2J1", "10.0.0.1"), 600)
    assert proc.readline() == ""  # a pipe: drawings are separated by a blank line
    second = drawing()
    assert "round: 1 (forming)" in second
    assert "waiting: 1 node(s)" in second
    assert proc.readline().split() == ["round", "node", "address", "spare"]
    assert proc.readline().split() == ["1", "n\\x1b[2J1", "10.0.0.1", "no"]

    proc.send_signal(signal.SIGTERM)
    assert proc.finish().returncode == 0


@pytest.mark.etcd_variants("v2", "v3")
def test_watch_run_yields_each_change(etcd_api_params: Params, etcd_key_prefix: str) -> None:
    params = etcd_api_params("lib", min_nodes=1, max_nodes=1, local_addr="10.2.2.2")
    client = etcd_rdzv.create_client(params)
    statuses = watch_run(client, etcd_key_prefix, "lib")
    try:
        assert next(statuses).round == 0
        handler = etcd_rdzv.create_handler(params)
        try:
            handler.next_rendezvous()
            seen: list[RunStatus] = []
            while not (seen and seen[-1].completed_round == 1):
                seen.append(next(statuses))
            assert [m.addr for m in seen[-1].members] == ["10.2.2.2"]
            assert all(a != b for a, b in itertools.pairwise(seen))
        finally:
            handler.shutdown()
        # The member left: its key is gone, and the watch says so.
        while next(statuses).members[0].alive:
            pass
    finally:
        statuses.close()
        client.close()


# -- a run with keys in the other API's keyspace -------------------------------------------


def test_keys_in_the_other_keyspace_are_shown_as_a_problem(
    etcd_rdzv_cli: EtcdRdzvCli, conn: list[str], etcd_params: Params, kv: KV, etcd_key_prefix: str
) -> None:
    """A v3 run with a stray key in the v2 keyspace (a node on the wrong API): status
    still shows the run, with the problem; a run only in the v2 keyspace is not found
    on v3, and the error says where it is."""
    v2 = etcd_rdzv.create_client(etcd_params("raw", api="v2"))
    try:
        kv.put(*_join_key(etcd_key_prefix, "mixed", 1, "n1", "10.0.0.1"), 600)
        v2.put(_keys.hint_key(etcd_key_prefix, "mixed"), "1", 600)
        v2.put(_keys.hint_key(etcd_key_prefix, "v2only"), "1", 600)
    finally:
        v2.close()
    text = etcd_rdzv_cli.run("status", "--run-id", "mixed", *conn)
    assert text.returncode == 0, text.stderr
    problem = next(line for line in text.stdout.splitlines() if line.startswith("problem: "))
    assert (
        "in etcd's v2 keyspace" in problem and "etcd-rdzv delete --run-id mixed --api v2" in problem
    )
    assert "waiting: 1 node(s)" in text.stdout
    assert "etcd's v2 keyspace" in text.stderr  # warned once on stderr too
    data = etcd_rdzv_cli.status("mixed", *conn)
    assert data["other_api"] is not None and "v2 keyspace" in data["other_api"]
    assert data["other_api"] in data["problems"]

    only = etcd_rdzv_cli.run("status", "--run-id", "v2only", *conn)
    assert only.returncode == 3
    assert "run 'v2only' does not exist: no key under" in only.stderr
    assert "has keys under" in only.stderr and "etcd's v2 keyspace" in only.stderr


@pytest.mark.etcd_variants("v2", "v3")
def test_time_left_is_the_ttl_etcd_counts(etcd_api_params: Params, etcd_key_prefix: str) -> None:
    """What status shows as an exclusion's end: the key's TTL as etcd has it now."""
    client = etcd_rdzv.create_client(etcd_api_params("raw"))
    try:
        client.put(f"{etcd_key_prefix}/timed", "x", 600)
        client.put(f"{etcd_key_prefix}/forever", "x", None)
        left = client.time_left(f"{etcd_key_prefix}/timed")
        assert left is not None and 590 <= left <= 600, left
        assert client.time_left(f"{etcd_key_prefix}/forever") is None
        assert client.time_left(f"{etcd_key_prefix}/absent") is None
    finally:
        client.close()
