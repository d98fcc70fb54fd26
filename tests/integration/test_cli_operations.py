"""What an operator does with a run, on today's etcd: join, look, close, delete, reuse.

``python -m etcd_rdzv ...`` in subprocesses, as users run it; most tests on a v3-only
etcd (started without ``--enable-v2``, as etcd 3.6 is) with no ``--api`` option. Every
wait is bounded; none relies on a fixed sleep.
"""

from __future__ import annotations

import logging
import queue
import re
import shlex
import subprocess
import threading
from collections.abc import Callable
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousClosedError, _keys
from etcd_rdzv.errors import LOGGED_AND_RAISED
from etcd_rdzv.rendezvous import Listener
from etcd_rdzv.runs.delete import RunInUseError, delete_run
from etcd_rdzv.testing import EtcdRdzvCli, EtcdServer, cli_env, wait_until

from ._rawkv import raw_exists_under, raw_get

TIMEOUT = 60  # seconds any one CLI call may take here


@pytest.fixture
def conn3(etcd_server_v3: EtcdServer, etcd_key_prefix: str) -> list[str]:
    """Connection options of the v3-only session etcd, under a fresh prefix; no --api."""
    return ["--endpoint", etcd_server_v3.endpoint, "--key-prefix", etcd_key_prefix]


def _error(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("etcd-rdzv: error:")]
    assert len(errors) == 1, stderr
    return errors[0]


# -- join, status, close, delete, and the id again ------------------------------------------


def test_v3_only_join_status_close_then_delete_makes_the_id_usable_again(
    etcd_rdzv_cli: EtcdRdzvCli, conn3: list[str], etcd_key_prefix: str
) -> None:
    joined = etcd_rdzv_cli.run(
        "join", "--run-id", "ops", "--min-nodes", "1", "--local-addr", "h1", *conn3
    )
    assert joined.returncode == 0, joined.stderr
    assert joined.stdout.splitlines()[:3] == ["rank: 0", "world size: 1", "round: 1"]
    status = etcd_rdzv_cli.status("ops", *conn3)
    assert status["completed_round"] == 1 and status["closed"] is False

    closed = etcd_rdzv_cli.run("close", "--run-id", "ops", *conn3)
    assert closed.returncode == 0, closed.stderr
    assert etcd_rdzv_cli.status("ops", *conn3)["closed"] is True

    strict = ["--no-restart-closed-run"]  # else a new job starts the closed run again
    again = etcd_rdzv_cli.run("join", "--run-id", "ops", "--min-nodes", "1", *strict, *conn3)
    assert again.returncode == 1
    error = _error(again.stderr)
    assert "The rendezvous of run 'ops' is closed" in error
    assert "--rdzv-id" in error
    assert f"etcd-rdzv delete --run-id ops --key-prefix {etcd_key_prefix}" in error
    assert "--api" not in error  # v3, the default

    deleted = etcd_rdzv_cli.run("delete", "--run-id", "ops", *conn3)
    assert deleted.returncode == 0, deleted.stderr
    assert re.fullmatch(
        rf"run ops deleted: \d+ key\(s\) under {etcd_key_prefix}/ops/ in etcd's v3 keyspace\n",
        deleted.stdout,
    ), deleted.stdout
    status = etcd_rdzv_cli.status("ops", *conn3)
    assert (status["round"], status["closed"], status["completed_round"]) == (0, False, None)

    reused = etcd_rdzv_cli.run(
        "join", "--run-id", "ops", "--min-nodes", "1", "--local-addr", "h2", *conn3
    )
    assert reused.returncode == 0, reused.stderr
    assert reused.stdout.splitlines()[:4] == ["rank: 0", "world size: 1", "round: 1", "peers: h2"]

    nothing = etcd_rdzv_cli.run("delete", "--run-id", "never-ran", *conn3)
    assert nothing.returncode == 0, nothing.stderr
    assert "nothing to delete (a run of api=v2 needs --api v2)" in nothing.stdout


def test_delete_refuses_while_a_node_waits_and_force_deletes(
    conn3: list[str], etcd_rdzv_cli: EtcdRdzvCli, etcd_server_v3: EtcdServer
) -> None:
    waiting = etcd_rdzv_cli.start(
        "join", "--run-id", "busy", "--min-nodes", "2", "--local-addr", "w1",
        "--keep-alive-interval", "1", *conn3,
    )  # fmt: skip
    wait_until(lambda: bool(etcd_rdzv_cli.status("busy", *conn3)["waiting"]))
    node = etcd_rdzv_cli.status("busy", *conn3)["waiting"][0]["node"]

    refused = etcd_rdzv_cli.run("delete", "--run-id", "busy", *conn3)
    assert refused.returncode == 1
    error = _error(refused.stderr)
    assert "Run 'busy' has 1 live node(s)" in error
    assert f"node {node!r} at 'w1' (round 1, joining)" in error
    assert "--force" in error
    assert etcd_rdzv_cli.status("busy", *conn3)["waiting"], "a refused delete deleted something"

    forced = etcd_rdzv_cli.run("delete", "--run-id", "busy", "--force", *conn3)
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.startswith("run busy deleted (forced): ")
    waiting.kill()


def test_delete_refusal_says_how_long_a_killed_nodes_key_lives(
    etcd_rdzv_cli: EtcdRdzvCli, conn3: list[str], etcd_server_v3: EtcdServer, etcd_key_prefix: str
) -> None:
    """The refusal's "expires within N s by default" is the TTL etcd holds for the join
    key of a node started with the default options (its lease's granted TTL)."""
    waiting = etcd_rdzv_cli.start("join", "--run-id", "ttl", "--min-nodes", "2", *conn3)
    wait_until(lambda: bool(etcd_rdzv_cli.status("ttl", *conn3)["waiting"]))
    node = etcd_rdzv_cli.status("ttl", *conn3)["waiting"][0]["node"]
    key = raw_get(etcd_server_v3.client_url, "v3", _keys.node_key(etcd_key_prefix, "ttl", 1, node))
    assert key is not None and key.granted, key
    refused = etcd_rdzv_cli.run("delete", "--run-id", "ttl", *conn3)
    assert refused.returncode == 1, refused.stderr
    error = _error(refused.stderr)
    assert (
        "a killed node's key expires within its TTL, keep_alive_interval x "
        f"keep_alive_max_attempt: {key.granted} s by default"
    ) in error, error
    waiting.kill()


def test_delete_refuses_while_a_member_is_alive(
    etcd_rdzv_cli: EtcdRdzvCli, conn3: list[str], etcd_server_v3: EtcdServer, etcd_key_prefix: str
) -> None:
    """No --api and no api option anywhere: the library's default reaches v3-only etcd."""
    params = etcd_server_v3.params("member", key_prefix=etcd_key_prefix, local_addr="10.1.1.1")
    handler = etcd_rdzv.create_handler(params)
    try:
        handler.next_rendezvous()
        refused = etcd_rdzv_cli.run("delete", "--run-id", "member", *conn3)
        assert refused.returncode == 1
        assert f"node {handler.node_id!r} at '10.1.1.1' (round 1, member)" in _error(refused.stderr)
    finally:
        handler.shutdown()
    deleted = etcd_rdzv_cli.run("delete", "--run-id", "member", *conn3)  # left: nobody alive
    assert deleted.returncode == 0, deleted.stderr
    assert etcd_rdzv_cli.status("member", *conn3)["round"] == 0


def test_delete_on_v2_removes_the_directories_too(
    etcd_rdzv_cli: EtcdRdzvCli, etcd_server: EtcdServer, etcd_key_prefix: str
) -> None:
    conn = ["--endpoint", etcd_server.endpoint, "--key-prefix", etcd_key_prefix]
    v2 = [*conn, "--api", "v2"]
    joined = etcd_rdzv_cli.run("join", "--run-id", "old", "--min-nodes", "1", *v2)
    assert joined.returncode == 0, joined.stderr
    closed = etcd_rdzv_cli.run("close", "--run-id", "old", *v2)
    assert closed.returncode == 0, closed.stderr
    strict = ["--no-restart-closed-run"]  # else a new job starts the closed run again
    refused = etcd_rdzv_cli.run("join", "--run-id", "old", "--min-nodes", "1", *strict, *v2)
    error = _error(refused.stderr)
    assert f"etcd-rdzv delete --run-id old --key-prefix {etcd_key_prefix} --api v2" in error

    run_dir = f"{etcd_key_prefix}/old"
    assert raw_exists_under(etcd_server.client_url, "v2", run_dir)
    elsewhere = etcd_rdzv_cli.run("delete", "--run-id", "old", *conn)  # the v3 keyspace: not there
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert "nothing to delete (a run of api=v2 needs --api v2)" in elsewhere.stdout
    assert raw_exists_under(etcd_server.client_url, "v2", run_dir)

    deleted = etcd_rdzv_cli.run("delete", "--run-id", "old", *v2)
    assert deleted.returncode == 0, deleted.stderr
    assert "in etcd's v2 keyspace" in deleted.stdout
    assert not raw_exists_under(etcd_server.client_url, "v2", run_dir)  # no empty dirs
    reused = etcd_rdzv_cli.run("join", "--run-id", "old", "--min-nodes", "1", *v2)
    assert reused.returncode == 0, reused.stderr
    assert reused.stdout.splitlines()[2] == "round: 1"


def test_delete_of_a_dynamic_run_waits_for_a_quiet_state(
    etcd_rdzv_cli: EtcdRdzvCli, conn3: list[str], etcd_server_v3: EtcdServer, etcd_key_prefix: str
) -> None:
    """torch's dynamic handler writes its state on every keep-alive: while the state is
    written, the run is in use; once it is quiet for 2 keep-alives (+1 s), it is not."""
    backend, store = etcd_rdzv.create_backend(
        etcd_server_v3.params("dyn", key_prefix=etcd_key_prefix)
    )
    store.set("k", b"v")
    stop = threading.Event()

    def keep_alive() -> None:  # what each live node of the run does
        token = None
        while not stop.is_set():
            answer = backend.set_state(b"state", token)
            token = None if answer is None else answer[1]
            stop.wait(0.3)

    writer = threading.Thread(target=keep_alive, daemon=True)
    writer.start()
    try:
        wait_until(lambda: backend.get_state() is not None)
        refused = etcd_rdzv_cli.run(
            "delete", "--run-id", "dyn", "--keep-alive-interval", "1", *conn3
        )
        assert refused.returncode == 1
        assert "its rendezvous state" in _error(refused.stderr)
        assert "waiting 3s for a keep-alive" in refused.stderr
    finally:
        stop.set()
        writer.join(10)
    deleted = etcd_rdzv_cli.run("delete", "--run-id", "dyn", "--keep-alive-interval", "1", *conn3)
    assert deleted.returncode == 0, deleted.stderr
    assert backend.get_state() is None
    assert store.num_keys() == 0


def test_delete_run_in_the_library(etcd_api_params: Callable[..., Any]) -> None:
    params = etcd_api_params("lib", min_nodes=1, max_nodes=1)
    handler = etcd_rdzv.create_handler(params)
    kv = etcd_rdzv.create_client(params)
    try:
        handler.next_rendezvous()
        prefix = params.get("key_prefix")
        with pytest.raises(RunInUseError, match=re.escape(repr(handler.node_id))):
            delete_run(kv, prefix, "lib")
        handler.shutdown()
        assert delete_run(kv, prefix, "lib").keys > 0
        found, _ = kv.list_tree(f"{prefix}/lib")
        assert found == []
    finally:
        handler.shutdown()
        kv.close()


# -- the closed run's error --------------------------------------------------------------------


def test_a_closed_run_is_logged_at_error_and_says_what_to_do(
    etcd_server_v3: EtcdServer, etcd_key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    params = etcd_server_v3.params("shut", key_prefix=etcd_key_prefix, restart_closed_run="false")
    first = etcd_rdzv.create_handler(params)
    first.set_closed()
    handler = etcd_rdzv.create_handler(params)
    try:
        with (
            caplog.at_level(logging.ERROR, logger="etcd_rdzv"),
            pytest.raises(RendezvousClosedError) as raised,
        ):
            handler.next_rendezvous()
    finally:
        handler.shutdown()
        first.shutdown()
    message = str(raised.value)
    assert message.startswith("The rendezvous of run 'shut' is closed.")
    assert "use a new run id (torchrun: --rdzv-id)" in message
    command = f"etcd-rdzv delete --run-id shut --key-prefix {shlex.quote(etcd_key_prefix)}"
    assert command in message
    logged = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in logged] == [message]  # once
    assert getattr(logged[0], LOGGED_AND_RAISED) is True


# -- join --export under eval ------------------------------------------------------------------


def _bash(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        check=False,
        text=True,
        timeout=TIMEOUT,
        env=cli_env(),
        stdin=subprocess.DEVNULL,
    )


def test_a_failed_export_stops_a_set_e_script(etcd_rdzv_cli: EtcdRdzvCli, conn3: list[str]) -> None:
    assert etcd_rdzv_cli.run("close", "--run-id", "gone", "--force", *conn3).returncode == 0
    strict = "--no-restart-closed-run"  # else a new job starts the closed run again
    join = shlex.join([*EtcdRdzvCli.ARGV, "join", "--min-nodes", "1", strict, "--export", *conn3])

    good = _bash(f'set -e; eval "$({join} --run-id fine)"; echo "reached RANK=$RANK"')
    assert good.returncode == 0, good.stderr
    assert good.stdout == "reached RANK=0\n"

    closed = _bash(f'set -e; eval "$({join} --run-id gone)"; echo reached')
    assert closed.returncode != 0
    assert "reached" not in closed.stdout
    assert "is closed" in closed.stderr

    usage = _bash(f'set -e; eval "$({join} --run-id x --join-timeout nope)"; echo reached')
    assert usage.returncode != 0
    assert "reached" not in usage.stdout

    # What eval gets: the error on stderr, and `false` (not `exit`) as the last line.
    direct = etcd_rdzv_cli.run(
        "join", "--run-id", "gone", "--min-nodes", "1", "--no-restart-closed-run", "--exp", *conn3
    )
    assert (direct.returncode, direct.stdout) == (1, "false\n")


# -- progress ----------------------------------------------------------------------------------


def test_join_reports_what_it_waits_for(conn3: list[str], etcd_rdzv_cli: EtcdRdzvCli) -> None:
    join = ["join", "--run-id", "slow", "--min-nodes", "3", "--keep-alive-interval", "1", *conn3]
    first = etcd_rdzv_cli.start(*join, "--local-addr", "a1")
    first.wait_line(r"round 1: 1 of 3 node\(s\) joined \(min 3, max 3\); waiting for more")
    second = etcd_rdzv_cli.start(*join, "--local-addr", "a2")
    # A follower knows only its coordinator (the first node, which is the one waiting).
    line = second.wait_line(r"round 1: waiting for coordinator '[^']+' to complete the round")
    assert re.search(r"\(\d+s left of join_timeout\)$", line), line
    first.wait_line(r"round 1: 2 of 3 node\(s\) joined")  # a change is reported at once
    third = etcd_rdzv_cli.start(*join, "--local-addr", "a3")
    for node in (first, second, third):
        done = node.finish()
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[1] == "world size: 3"
    # Nothing after the round completed; the third node, never kept waiting, said nothing.
    after = first.finish().stderr.split("round 1 complete", 1)[1]
    assert "joined" not in after
    assert "waiting for" not in third.finish().stderr


def test_quiet_join_reports_no_progress(conn3: list[str], etcd_rdzv_cli: EtcdRdzvCli) -> None:
    join = ["join", "--run-id", "q", "--min-nodes", "3", *conn3]
    quiet = etcd_rdzv_cli.start(
        *join, "--local-addr", "q1", "-q"
    )  # the coordinator: it knows the counts
    wait_until(lambda: bool(etcd_rdzv_cli.status("q", *conn3)["waiting"]))
    loud = etcd_rdzv_cli.start(*join, "--local-addr", "q2")
    # Two reports of the follower: 5 s in which the coordinator, had it not been quiet,
    # would have reported its count twice.
    loud.wait_line(r"waiting for coordinator", count=2)
    third = etcd_rdzv_cli.start(*join, "--local-addr", "q3")
    for node in (quiet, loud, third):
        done = node.finish()
        assert done.returncode == 0, done.stderr
    stderr = quiet.finish().stderr
    assert "etcd-rdzv: round" not in stderr
    assert "joining run" not in stderr


def test_the_handler_logs_progress_at_debug(
    etcd_server_v3: EtcdServer, etcd_key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    params = etcd_server_v3.params(
        "info", key_prefix=etcd_key_prefix, min_nodes=2, max_nodes=2, last_call_timeout=0
    )
    first, second = etcd_rdzv.create_handler(params), etcd_rdzv.create_handler(params)
    seen: list[str] = []

    class Heard(Listener):
        def on_progress(self, text: str) -> None:
            seen.append(text)

    first.add_listener(Heard())
    outcome: queue.Queue[object] = queue.Queue()
    with caplog.at_level(logging.DEBUG, logger="etcd_rdzv"):
        joiner = threading.Thread(target=lambda: outcome.put(first.next_rendezvous()))
        joiner.start()
        try:
            wait_until(lambda: bool(seen))
            second.next_rendezvous()
            joiner.join(TIMEOUT)
        finally:
            first.shutdown()
            second.shutdown()
    assert not outcome.empty()
    assert seen[0].startswith("round 1: 1 of 2 node(s) joined (min 2, max 2)")
    # Each report at DEBUG (the events log at INFO hears a wait after 10 s only).
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert f"run info: node {first.node_id}: {seen[0]}" in logged
