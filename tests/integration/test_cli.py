"""The etcd-rdzv command line as users run it: ``python -m etcd_rdzv ...`` in a subprocess.

Every subprocess (the plugin's ``etcd_rdzv_cli``) has a timeout; none relies on a fixed
sleep.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousParameters, _keys
from etcd_rdzv.testing import CliProcess, EtcdRdzvCli, EtcdServer

Params = Callable[..., RendezvousParameters]


@pytest.fixture
def conn(etcd_server: EtcdServer, etcd_key_prefix: str) -> list[str]:
    """The etcd options of the session server under a fresh prefix."""
    return ["--endpoint", etcd_server.endpoint, "--key-prefix", etcd_key_prefix]


def _exports(stdout: str) -> dict[str, str]:
    found = re.findall(r"^export (\w+)=(\S*)$", stdout, re.MULTILINE)
    return dict(found)


def _one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("etcd-rdzv: error:")]
    assert len(errors) == 1, stderr
    return errors[0]


# -- demo --------------------------------------------------------------------------------

ROW = re.compile(r"^\s*(\d+)\s+(\S+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+\.\d+)\s*$")


def _table(stdout: str) -> list[tuple[int, int, int]]:
    """(rank, world size, round) of each table row."""
    return [(int(m[3]), int(m[4]), int(m[5])) for m in map(ROW.match, stdout.splitlines()) if m]


def test_demo_on_an_embedded_etcd(etcd_rdzv_cli: EtcdRdzvCli) -> None:
    started = time.monotonic()
    done = etcd_rdzv_cli.run("demo", "--nodes", "3", timeout=120)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    rows = _table(done.stdout)
    assert sorted(rank for rank, _, _ in rows) == [0, 1, 2]
    assert {(size, rnd) for _, size, rnd in rows} == {(3, 1)}
    assert "store round-trip:" in done.stdout
    assert ": ok" in done.stdout
    assert "handler: native (torch not imported)" in done.stdout
    assert "embedded etcd stopped" in done.stderr
    assert took < 60, f"the demo took {took:.1f}s"


def test_demo_on_a_given_etcd_leaves_no_keys(
    etcd_rdzv_cli: EtcdRdzvCli, conn: list[str], etcd_params: Params, etcd_key_prefix: str
) -> None:
    done = etcd_rdzv_cli.run("demo", "--nodes", "2", "--run-id", "demo-x", *conn)
    assert done.returncode == 0, done.stderr
    assert sorted(rank for rank, _, _ in _table(done.stdout)) == [0, 1]
    assert "embedded" not in done.stderr
    kv = etcd_rdzv.create_client(etcd_params())
    try:
        records, _ = kv.list_tree(etcd_key_prefix)
    finally:
        kv.close()
    assert records == []


def test_demo_with_more_nodes_than_the_round_takes(
    etcd_rdzv_cli: EtcdRdzvCli, conn: list[str]
) -> None:
    done = etcd_rdzv_cli.run("demo", "--nodes", "3", "--max-nodes", "2", *conn)
    assert done.returncode == 0, done.stderr
    assert sorted(rank for rank, _, _ in _table(done.stdout)) == [0, 1]
    assert "1 node(s) were not admitted" in done.stdout


# -- join --------------------------------------------------------------------------------


def test_two_joins_export_ranks_and_the_master_address(
    conn: list[str], etcd_rdzv_cli: EtcdRdzvCli
) -> None:
    procs = []
    for addr in ("127.0.0.11", "127.0.0.12"):
        join = ["join", "--run-id", "job", "--min-nodes", "2", "--export", "--local-addr", addr]
        procs.append(etcd_rdzv_cli.start(*join, "--master-port", "29500", *conn))
    exports = []
    for p in procs:
        done = p.finish()
        assert done.returncode == 0, done.stderr
        exports.append(_exports(done.stdout))
    assert {e["RANK"] for e in exports} == {"0", "1"}
    assert {e["WORLD_SIZE"] for e in exports} == {"2"}
    assert {e["ETCD_RDZV_ROUND"] for e in exports} == {"1"}
    assert {e["MASTER_PORT"] for e in exports} == {"29500"}
    rank0 = next(i for i, e in enumerate(exports) if e["RANK"] == "0")
    master = ("127.0.0.11", "127.0.0.12")[rank0]
    assert {e["MASTER_ADDR"] for e in exports} == {master}
    assert {e["ETCD_RDZV_PEERS"] for e in exports} == {
        f"{master},{'127.0.0.12' if rank0 == 0 else '127.0.0.11'}"
    }


def test_join_prints_rank_world_size_round_and_peers(
    etcd_rdzv_cli: EtcdRdzvCli, conn: list[str]
) -> None:
    done = etcd_rdzv_cli.run(
        "join", "--run-id", "solo", "--min-nodes", "1", "--local-addr", "h1", *conn
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:4] == ["rank: 0", "world size: 1", "round: 1", "peers: h1"]


def test_join_with_rank_takes_the_given_ranks_and_a_twin_fails_naming_it(
    conn: list[str], etcd_rdzv_cli: EtcdRdzvCli
) -> None:
    def join(rank: int, addr: str, run: str = "static") -> CliProcess:
        return etcd_rdzv_cli.start(
            "join", "--run-id", run, "--min-nodes", "2", "--rank", str(rank),
            "--local-addr", addr, "--keep-alive-interval", "1", *conn,
        )  # fmt: skip

    second, first = join(1, "h1"), join(0, "h0")
    outs = [p.finish() for p in (first, second)]
    assert [done.returncode for done in outs] == [0, 0], outs
    assert outs[0].stdout.splitlines()[:2] == ["rank: 0", "world size: 2"]
    assert outs[1].stdout.splitlines()[:2] == ["rank: 1", "world size: 2"]
    assert "static rank 1 of 2" in outs[1].stderr

    twins = [join(0, "t1", "twins"), join(0, "t2", "twins")]
    for p in twins:
        done = p.finish()
        assert done.returncode == 1, done.stderr
        assert "Rank 0 is claimed by more than one live node" in done.stderr
    failure = etcd_rdzv_cli.status("twins", *conn)["failure"]
    assert failure["round"] == 1 and "Rank 0 is claimed" in failure["reason"]
    shown = etcd_rdzv_cli.run("status", "--run-id", "twins", *conn)
    assert 'round 1 failed: "Rank 0 is claimed' in shown.stdout

    bad = etcd_rdzv_cli.run("join", "--run-id", "x", "--min-nodes", "2", "--rank", "2", *conn)
    assert bad.returncode == 2 and "option rank must be an integer in 0..1" in bad.stderr


# -- status and close --------------------------------------------------------------------


def test_status_shows_waiting_nodes_members_and_closed_state(
    conn: list[str], etcd_rdzv_cli: EtcdRdzvCli
) -> None:
    assert etcd_rdzv_cli.status("job", *conn)["round"] == 0

    first = etcd_rdzv_cli.start(
        "join", "--run-id", "job", "--min-nodes", "2", "--local-addr", "a1", *conn
    )
    etcd_rdzv_cli.until(lambda: bool(etcd_rdzv_cli.status("job", *conn)["waiting"]))
    status = etcd_rdzv_cli.status("job", *conn)
    assert status["closed"] is False
    assert status["completed_round"] is None
    assert [w["addr"] for w in status["waiting"]] == ["a1"]

    second = etcd_rdzv_cli.start(
        "join", "--run-id", "job", "--min-nodes", "2", "--local-addr", "a2", *conn
    )
    for p in (first, second):
        done = p.finish()
        assert done.returncode == 0, done.stderr

    status = etcd_rdzv_cli.status("job", *conn)
    assert status["completed_round"] == 1
    assert sorted(m["rank"] for m in status["members"]) == [0, 1]
    assert [m["alive"] for m in status["members"]] == [False, False]  # both left
    assert status["waiting"] == []

    text = etcd_rdzv_cli.run("status", "--run-id", "job", *conn)
    assert text.returncode == 0, text.stderr
    assert "closed: no" in text.stdout
    assert "latest completed round: 1 (world size 2)" in text.stdout

    closed = etcd_rdzv_cli.run("close", "--run-id", "job", *conn)
    assert closed.returncode == 0, closed.stderr
    assert closed.stdout.strip() == "run job closed"
    assert etcd_rdzv_cli.status("job", *conn)["closed"] is True
    text = etcd_rdzv_cli.run("status", "--run-id", "job", *conn)
    assert "closed: yes" in text.stdout


def test_status_shows_a_live_member(
    etcd_rdzv_cli: EtcdRdzvCli, conn: list[str], etcd_params: Params, etcd_key_prefix: str
) -> None:
    params = etcd_params("live", min_nodes=1, max_nodes=1, local_addr="10.9.9.9")
    handler = etcd_rdzv.create_handler(params)
    try:
        handler.next_rendezvous()
        status = etcd_rdzv_cli.status("live", *conn)
    finally:
        handler.shutdown()
    # Its host: local_addr's, as no host_id was given.
    assert status["members"] == [
        {
            "rank": 0,
            "node": handler.node_id,
            "addr": "10.9.9.9",
            "alive": True,
            "host": "10.9.9.9",
            "group": None,
            "last_heartbeat": None,
        }
    ]


def test_join_after_close_fails_with_a_clear_message(
    etcd_rdzv_cli: EtcdRdzvCli, conn: list[str], etcd_server: EtcdServer, etcd_key_prefix: str
) -> None:
    # A run with no keys yet: closing it takes --force (without, a typo would pass).
    closed = etcd_rdzv_cli.run("close", "--run-id", "shut", "--force", *conn)
    assert closed.returncode == 0, closed.stderr
    join = ["join", "--run-id", "shut", "--min-nodes", "1", *conn]
    done = etcd_rdzv_cli.run(*join, "--no-restart-closed-run")
    assert done.returncode == 1
    assert done.stdout == ""
    assert "closed" in _one_error_line(done.stderr)
    # By default a new job starts the closed run again (nobody of the old one is alive)
    # once the close is 15 s old (records.ENDED_TTL): here its marker goes at once.
    kv = etcd_rdzv.create_client(etcd_server.params("raw", key_prefix=etcd_key_prefix))
    try:
        assert kv.delete(_keys.ended_key(etcd_key_prefix, "shut"))
    finally:
        kv.close()
    again = etcd_rdzv_cli.run(*join)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[:3] == ["rank: 0", "world size: 1", "round: 1"]


def test_unreachable_etcd_is_one_error_line(etcd_rdzv_cli: EtcdRdzvCli) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = etcd_rdzv_cli.run(
        "status", "--run-id", "r", "--endpoint", f"127.0.0.1:{port}", "--read-timeout", "2"
    )
    assert done.returncode == 1
    assert f"127.0.0.1:{port}" in _one_error_line(done.stderr)


# -- serve -------------------------------------------------------------------------------


def _health(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=2) as resp:
            return bool(json.loads(resp.read())["health"] == "true")
    except OSError:
        return False


def test_serve_prints_a_working_endpoint_and_stops_on_sigterm(
    etcd_rdzv_cli: EtcdRdzvCli, tmp_path: Any
) -> None:
    """The default: v3 only, as etcd 3.6 serves; every command and the library reach it
    without an API option."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = etcd_rdzv_cli.start("serve", "--port", str(port), "--data-dir", str(tmp_path / "data"))
    endpoint = proc.readline(60).strip()
    assert endpoint == f"127.0.0.1:{port}"
    assert _health(endpoint)
    with pytest.raises(urllib.error.HTTPError) as no_v2:
        urllib.request.urlopen(f"http://{endpoint}/v2/keys/", timeout=5)
    assert no_v2.value.code == 404  # no v2 API, like etcd 3.6

    joined = etcd_rdzv_cli.run("join", "--run-id", "r", "--min-nodes", "1", "--endpoint", endpoint)
    assert joined.returncode == 0, joined.stderr
    assert joined.stdout.startswith("rank: 0\n")
    status = etcd_rdzv_cli.run("status", "--run-id", "r", "--json", "--endpoint", endpoint)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["completed_round"] == 1
    closed = etcd_rdzv_cli.run("close", "--run-id", "r", "--endpoint", endpoint)
    assert closed.returncode == 0, closed.stderr
    params = RendezvousParameters("etcd-rdzv", endpoint, "lib", 1, 1)  # no api option
    handler = etcd_rdzv.create_handler(params)
    assert handler.next_rendezvous().world_size == 1
    handler.shutdown()

    proc.send_signal(signal.SIGTERM)
    stopped = proc.finish(30)
    assert stopped.returncode == 0, stopped.stderr
    assert "etcd stopped" in stopped.stderr
    assert "v2 API off" in stopped.stderr
    assert not _health(endpoint)
    assert (tmp_path / "data" / "member").is_dir()  # --data-dir keeps the data


def test_serve_with_v2_serves_runs_of_either_api(etcd_rdzv_cli: EtcdRdzvCli) -> None:
    proc = etcd_rdzv_cli.start("serve", "--enable-v2")
    endpoint = proc.readline(60).strip()
    assert _health(endpoint)
    with urllib.request.urlopen(f"http://{endpoint}/v2/keys/", timeout=5) as resp:
        assert resp.status == 200

    conn = ["--run-id", "r", "--endpoint", endpoint]
    v2 = etcd_rdzv_cli.run("join", "--min-nodes", "1", "--api", "v2", *conn)
    assert v2.returncode == 0, v2.stderr
    status = etcd_rdzv_cli.run("status", "--json", *conn, env={"ETCD_RDZV_API": "V2"})
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["completed_round"] == 1  # the v2 run, through $ETCD_RDZV_API
    # the v3 keyspace does not hold that run: the same id is refused on v3
    v3 = etcd_rdzv_cli.run("join", "--min-nodes", "1", *conn)
    assert v3.returncode == 1 and "etcd's v2 keyspace" in v3.stderr
    bad = etcd_rdzv_cli.run("status", *conn, env={"ETCD_RDZV_API": "v4"})
    assert bad.returncode == 2 and "$ETCD_RDZV_API must be one of v2, v3, got 'v4'" in bad.stderr

    proc.send_signal(signal.SIGTERM)
    stopped = proc.finish(30)
    assert stopped.returncode == 0, stopped.stderr
    assert "v2 API on" in stopped.stderr
