"""torchrun with more agents than ``max_nodes``: the extra agent is a spare.

* ``--nnodes=2`` and three agents: two train to the end without a single restart (the
  spare is not counted by ``num_nodes_waiting()``), and the spare's agent leaves by
  itself when the job ends (the run is closed; its ``next_rendezvous()`` raises
  ``GracefulExit``, a ``SystemExit`` with code 0), its torchrun with status 0 and no
  traceback;
* ``--nnodes=1:2`` and three agents, a member's agent SIGKILLed: the spare takes its
  place, the survivor keeps its rank, and the job finishes.

Restarts are counted from the worker files of the looping job (one per worker
process) and from ``TORCHELASTIC_RESTART_COUNT``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from pathlib import Path

import pytest

import etcd_rdzv
from etcd_rdzv import _keys
from etcd_rdzv.testing import EtcdServer
from fleet import Fleet

from ._agents import (
    FINISH_ITERATIONS,
    JOB,
    PHASE_TIMEOUT,
    agent_argv,
    agent_env,
    finish,
    full_run,
    running,
    show,
    wait_for,
    worker_records,
)

pytestmark = pytest.mark.torch

TRAIN_ITERATIONS = 40  # at 0.2 s each: ~8 s in which a restart storm would show


def _graceful(stderr: str) -> bool:
    return "leaves, its process exits with status 0" in stderr and "waited to join" in stderr


def test_a_third_agent_at_nnodes_2_is_a_spare_and_no_member_restarts(
    torch_required: None,
    etcd_api_server: EtcdServer,
    etcd_api: str,
    etcd_key_prefix: str,
    tmp_path: Path,
    job_dir: Path,
) -> None:
    run_id = f"spare-{uuid.uuid4().hex[:8]}"
    argv = agent_argv(
        etcd_api_server,
        run_id,
        etcd_key_prefix,
        tmp_path / "torchelastic-logs",
        nnodes="2",
        max_restarts=5,
        script=JOB,
        script_args=[
            str(job_dir),
            "--finish-world-size=2",
            f"--iterations={TRAIN_ITERATIONS}",
            "--max-seconds=100",
        ],
        api=etcd_api,
    )
    with Fleet(tmp_path) as agents:
        for i in range(3):  # all at once: the spare's key may be the oldest
            agents.run(f"agent{i}", argv, env=agent_env())
        # Not wait_exit(): it stops the others at the first non-zero exit.
        agents.wait_until(
            "every agent exiting by itself",
            lambda: all(a.returncode is not None for a in agents.processes) or None,
            PHASE_TIMEOUT + 30,
            details=lambda: show(job_dir),
        )
        report = f"{show(job_dir)}\n{agents.describe()}"

    records = worker_records(job_dir)
    workers = {r["pid"] for r in records}
    trained = [r for r in records if r["iterations"] == TRAIN_ITERATIONS]
    print(f"worker processes started: {len(workers)} (2 means no restart)")
    assert len(workers) == 2, f"the members restarted their workers\n{report}"
    assert sorted(r["rank"] for r in trained) == [0, 1], report
    assert {r["restart_count"] for r in trained} == {"0"}, report
    members = {r["agent_pid"] for r in trained}
    (spare,) = (a for a in agents.processes if a.pid not in members)
    assert [a.returncode for a in agents.processes if a.pid in members] == [0, 0], report
    # The spare leaves by itself when the job ends, with status 0 (torch's launcher
    # would trip over the None its agent returns after RendezvousGracefulExitError).
    assert spare.returncode == 0, report
    assert "Traceback" not in spare.stderr(), report
    assert _graceful(spare.stderr()), report


def test_the_spare_replaces_a_killed_member(
    torch_required: None,
    etcd_server: EtcdServer,
    etcd_key_prefix: str,
    tmp_path: Path,
    job_dir: Path,
) -> None:
    run_id = f"spare-kill-{uuid.uuid4().hex[:8]}"
    stop_file = tmp_path / "stop"
    argv = agent_argv(
        etcd_server,
        run_id,
        etcd_key_prefix,
        tmp_path / "torchelastic-logs",
        nnodes="1:2",
        max_restarts=5,
        script=JOB,
        script_args=[str(job_dir), "--finish-world-size=0", f"--stop-file={stop_file}"],
    )
    with Fleet(tmp_path) as agents:
        two = running(agents, argv, 3, job_dir, world_size=2, iterations=3)
        members = {r["agent_pid"] for r in two}
        (spare,) = (a for a in agents.processes if a.pid not in members)
        victim = next(a for a in agents.processes if a.pid == two[1]["agent_pid"])
        survivor = next(a for a in agents.processes if a.pid == two[0]["agent_pid"])
        before = {r["pid"] for r in worker_records(job_dir)}
        victim.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(two[1]["pid"], signal.SIGKILL)  # its worker leads its own session

        after = wait_for(
            "the job running with world size 2 again, with the spare",
            lambda: full_run(job_dir, 2, min_iterations=FINISH_ITERATIONS, exclude_pids=before),
            agents,
            [survivor, spare],
            job_dir,
        )
        report = finish(agents, [survivor, spare], stop_file, job_dir)
        assert [survivor.returncode, spare.returncode] == [0, 0], report

    assert {r["agent_pid"] for r in after} == {survivor.pid, spare.pid}, report
    assert after[0]["agent_pid"] == survivor.pid, f"the survivor lost rank 0\n{report}"
    for record in after:
        assert record["value"] == 3.0, report


def test_an_agent_stopped_by_sigterm_is_seen_gone_at_once(
    torch_required: None,
    etcd_server: EtcdServer,
    etcd_key_prefix: str,
    tmp_path: Path,
    job_dir: Path,
) -> None:
    """torch's agent handles SIGTERM (stops its workers, exits; its launcher does not call
    shutdown(), torch 2.6 and 2.7's agent does): its handler deletes its key on the way
    out without closing the run, so with a 15 s TTL the others regroup in a few
    seconds, not after the TTL."""
    run_id = f"sigterm-{uuid.uuid4().hex[:8]}"
    stop_file = tmp_path / "stop"
    argv = agent_argv(
        etcd_server,
        run_id,
        etcd_key_prefix,
        tmp_path / "torchelastic-logs",
        nnodes="2:3",
        max_restarts=3,
        script=JOB,
        script_args=[str(job_dir), "--finish-world-size=0", f"--stop-file={stop_file}"],
    )
    ttl_conf = "keep_alive_interval=5,keep_alive_max_attempt=3"  # TTL 15 s
    argv = [a.replace("keep_alive_interval=1,keep_alive_max_attempt=2", ttl_conf) for a in argv]
    assert any(ttl_conf in a for a in argv)
    with Fleet(tmp_path) as agents:
        three = running(agents, argv, 3, job_dir, world_size=3, iterations=2)
        victim = next(a for a in agents.processes if a.pid == three[2]["agent_pid"])
        survivors = [a for a in agents.processes if a is not victim]
        before = {r["pid"] for r in worker_records(job_dir)}
        stopped = time.monotonic()
        os.kill(victim.pid, signal.SIGTERM)
        wait_for(
            "the job running with world size 2 after the SIGTERM",
            lambda: full_run(job_dir, 2, min_iterations=1, exclude_pids=before),
            agents,
            survivors,
            job_dir,
        )
        trained = time.monotonic() - stopped
        # The agents start the new workers once their round completed: the
        # rendezvous's part. What follows (a worker importing torch, building its
        # group) is the machine's: 8-11 s on a CI machine busy with other tests.
        workers = full_run(job_dir, 2, min_iterations=1, exclude_pids=before)
        assert workers is not None
        regrouped = max(w["started_at"] for w in workers) - stopped
        # The victim's key went with it, not after its TTL (the survivors' round
        # would not wait for it past a short grace either way): only the survivors'
        # keys are left.
        probe = etcd_rdzv.create_client(
            etcd_server.params(run_id, api="v2", key_prefix=etcd_key_prefix)
        )
        try:
            records, _ = probe.list_tree(_keys.rdzv_dir(etcd_key_prefix, run_id))
        finally:
            probe.close()
        looked = time.monotonic() - stopped
        join_keys = [r.key for r in records if "/nodes/" in r.key]
        report = finish(agents, survivors, stop_file, job_dir)
    print(
        f"SIGTERM to a regrouped job at world size 2: workers started {regrouped:.1f} s "
        f"after it, trained {trained:.1f} s after it (key TTL 15 s)"
    )
    assert victim.returncode not in (None, -signal.SIGKILL), report
    assert regrouped < 12, f"the others waited {regrouped:.1f}s: for the TTL?\n{report}"
    assert looked < 15 and len(join_keys) == 2, (looked, join_keys)
