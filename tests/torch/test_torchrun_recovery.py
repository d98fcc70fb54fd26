"""Recovery in seconds under a real torchrun: a host killed or frozen, both APIs.

Three agents with ``--nnodes=2:3``, one gloo worker each, training in a loop. A host
(its agent and its worker, which torch starts in a session of its own) is killed or
frozen; the two survivors must train again at world size 2:

* killed (a member that is not rank 0, and the rank-0 host): well within the last
  call (30 s, torch's default, set here) and the dead key's TTL (30 s here): the
  re-formed round completes once the survivors re-joined and ``rejoin_grace`` passed.
  A handler that waited for either fails the bound;
* frozen: its keys' TTL (9 s by default) is what finds it; then the round completes
  without a last call. Woken up after the others moved on, the frozen host does not
  disturb them: it comes back as a new node and the job grows to 3 again, with every
  sum right;
* the etcd leader killed (a 3-member cluster) and started again: no worker restarts.

Times are ``time.monotonic()`` of this process (the signal) and of each worker's
first step (one clock for all processes on Linux).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from etcd_rdzv.testing import EtcdCluster, EtcdServer
from fleet import Fleet, Process

from ._agents import (
    FINISH_ITERATIONS,
    JOB,
    agent_argv,
    agent_env,
    finish,
    full_run,
    show,
    wait_for,
    worker_records,
)

pytestmark = pytest.mark.torch

LAST_CALL = 30  # torch's default last call
# A killed host's key lives for its TTL: 30 s here, so that waiting for it shows.
SLOW_TTL = "keep_alive_interval=5,keep_alive_max_attempt=6"
KILLED_BOUND = 12.0  # seconds: a rejoin grace plus worker restarts, with slack for load
FROZEN_SLACK = 12.0  # seconds past the TTL


def _argv(
    server: EtcdServer | EtcdCluster,
    run_id: str,
    prefix: str,
    tmp: Path,
    job: Path,
    api: str,
    conf: str,
) -> list[str]:
    """Torch's last call and our defaults (plus ``conf``), torch's monitor interval."""
    return agent_argv(
        server,
        run_id,
        prefix,
        tmp / "torchelastic-logs",
        nnodes="2:3",
        max_restarts=10,
        script=JOB,
        script_args=[
            str(job),
            "--finish-world-size=0",
            f"--stop-file={tmp / 'stop'}",
            "--max-seconds=150",
        ],
        api=api,
        conf=conf,
        rdzv_conf=f"last_call_timeout={LAST_CALL},join_timeout=120",
        monitor_interval=None,
    )


def _timeline(agents: Fleet) -> str:
    """The agents' rendezvous log lines: where the seconds went."""
    lines = []
    for i, agent in enumerate(agents.processes):
        for line in agent.stderr().splitlines():
            if "etcd_rdzv" in line or "rendezvous" in line.lower() or "Stopping" in line:
                lines.append(f"agent{i}: {line[:240]}")
    return "\n".join(lines)


def _host(agents: Fleet, record: dict[str, Any]) -> Process:
    return next(a for a in agents.processes if a.pid == record["agent_pid"])


def _signal_host(agent: Process, worker_pid: int, sig: int) -> float:
    """``sig`` to an agent's session and to its worker's (torch starts each worker in
    a session of its own); the moment just before."""
    at = time.monotonic()
    for pid in (agent.pid, worker_pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
    return at


def _start(agents: Fleet, argv: list[str], job: Path) -> list[dict[str, Any]]:
    for i in range(3):
        agents.run(f"agent{i}", argv, env=agent_env())
    return wait_for(
        "the job running with world size 3",
        lambda: full_run(job, 3, min_iterations=3),
        agents,
        agents.processes,
        job,
    )


def _back_at_two(
    agents: Fleet, survivors: list[Process], job: Path, before: set[int]
) -> list[dict[str, Any]]:
    return wait_for(
        "the survivors training at world size 2",
        lambda: full_run(job, 2, min_iterations=2, exclude_pids=before),
        agents,
        survivors,
        job,
    )


# The rank-0 host (whose worker holds the job's store) on one API, another on the other.
@pytest.mark.parametrize(("api", "victim_rank"), [("v2", 0), ("v3", 1)])
def test_a_killed_host_is_replaced_without_waiting_for_its_ttl_or_a_last_call(
    torch_required: None,
    etcd_server: EtcdServer,
    etcd_key_prefix: str,
    tmp_path: Path,
    job_dir: Path,
    api: str,
    victim_rank: int,
) -> None:
    run_id = f"killed-{uuid.uuid4().hex[:8]}"
    argv = _argv(etcd_server, run_id, etcd_key_prefix, tmp_path, job_dir, api, "," + SLOW_TTL)
    with Fleet(tmp_path) as agents:
        three = _start(agents, argv, job_dir)
        victim = _host(agents, three[victim_rank])
        survivors = [a for a in agents.processes if a is not victim]
        before = {r["pid"] for r in worker_records(job_dir)}
        killed_at = _signal_host(victim, three[victim_rank]["pid"], signal.SIGKILL)
        two = _back_at_two(agents, survivors, job_dir, before)
        took = max(r["first_step_at"] for r in two) - killed_at
        report = f"{show(job_dir)}\n{agents.describe()}\n{_timeline(agents)}"
        finish(agents, survivors, tmp_path / "stop", job_dir)
    print(f"api={api} rank {victim_rank} host killed: training again after {took:.1f}s")
    assert {r["agent_pid"] for r in two} == {s.pid for s in survivors}, report
    assert all(r["value"] == 3.0 for r in two), report
    assert took < KILLED_BOUND, f"survivors stood still {took:.1f}s\n{report}"
    # One restart of the survivors' workers (one new worker each); a survivor slower
    # to re-join than rejoin_grace (a loaded machine) costs one more.
    new = [r for r in worker_records(job_dir) if r["pid"] not in before]
    assert len(new) in (2, 4), report


@pytest.mark.parametrize("api", ["v2", "v3"])
def test_a_frozen_host_is_found_by_its_ttl_and_does_not_disturb_when_it_wakes(
    torch_required: None,
    etcd_server: EtcdServer,
    etcd_key_prefix: str,
    tmp_path: Path,
    job_dir: Path,
    api: str,
) -> None:
    run_id = f"frozen-{uuid.uuid4().hex[:8]}"
    argv = _argv(etcd_server, run_id, etcd_key_prefix, tmp_path, job_dir, api, "")
    ttl = 3 * 3  # keep_alive_interval x keep_alive_max_attempt, the defaults
    with Fleet(tmp_path) as agents:
        three = _start(agents, argv, job_dir)
        record = three[1]
        victim = _host(agents, record)
        survivors = [a for a in agents.processes if a is not victim]
        before = {r["pid"] for r in worker_records(job_dir)}
        frozen_at = _signal_host(victim, record["pid"], signal.SIGSTOP)
        try:
            two = _back_at_two(agents, survivors, job_dir, before)
        finally:
            _signal_host(victim, record["pid"], signal.SIGCONT)
        took = max(r["first_step_at"] for r in two) - frozen_at
        # Woken, the host finds its keys gone, and comes back as a new node: the job
        # grows to 3 again (every sum checked by the workers themselves).
        at_two = {r["pid"] for r in worker_records(job_dir)}
        again = wait_for(
            "the woken host back in the job, at world size 3",
            lambda: full_run(job_dir, 3, min_iterations=FINISH_ITERATIONS, exclude_pids=at_two),
            agents,
            agents.processes,
            job_dir,
        )
        report = finish(agents, agents.processes, tmp_path / "stop", job_dir)
        assert [a.returncode for a in agents.processes] == [0, 0, 0], report
    print(f"api={api} host frozen: training again after {took:.1f}s (TTL {ttl}s)")
    assert {r["agent_pid"] for r in two} == {s.pid for s in survivors}, report
    assert all(r["value"] == 3.0 for r in two) and all(r["value"] == 6.0 for r in again), report
    assert took < ttl + FROZEN_SLACK, f"survivors stood still {took:.1f}s\n{report}"


@pytest.mark.parametrize("api", ["v2", "v3"])
def test_the_etcd_leader_killed_and_restarted_restarts_no_worker(
    torch_required: None,
    etcd_key_prefix: str,
    tmp_path: Path,
    job_dir: Path,
    api: str,
) -> None:
    """etcd's own faults are not the job's: the leader of a 3-member cluster killed
    while the job trains (an election, requests in flight answered late), then
    started again; the workers train on through both, none restarted."""
    run_id = f"leader-{uuid.uuid4().hex[:8]}"
    with EtcdCluster(3) as cluster:
        argv = _argv(cluster, run_id, etcd_key_prefix, tmp_path, job_dir, api, "")
        with Fleet(tmp_path) as agents:
            three = _start(agents, argv, job_dir)
            pids = {r["pid"] for r in three}
            leader = cluster.leader()
            leader.kill()
            cluster.leader(timeout=30)
            _train_on(agents, job_dir, pids, three, seconds=12.0)
            leader.start()
            _train_on(agents, job_dir, pids, three, seconds=5.0)
            report = finish(agents, agents.processes, tmp_path / "stop", job_dir)
            assert [a.returncode for a in agents.processes] == [0, 0, 0], report
    new = [r for r in worker_records(job_dir) if r["pid"] not in pids]
    assert not new, f"workers restarted after an etcd fault\n{report}"


def _train_on(
    agents: Fleet, job: Path, pids: set[int], last: list[dict[str, Any]], seconds: float
) -> None:
    """Wait ``seconds`` (longer than the keys' TTL of 9 s: a key lost to the fault
    would have shown), then until every worker of ``pids`` did 5 more steps."""
    time.sleep(seconds)
    done = {r["pid"]: r["iterations"] + 5 for r in last}

    def moved_on() -> bool | None:
        now = {r["pid"]: r["iterations"] for r in worker_records(job) if r["pid"] in pids}
        return all(now.get(pid, 0) >= n for pid, n in done.items()) or None

    wait_for("the workers training on", moved_on, agents, agents.processes, job)
    last[:] = [r for r in worker_records(job) if r["pid"] in pids]
