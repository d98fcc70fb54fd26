"""The recovery benchmark's pure parts: reading steps, when a world trained, the
restart count's inputs, merging runs, and splicing the section into a report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks._recovery_part import merge
from benchmarks._recovery_report import BEGIN, END, recovery_section, splice, svg
from benchmarks._torchrun import Step, Steps, starts_after, trained


def _step(t: float, world: int, rank: int, pid: int, group: int) -> Step:
    return Step(t, world, rank, 0, pid, 1000 + pid, group)


def test_trained_needs_every_rank_of_one_group_after_the_moment() -> None:
    steps = [
        _step(1.0, 3, 0, 1, 7),
        _step(1.0, 3, 1, 2, 7),
        _step(1.0, 3, 2, 3, 7),
        _step(5.0, 2, 0, 4, 9),  # new group: rank 1 not there yet
    ]
    assert trained(steps, 3, 0.0) == (7, 1.0)
    assert trained(steps, 2, 2.0) is None
    steps.append(_step(6.5, 2, 1, 5, 9))
    steps.append(_step(6.0, 2, 1, 5, 9))
    assert trained(steps, 2, 2.0) == (9, 6.0)
    assert trained(steps, 3, 2.0) is None  # the old group made no step after 2.0


def test_steps_are_read_incrementally_and_half_lines_wait(tmp_path: Path) -> None:
    path = tmp_path / "w-5.jsonl"
    path.write_text("[1.5,0,-1,0,5,9,0]\n[2.0,2,1,0,5,9,42]\n[2.1,2")
    steps = Steps(tmp_path)
    assert [s.world for s in steps.read()] == [0, 2]
    with path.open("a") as f:
        f.write(",1,0,5,9,42]\n")
    read = steps.read()
    assert [s.t for s in read] == [1.5, 2.0, 2.1]
    assert starts_after(read, 1.0) == [read[0]] and starts_after(read, 2.0) == []


def _results(rows: list[dict[str, Any]], run: str) -> dict[str, Any]:
    return {
        "rows": rows,
        "idle": [{"series": "ours/v3", "nodes": 3, "rate": 0.4, "write_rate": 0.0, "run": run}],
        "limit": 60.0,
        "settle": 3.0,
        "idle_window": 10.0,
        "worker_timeout": 30.0,
        "runs": [{"started": run, "seconds": 100.0, "load": [1.0, 2.0]}],
    }


def test_merge_keeps_rows_not_measured_again_and_their_runs() -> None:
    a = {"series": "ours/v3", "fault": "killed", "rep": 1, "seconds": 40.0, "restarts": 2}
    b = {"series": "c10d", "fault": "killed", "rep": 1, "error": "x: not within 60 s"}
    old = _results([{**a, "run": "r1"}, {**b, "run": "r1"}], "r1")
    new = _results([{**a, "seconds": 5.0, "run": "r2"}], "r2")
    merged = merge(old, new)
    assert sorted((r["series"], r["run"]) for r in merged["rows"]) == [
        ("c10d", "r1"),
        ("ours/v3", "r2"),
    ]
    assert [r["started"] for r in merged["runs"]] == ["r1", "r2"]
    assert merge({**old, "limit": 30.0}, new) is new  # other settings: replaced


def test_the_section_goes_between_its_markers_and_keeps_the_rest(tmp_path: Path) -> None:
    rows = [
        {"series": "ours/v3", "fault": "frozen", "rep": 1, "seconds": 4.25, "restarts": 1},
        {"series": "c10d", "fault": "frozen", "rep": 1, "error": "y: not within 60 s"},
        {"series": "c10d", "fault": "leader", "rep": 1, "error": "n/a: c10d does not use etcd"},
    ]
    results = {"recovery": _results([{**r, "run": "r1"} for r in rows], "r1")}
    out = tmp_path / "b.md"
    section = recovery_section(results, tmp_path / "b-recovery.svg", out)
    text = "\n".join(section)
    assert "| etcd_rdzv, v3 API | 4.2 s, 1 restart |  | 0.40 (0.00 writes) |" in text
    assert "| torch c10d | not within 60 s | n/a | no etcd |" in text
    assert "![recovery after a fault](b-recovery.svg)" in text
    page = "# B\n\n## Import time\n\nx\n\n## How the numbers are made\n\nnotes\n"
    once = splice(page, section)
    assert once.index("## Import time") < once.index(BEGIN) < once.index("## How the numbers")
    twice = splice(once, ["new"])
    assert BEGIN not in twice and END not in twice and "new" in twice and "notes" in twice
    assert splice(once, section) == once
    svg(results, tmp_path / "b-recovery.svg")
    drawn = (tmp_path / "b-recovery.svg").read_text()
    assert drawn.startswith("<svg") and "not within 60 s" in drawn
    json.dumps(results)  # what the report reads is what the JSON holds


def test_restarts_leave_out_the_first_worker_of_a_new_host() -> None:
    from benchmarks._recovery import restarts

    def start(t: float, pid: int, agent: int) -> Step:
        return Step(t, 0, -1, 0, pid, agent, 0)

    steps = [start(1.0, 10, 100), start(1.0, 11, 101), start(5.0, 12, 100), start(6.0, 13, 102)]
    assert restarts(steps, 2.0) == 1  # agent 100 restarted its worker; 102 is new
    assert restarts(steps, 0.5) == 1  # three first workers, and 100 restarted


def test_calls_again_count_each_process_s_later_calls_first_stepping_after_the_fault() -> None:
    from benchmarks._torchrun import calls_after

    def step(t: float, call: int, pid: int) -> Step:
        return Step(t, 2, 0, call, pid, pid, call)

    steps = [
        step(1.0, 0, 10),
        step(1.0, 0, 11),
        step(2.0, 1, 10),  # a call again before the fault
        step(5.0, 1, 10),
        step(6.0, 2, 10),  # after it: 10's third call, 11's second
        step(6.5, 1, 11),
        step(6.6, 1, 11),
        step(7.0, 0, 12),  # a new process's first call is no call again
        Step(8.0, 0, -1, 3, 13, 13, 0),  # a start line (world 0) is no step
    ]
    assert calls_after(steps, 3.0) == 2
    assert calls_after(steps, 0.0) == 3


def test_inprocess_runs_on_each_api_as_its_own_worker_program(tmp_path: Path) -> None:
    import argparse

    from benchmarks._recovery_part import recovery_series
    from benchmarks._torchrun import host_argv

    args = argparse.Namespace(recovery_handlers=["ours", "inprocess", "c10d"], api=["v2", "v3"])
    assert recovery_series(args) == ["ours/v3", "ours/v2", "inprocess/v3", "inprocess/v2", "c10d"]
    argv = host_argv("inprocess/v2", "127.0.0.1:2379", "run-1", "2:3", tmp_path, 30.0)
    assert argv[1:3] == ["-m", "benchmarks._inprocess_job"]
    assert {"--api=v2", "--nnodes=2:3", "--run-id=run-1", "--timeout=30"} <= set(argv)
    assert "torch.distributed.run" in host_argv("ours/v3", "e:1", "r", "2:3", tmp_path, 30.0)


def test_in_process_rows_show_calls_again_and_are_explained(tmp_path: Path) -> None:
    rows = [
        {"series": "ours/v3", "fault": "killed", "rep": 1, "seconds": 4.0, "restarts": 2},
        {
            "series": "inprocess/v3",
            "fault": "killed",
            "rep": 1,
            "seconds": 1.14,
            "restarts": 0,
            "recalls": 2,
        },
        {
            "series": "inprocess/v3",
            "fault": "spare",
            "rep": 1,
            "seconds": 1.14,
            "restarts": 0,
            "recalls": 1,
        },
    ]
    results = {"recovery": _results([{**r, "run": "r1"} for r in rows], "r1")}
    text = "\n".join(recovery_section(results, None, tmp_path / "b.md"))
    assert "1.1 s, 0 restarts, 1 call again |" in text
    assert "| etcd_rdzv, v3 API | 4.0 s, 2 restarts |  |" in text
    assert "| etcd_rdzv in-process (no torchrun), v3 API | 1.1 s, 0 restarts, 2 calls again |" in (
        text
    )
    assert "## Recovery: real torchrun and in-process jobs, faulted" in text
    assert "one process that runs `etcd_rdzv.inprocess.run`" in text
    no_inprocess = {"recovery": _results([{**rows[0], "run": "r1"}], "r1")}
    assert "in-process" not in "\n".join(recovery_section(no_inprocess, None, tmp_path / "b.md"))


def test_nvrx_handlers_run_their_own_worker_with_a_rank_each(tmp_path: Path) -> None:
    import argparse

    import pytest

    from benchmarks._recovery_part import recovery_series
    from benchmarks._torchrun import nvrx_argv

    args = argparse.Namespace(
        recovery_handlers=["inprocess", "nvrx-tcpstore", "nvrx-etcd"], api=["v2", "v3"]
    )
    # Our store under NVRx runs on v3 only (where it is tested): no nvrx-etcd/v2.
    assert recovery_series(args) == [
        "inprocess/v3",
        "inprocess/v2",
        "nvrx-tcpstore",
        "nvrx-etcd/v3",
    ]
    tcp = nvrx_argv("nvrx-tcpstore", "127.0.0.1:1", "run-1", tmp_path, 30.0, 2, 3, 5000)
    assert tcp[1:4] == ["-m", "benchmarks._nvrx_job", str(tmp_path)]
    assert {"--store=tcp", "--rank=2", "--world=3", "--master-port=5000", "--timeout=30"} <= set(
        tcp
    )
    assert not [a for a in tcp if a.startswith(("--endpoint", "--run-id"))]
    etcd = nvrx_argv("nvrx-etcd/v3", "127.0.0.1:2379", "run-1", tmp_path, 30.0, 0, 3, 5000)
    assert {"--store=etcd", "--endpoint=127.0.0.1:2379", "--run-id=run-1", "--api=v3"} <= set(etcd)
    with pytest.raises(ValueError, match="'inprocess/v3' is not an NVRx handler"):
        nvrx_argv("inprocess/v3", "e:1", "r", tmp_path, 30.0, 0, 3, 5000)


def test_nvrx_faults_it_cannot_take_give_no_row() -> None:
    import argparse

    from benchmarks._recovery import Recovery

    args = argparse.Namespace(
        recovery_limit=60.0, recovery_settle=3.0, recovery_idle=0.0, recovery_worker_timeout=30.0
    )
    logged: list[str] = []

    def member(api: str) -> Any:
        raise AssertionError("no etcd member is needed for a fault NVRx cannot take")

    recovery = Recovery(args, member, logged.append)
    for fault in ("frozen", "sigterm", "scaleup", "spare", "leader"):
        recovery.run("nvrx-etcd/v3", fault, 1, False)
    assert recovery.rows == []
    assert len(logged) == 5 and all("n/a" in line for line in logged)


def test_nvrx_rows_are_explained_and_their_other_faults_are_empty(tmp_path: Path) -> None:
    def row(series: str, fault: str, **fields: Any) -> dict[str, Any]:
        return {"series": series, "fault": fault, "rep": 1, "run": "r1", **fields}

    rows = [
        row("inprocess/v3", "frozen", seconds=9.5, restarts=0, recalls=2),
        row("nvrx-etcd/v3", "rank0", seconds=0.69, restarts=0, recalls=2),
        row("nvrx-tcpstore", "killed", seconds=0.96, restarts=0, recalls=2),
        row("nvrx-tcpstore", "rank0", error="2 workers training after the fault: not within 60 s"),
    ]
    text = "\n".join(recovery_section({"recovery": _results(rows, "r1")}, None, tmp_path / "b.md"))
    assert (
        "| NVRx Wrapper, etcd_rdzv's stores, v3 API |  |  | 0.7 s, 0 restarts, 2 calls again | - |"
        in text
    )
    assert (
        "| NVRx Wrapper, its TCPStores (on rank 0) |  | 1.0 s, 0 restarts, 2 calls again | "
        "not within 60 s | no etcd |"
    ) in text
    assert "NVRx rows (`--recovery-handlers nvrx-tcpstore,nvrx-etcd`)" in text
    assert "nvidia-resiliency-ext 0.4.1" in text and "nvrx.EtcdWrapperStore`" in text
    assert "kills every daemon at the end of each measurement" in text
    assert "## Recovery: real torchrun and in-process jobs, faulted" in text
    plain = [r for r in rows if r["series"] == "inprocess/v3"]
    alone = "\n".join(recovery_section({"recovery": _results(plain, "r1")}, None, tmp_path / "b"))
    assert "NVRx" not in alone


def test_nvrx_daemons_are_found_in_their_logs_and_only_live_workers_killed(
    tmp_path: Path,
) -> None:
    import subprocess
    import sys

    from benchmarks._nvrx_job import daemon_pids
    from benchmarks._recovery import kill_nvrx_daemons

    # A stand-in daemon: its command line names the worker program, as a daemon forked
    # from a worker does; and a live process that is not one (a recycled pid).
    code = "import time; time.sleep(60)"
    daemon = subprocess.Popen([sys.executable, "-c", code, "benchmarks._nvrx_job"])
    other = subprocess.Popen([sys.executable, "-c", code])
    try:
        (tmp_path / "monitor-0.log").write_text(f"x | INFO | started daemon_pid={daemon.pid}\n")
        (tmp_path / "monitor-1.log").write_text(f"daemon_pid={other.pid} other\n")
        (tmp_path / "monitor-2.log").write_text("no pid yet\n")
        assert daemon_pids(tmp_path) == [daemon.pid, other.pid]
        assert kill_nvrx_daemons(tmp_path) == [daemon.pid]
        assert daemon.wait(10) == -9
        assert other.poll() is None
    finally:
        for proc in (daemon, other):
            proc.kill()
            proc.wait(10)
