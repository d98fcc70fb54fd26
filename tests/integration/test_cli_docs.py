"""What docs/cli.md quotes is what ``etcd-rdzv`` prints, and its ``--json`` schema is
the one the command keeps.

Each output block of docs/cli.md is marked ``<!-- output: NAME -->``; a test here
makes the situation it shows on a real etcd (real handlers, the real command in a
subprocess) and compares. What differs from run to run is put in placeholders on both
sides first: node ids, addresses, times, durations, this test's key prefix; the rest,
word for word, must match (spacing aside: a node id's length moves the columns).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousParameters, _keys
from etcd_rdzv._kv import KV
from etcd_rdzv.admission.health import CheckResult, failure_record
from etcd_rdzv.admission.quarantine import death_record
from etcd_rdzv.rendezvous import EtcdRendezvousHandler
from etcd_rdzv.rendezvous.records import fault_record
from etcd_rdzv.testing import CliProcess, EtcdRdzvCli, EtcdServer, wait_until

from ..unit.test_torch_state import GOLDEN_COMPLETE

Params = Callable[..., RendezvousParameters]

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
_BLOCK = re.compile(r"^<!-- output: ([a-z-]+) -->\n```[a-z]*\n(.*?)^```$", re.M | re.S)
_KEYS = re.compile(r"<!-- json keys -->\n(.*?)<!-- end of json keys -->", re.S)

# What differs between runs, in the order it is replaced.
_VARYING = [
    (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?([+-]\d\d:\d\d)?"), "<time>"),
    (re.compile(r"[\w.-]+_[0-9a-f]{12}\b"), "<node>"),
    (re.compile(r"\b\d{1,3}(\.\d{1,3}){3}(:\d+)?\b"), "<addr>"),
    (re.compile(r"\b\d+\.\d\d\b"), "<seconds>"),
    (re.compile(r"\b\d+[smhd]\b"), "<duration>"),
]


def doc_blocks() -> dict[str, str]:
    blocks = dict(_BLOCK.findall(DOC.read_text()))
    assert blocks, "no output block in docs/cli.md"
    return blocks


def normal(text: str, prefix: str = "") -> list[str]:
    """``text``'s words with what varies replaced (``prefix``: this test's key prefix,
    shown as the default's; shell comments dropped)."""
    if prefix:
        text = re.sub(r" --key-prefix \S+", "", text).replace(prefix, "/etcd_rdzv")
    text = re.sub(r"\s+# .*$", "", text, flags=re.M)
    for pattern, placeholder in _VARYING:
        text = pattern.sub(placeholder, text)
    return text.split()


def lines_of(text: str, prefix: str = "") -> list[list[str]]:
    return [normal(line, prefix) for line in text.splitlines() if line.strip()]


def assert_as_documented(name: str, printed: str, prefix: str = "") -> None:
    documented = doc_blocks()[name]
    assert normal(printed, prefix) == normal(documented), (
        f"docs/cli.md's {name!r} block:\n{documented}\nthe command printed:\n{printed}"
    )


def documented_keys() -> dict[str, set[str]]:
    """docs/cli.md's table of the ``--json`` records and their keys."""
    table = _KEYS.search(DOC.read_text())
    assert table is not None, "docs/cli.md has no json keys table"
    keys: dict[str, set[str]] = {}
    for row in table[1].splitlines()[2:]:
        record, names = (cell.strip() for cell in row.strip("|").split("|"))
        keys[record.split()[0].strip("`").removesuffix("[]")] = set(
            re.findall(r"`([a-z_]+)`", names)
        )
    return keys


# -- fixtures ----------------------------------------------------------------------------


@pytest.fixture
def conn(etcd_server: EtcdServer, etcd_key_prefix: str) -> list[str]:
    return ["--endpoint", etcd_server.endpoint, "--key-prefix", etcd_key_prefix]


@pytest.fixture
def kv(etcd_params: Params) -> Iterator[KV]:
    client = etcd_rdzv.create_client(etcd_params("raw"))
    yield client
    client.close()


@pytest.fixture
def nodes(etcd_params: Params) -> Iterator[Callable[..., EtcdRendezvousHandler]]:
    """``nodes(run, host, addr, **options)``: a handler, shut down when the test ends."""
    made: list[EtcdRendezvousHandler] = []

    def make(run: str, host: str, addr: str, **options: Any) -> EtcdRendezvousHandler:
        options.setdefault("last_call_timeout", 1)
        params = etcd_params(run, local_addr=addr, host_id=host, **options)
        handler = etcd_rdzv.create_handler(params)
        made.append(handler)
        return handler

    yield make
    for handler in made:
        handler.shutdown()


def _both(first: Callable[[], Any], second: Callable[[], Any]) -> None:
    with ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(first), pool.submit(second)]:
            done.result(60)


def _in_order(
    first: Callable[[], Any], started: Callable[[], object], second: Callable[[], Any]
) -> None:
    """``first`` and ``second`` at once, ``second`` only once ``started()`` is true."""
    with ThreadPoolExecutor(2) as pool:
        one = pool.submit(first)
        wait_until(started, 30, what="the first join's key")
        two = pool.submit(second)
        for done in (one, two):
            done.result(60)


# -- status, exclude, the run that does not exist ------------------------------------------


def test_status_exclude_and_a_missing_run_print_what_the_docs_show(
    etcd_rdzv_cli: EtcdRdzvCli,
    conn: list[str],
    kv: KV,
    etcd_key_prefix: str,
    nodes: Callable[..., EtcdRendezvousHandler],
) -> None:
    """Round 1 of job1 completed with host-a and host-b, host-b left (a dead member),
    host-c waits in round 2, gpu-07 excluded for 12h before it ever joined."""
    a, b = (
        nodes("job1", h, addr, min_nodes=2, max_nodes=2)
        for h, addr in (("host-a", "10.0.0.1"), ("host-b", "10.0.0.2"))
    )
    # host-a first, so that it is rank 0 as the docs show (ranks go by joining order).
    round1 = _keys.rdzv_dir(etcd_key_prefix, "job1") + "/r1/nodes"
    _in_order(a.next_rendezvous, lambda: kv.list_prefix(round1)[0], b.next_rendezvous)
    b.shutdown()  # its join key goes: to the run, the member is gone
    c = nodes("job1", "host-c", "10.0.0.3", min_nodes=2, max_nodes=2, join_timeout=120)
    waiting: Future[Any]
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(c.next_rendezvous)
        try:
            wait_until(lambda: etcd_rdzv_cli.status("job1", *conn)["waiting"], 60, what="c waits")
            excluded = etcd_rdzv_cli.run(
                "exclude", "--run-id", "job1", "--host", "gpu-07", "--reason", "Xid 79",
                "--for", "12h", "--force", *conn,
            )  # fmt: skip
            assert excluded.returncode == 0, excluded.stderr
            assert_as_documented("exclude", excluded.stdout)
            assert " for 12h: " in excluded.stdout  # as given, not in seconds

            shown = etcd_rdzv_cli.run("status", "--run-id", "job1", *conn)
            assert shown.returncode == 0, shown.stderr
            assert_as_documented("status", shown.stdout)
            assert re.search(r"  12h  in 1[12]h [0-9]+m  Xid 79$", shown.stdout, re.M)
            # The gone member keeps its address and host.
            assert "  1     " in shown.stdout and "10.0.0.2  no     host-b" in shown.stdout

            typo = etcd_rdzv_cli.run("exclude", "--run-id", "job1", "--host", "gpu-7", *conn)
            assert typo.returncode == 3
            assert_as_documented("exclude-unseen", typo.stderr.splitlines()[-1])

            # include of a host that is not excluded: no error, the excluded ones named.
            let_in = etcd_rdzv_cli.run("include", "--run-id", "job1", "--host", "gpu-7", *conn)
            assert let_in.returncode == 0, let_in.stderr
            assert "(it was not excluded)" in let_in.stdout
            assert "warning: excluded from the run: gpu-07; did you mean 'gpu-07'?" in let_in.stderr

            missing = etcd_rdzv_cli.run("status", "--run-id", "jbo1", *conn)
            assert (missing.returncode, missing.stdout) == (3, "")
            assert_as_documented("status-missing", missing.stderr.splitlines()[-1], etcd_key_prefix)
            # close: the same error, nothing written; with --force it closes.
            unclosed = etcd_rdzv_cli.run("close", "--run-id", "jbo1", *conn)
            assert unclosed.returncode == 3 and "did you mean 'job1'?" in unclosed.stderr
            assert "--force closes it" in unclosed.stderr
            assert etcd_rdzv_cli.status("jbo1", *conn)["exists"] is False
            # exclude on a run that does not exist: the same, nothing written.
            nowhere = etcd_rdzv_cli.run("exclude", "--run-id", "jbo1", "--host", "host-a", *conn)
            assert nowhere.returncode == 3 and "run 'jbo1' does not exist" in nowhere.stderr
            assert etcd_rdzv_cli.status("jbo1", *conn)["exists"] is False
        finally:
            closed = etcd_rdzv_cli.run("close", "--run-id", "job1", *conn)
            assert closed.returncode == 0, closed.stderr
            with pytest.raises(etcd_rdzv.RendezvousError):
                waiting.result(60)


def test_a_dynamic_run_prints_what_the_docs_show(
    etcd_rdzv_cli: EtcdRdzvCli, conn: list[str], kv: KV, etcd_key_prefix: str
) -> None:
    kv.put(_keys.state_key(etcd_key_prefix, "job2"), GOLDEN_COMPLETE, 600)
    shown = etcd_rdzv_cli.run("status", "--run-id", "job2", *conn)
    assert shown.returncode == 0, shown.stderr
    assert_as_documented("status-dynamic", shown.stdout)


# -- one JSON schema -----------------------------------------------------------------------


def _check_schema(data: dict[str, Any], keys: dict[str, set[str]]) -> None:
    assert set(data) == keys["the"], sorted(set(data) ^ keys["the"])
    for record in ("members", "waiting", "excluded", "health", "deaths"):
        for item in data[record]:
            assert set(item) == keys[record], (record, sorted(set(item) ^ keys[record]))
    if data["failure"] is not None:
        assert set(data["failure"]) == keys["failure"]


def test_every_status_record_has_exactly_the_documented_keys(
    etcd_rdzv_cli: EtcdRdzvCli,
    conn: list[str],
    kv: KV,
    etcd_key_prefix: str,
    nodes: Callable[..., EtcdRendezvousHandler],
) -> None:
    keys = documented_keys()
    assert set(keys) == {"the", "members", "waiting", "failure", "excluded", "health", "deaths"}
    prefix = etcd_key_prefix
    # A native run in every state at once: live and gone members, a spare (the group
    # is full), a waiting node, exclusions with and without an end, a failed health
    # check, a counted death, a failed later round.
    a, b = (
        nodes("all", h, f"10.0.0.{i}", min_nodes=2, max_nodes=2)
        for i, h in ((1, "host-a"), (2, "host-b"))
    )
    _both(a.next_rendezvous, b.next_rendezvous)
    spare = json.dumps({"id": "s_1", "addr": "10.0.0.9", "prev_rank": None, "host": "host-s"})
    kv.put(_keys.node_key(prefix, "all", 2, "s_1"), spare, 600)
    for host, extra in (("gpu-07", ["--for", "12h"]), ("gpu-08", [])):
        done = etcd_rdzv_cli.run(
            "exclude", "--run-id", "all", "--host", host, "--force", *extra, *conn
        )
        assert done.returncode == 0, done.stderr
    failed = failure_record("host-h", "check", CheckResult(False, "exit 3", ("out",)), _now())
    kv.put(_keys.health_key(prefix, "all", "host-h"), failed, 600)
    death = death_record("host-d", "d_1", "2026-01-01T00:00:00+00:00")
    kv.put(_keys.deaths_dir(prefix, "all", "host-d") + "/" + _keys.b64_key("d_1"), death, 600)
    kv.put(_keys.result_key(prefix, "all", 3), fault_record("rank 0 twice", ("x", "y")), 600)

    full = etcd_rdzv_cli.status("all", *conn)
    _check_schema(full, keys)
    assert [m["alive"] for m in full["members"]] == [True, True]
    assert [w["spare"] for w in full["waiting"]] == [True]
    assert {e["host"]: e["ends_in"] is not None for e in full["excluded"]} == {
        "gpu-07": True,
        "gpu-08": False,
    }
    assert full["health"] and full["deaths"] and full["failure"] is not None

    b.shutdown()  # a gone member: same keys, its host and address kept
    gone = etcd_rdzv_cli.status("all", *conn)
    _check_schema(gone, keys)
    member = gone["members"][[m["alive"] for m in gone["members"]].index(False)]
    assert (member["addr"], member["host"]) == ("10.0.0.2", "host-b")
    assert [w["spare"] for w in gone["waiting"]] == [False]  # waiting, no longer spare

    kv.put(_keys.state_key(prefix, "dyn"), GOLDEN_COMPLETE, 600)
    dynamic = etcd_rdzv_cli.status("dyn", *conn)
    _check_schema(dynamic, keys)
    assert dynamic["handler"] == "dynamic" and dynamic["members"][0]["host"] is None

    absent = etcd_rdzv_cli.status("none", *conn)
    _check_schema(absent, keys)
    assert absent["exists"] is False


def _now() -> Any:
    import datetime as dt

    return dt.datetime.now(dt.timezone.utc)


# -- join, its progress, a closed run, delete, the demo, a typo ---------------------------


def _joins(cli: EtcdRdzvCli, conn: list[str], *each: list[str]) -> list[CliProcess]:
    return [cli.start("join", *args, *conn) for args in each]


def test_join_its_export_a_closed_run_and_delete_print_what_the_docs_show(
    etcd_rdzv_cli: EtcdRdzvCli, conn: list[str], etcd_key_prefix: str
) -> None:
    common = ["--run-id", "job1", "--min-nodes", "2"]
    procs = _joins(
        etcd_rdzv_cli,
        conn,
        [*common, "--local-addr", "10.0.0.1"],
        [*common, "--local-addr", "10.0.0.2"],
    )
    done = [p.finish() for p in procs]
    assert all(d.returncode == 0 for d in done), [d.stderr for d in done]
    rank1 = next(d.stdout for d in done if d.stdout.startswith("rank: 1"))
    assert_as_documented("join", rank1)

    common = ["--run-id", "job1", "--min-nodes", "2", "--export", "--master-port", "29500"]
    procs = _joins(
        etcd_rdzv_cli,
        conn,
        [*common, "--local-addr", "10.0.0.1"],
        [*common, "--local-addr", "10.0.0.2"],
    )
    done = [p.finish() for p in procs]
    rank1 = next(d.stdout for d in done if d.stdout.startswith("export RANK=1"))
    # The round is the second here: the docs show a first.
    assert_as_documented("join-export", rank1.replace("ROUND=2", "ROUND=1"))

    assert etcd_rdzv_cli.run("close", "--run-id", "job1", *conn).returncode == 0
    strict = "--no-restart-closed-run"  # by default a join starts the closed run again
    refused = etcd_rdzv_cli.run("join", "--run-id", "job1", "--min-nodes", "1", strict, *conn)
    assert refused.returncode == 1
    assert_as_documented("join-closed", refused.stderr.splitlines()[-1], etcd_key_prefix)

    deleted = etcd_rdzv_cli.run("delete", "--run-id", "job1", *conn)
    assert deleted.returncode == 0, deleted.stderr
    printed = re.sub(r"\b\d+ key\(s\)", "7 key(s)", deleted.stdout)
    assert_as_documented("delete", printed, etcd_key_prefix)


def test_the_progress_lines_of_join_are_the_docs(
    etcd_rdzv_cli: EtcdRdzvCli, conn: list[str], nodes: Callable[..., EtcdRendezvousHandler]
) -> None:
    printed: list[str] = []
    # Alone in a round of 2 to 4 (the coordinator counts), then a follower.
    run = ["--min-nodes", "2", "--max-nodes", "4", "--last-call-timeout", "30"]
    first = etcd_rdzv_cli.start("join", "--run-id", "p1", *run, *conn)
    printed.append(first.wait_line(r"waiting for more"))
    more = [etcd_rdzv_cli.start("join", "--run-id", "p1", *run, *conn) for _ in range(2)]
    printed.append(more[0].wait_line(r"waiting for coordinator"))
    # Its last call may start before the third node is in (a loaded machine): the
    # line that counts all three comes once it is.
    printed.append(first.wait_line(r"3 node\(s\) joined.*last call"))
    # Static ranks: 0 and 2 of 4.
    static = [
        etcd_rdzv_cli.start("join", "--run-id", "p2", "--min-nodes", "4", "--rank", r, *conn)
        for r in ("0", "2")
    ]
    printed.append(_either(static, r"static ranks"))
    # A spare: four live members at max_nodes=4.
    members = [nodes("p3", f"h{i}", f"10.0.1.{i}", min_nodes=4, max_nodes=4) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        for joined in [pool.submit(m.next_rendezvous) for m in members]:
            joined.result(60)
    spare = etcd_rdzv_cli.start(
        "join", "--run-id", "p3", "--min-nodes", "4", "--max-nodes", "4", *conn
    )
    printed.append(spare.wait_line(r"spare node"))
    documented = lines_of(doc_blocks()["join-progress"])
    shown = [normal(line) for line in printed]
    for line in documented:
        assert line in shown, f"not printed: {' '.join(line)}\nprinted:\n" + "\n".join(printed)
    for proc in [first, *more, *static, spare]:
        proc.send_signal(2)


def _either(procs: list[CliProcess], pattern: str, timeout: float = 60) -> str:
    """The first stderr line matching ``pattern`` of any of ``procs`` (the round's
    coordinator says it, and which node that is depends on who came first)."""
    found: list[str] = []

    def seen() -> bool:
        for proc in procs:
            try:
                found.append(proc.wait_line(pattern, timeout=0.2))
            except AssertionError:
                continue
            return True
        return False

    wait_until(seen, timeout, what=f"a line matching {pattern!r}")
    return found[0]


def test_the_demo_prints_what_the_docs_show(etcd_rdzv_cli: EtcdRdzvCli, conn: list[str]) -> None:
    done = etcd_rdzv_cli.run("demo", *conn, timeout=120)
    assert done.returncode == 0, done.stderr
    # The process numbers come in the order the nodes finished.
    printed = re.sub(r"^ *\d+(?=  \S+_[0-9a-f]{12})", "  <proc>", done.stdout, flags=re.M)
    documented = re.sub(
        r"^ *\d+(?=  \S+_[0-9a-f]{12})", "  <proc>", doc_blocks()["demo"], flags=re.M
    )
    assert normal(printed) == normal(documented), done.stdout


def test_a_typo_prints_what_the_docs_show(etcd_rdzv_cli: EtcdRdzvCli) -> None:
    done = etcd_rdzv_cli.run("exclude", "--run-id", "j", "--hots", "gpu-07", env={"COLUMNS": "80"})
    assert done.returncode == 2
    assert_as_documented("typo", done.stderr)


def test_watch_across_an_etcd_restart_prints_what_the_docs_show(
    etcd_rdzv_cli: EtcdRdzvCli,
) -> None:
    """A real etcd member process stopped and started again under ``status --watch``:
    the watch says it lost etcd, goes on when it is back, and shows later changes."""
    with EtcdServer("restarted") as server:
        where = ["--endpoint", server.endpoint]
        kv = etcd_rdzv.create_client(server.params("raw"))
        try:
            kv.put(_keys.hint_key("/etcd_rdzv", "job1"), "1", 600)
            proc = etcd_rdzv_cli.start("status", "--watch", "--json", "--run-id", "job1", *where)
            assert json.loads(proc.readline())["hint"] == 1
            server.stop()
            lost = proc.wait_line("lost etcd")
            server.start()
            back = proc.wait_line("answers again")
            assert_as_documented("status-watch-lost", f"{lost}\n{back}")
            kv.put(_keys.closed_key("/etcd_rdzv", "job1"), "1", 600)
            assert json.loads(proc.readline())["closed"] is True
            proc.send_signal(2)
            stopped = proc.finish()
            assert stopped.returncode == 0, stopped.stderr
            assert "Traceback" not in stopped.stderr
        finally:
            kv.close()
