"""torchrun with ``--rdzv-backend=etcd-rdzv``: our own handler under torch's elastic agent.

Each agent is its own torchrun (``torch.distributed.run`` run as ``__main__``, as
``python -m`` does) that finds the handler through the ``torchrun.handlers`` entry
point. The only addition: a handler on the ``etcd_rdzv`` logger, so the agents' output
shows the handler's INFO lines next to torch's.

* two agents run a gloo all-reduce once, on each etcd API (``api=v3`` on an etcd
  without the v2 API);
* scale-up: a third agent arrives while two run; the members see
  ``num_nodes_waiting() > 0``, re-rendezvous, and the job continues with three;
* fault: one of three agents is SIGKILLed with its worker; the other two re-rendezvous
  and continue with two.

The looping job (``_elastic_job.py``) writes one file per worker process, which is how
the tests follow the restarts: no fixed sleeps, only waits on those files.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import uuid
from pathlib import Path

import pytest

from etcd_rdzv import EtcdRendezvousHandler
from etcd_rdzv.testing import EtcdServer
from fleet import Fleet

from ..integration._rawkv import raw_get
from ._agents import (
    ALLREDUCE_JOB,
    FINISH_ITERATIONS,
    JOB,
    PHASE_TIMEOUT,
    agent_argv,
    agent_env,
    finish,
    full_run,
    job_args,
    parent_of,
    running,
    show,
    wait_for,
)

pytestmark = pytest.mark.torch


def test_two_native_agents_all_reduce(
    torch_required: None,
    etcd_api_server: EtcdServer,
    etcd_api: str,
    etcd_key_prefix: str,
    tmp_path: Path,
) -> None:
    run_id = f"native-{uuid.uuid4().hex[:8]}"
    out_dir = tmp_path / "results"
    out_dir.mkdir()
    argv = agent_argv(
        etcd_api_server,
        run_id,
        etcd_key_prefix,
        tmp_path / "torchelastic-logs",
        nnodes="2",
        max_restarts=0,
        script=ALLREDUCE_JOB,
        script_args=[str(out_dir)],
        api=etcd_api,
    )
    with Fleet(tmp_path) as agents:
        for i in range(2):
            agents.run(f"agent{i}", argv, env=agent_env())
        finished = agents.wait_exit(timeout=PHASE_TIMEOUT)
        report = agents.describe()
        assert finished, f"agents still running after {PHASE_TIMEOUT} s\n{report}"
        assert [a.returncode for a in agents.processes] == [0, 0], report

    written = sorted(p.name for p in out_dir.iterdir())
    assert written == ["rank0.json", "rank1.json"], f"{written}\n{report}"
    results = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(results):
        assert result["rank"] == rank, f"{result}\n{report}"
        assert result["world_size"] == 2, f"{result}\n{report}"
        assert result["value"] == 3.0, f"{result}\n{report}"
        assert result["run_id"] == run_id, f"{result}\n{report}"
        assert result["restart_count"] == "0", f"{result}\n{report}"
    assert sorted(r["group_rank"] for r in results) == ["0", "1"], report

    # The agents met through our handler's keys, under the prefix we gave them, in the
    # keyspace of the API they were told to use.
    result_key = f"{etcd_key_prefix}/{run_id}/rdzv/r1/result"
    result_node = raw_get(etcd_api_server.client_url, etcd_api, result_key)
    assert result_node is not None, f"no round result in etcd\n{report}"
    assert len(json.loads(result_node.value)["members"]) == 2, result_node
    # The handler logs under its module's name (logging.getLogger(__name__)).
    logger = EtcdRendezvousHandler.__module__
    assert f"{logger}: run" in report, "the handler's log lines are missing"


def test_third_agent_scales_the_job_up(
    torch_required: None,
    etcd_server: EtcdServer,
    etcd_key_prefix: str,
    tmp_path: Path,
    job_dir: Path,
) -> None:
    run_id = f"native-up-{uuid.uuid4().hex[:8]}"
    argv = agent_argv(
        etcd_server,
        run_id,
        etcd_key_prefix,
        tmp_path / "torchelastic-logs",
        nnodes="2:3",
        max_restarts=3,
        script=JOB,
        script_args=job_args(job_dir, 3, tmp_path / "stop"),
    )
    with Fleet(tmp_path) as agents:
        first = [agents.run(f"agent{i}", argv, env=agent_env()) for i in range(2)]
        two = wait_for(
            "the job running with world size 2",
            lambda: full_run(job_dir, 2, min_iterations=2),
            agents,
            first,
            job_dir,
        )
        third = agents.run("agent2", argv, env=agent_env())
        finished = agents.wait_exit(timeout=PHASE_TIMEOUT)
        report = f"{show(job_dir)}\n{agents.describe()}"
        assert finished, f"agents still running after {PHASE_TIMEOUT} s\n{report}"
        assert [a.returncode for a in agents.processes] == [0, 0, 0], report

    first_pids = {a.pid for a in first}
    assert {r["agent_pid"] for r in two} == first_pids, report
    three = full_run(job_dir, 3, min_iterations=FINISH_ITERATIONS)
    assert three is not None, f"no complete run with world size 3\n{report}"
    assert {r["agent_pid"] for r in three} == first_pids | {third.pid}, report
    for record in three:
        assert record["value"] == 6.0, report
        assert record["iterations"] == FINISH_ITERATIONS, report
        assert record["run_id"] == run_id, report
        assert not record["stopped"], report
    # The members restarted because their monitor saw a waiting node.
    assert any("new nodes from group_rank" in a.stderr() for a in first), report


def test_killed_agent_leaves_the_others_running(
    torch_required: None,
    etcd_server: EtcdServer,
    etcd_key_prefix: str,
    tmp_path: Path,
    job_dir: Path,
) -> None:
    run_id = f"native-kill-{uuid.uuid4().hex[:8]}"
    stop_file = tmp_path / "stop"
    argv = agent_argv(
        etcd_server,
        run_id,
        etcd_key_prefix,
        tmp_path / "torchelastic-logs",
        nnodes="2:3",
        max_restarts=3,
        script=JOB,
        script_args=job_args(job_dir, 0, stop_file),
    )
    with Fleet(tmp_path) as agents:
        three = running(agents, argv, 3, job_dir, world_size=3, iterations=2)
        # The victim: the agent whose worker is rank 0 (it published MASTER_ADDR/PORT).
        worker = three[0]
        victim = next(a for a in agents.processes if a.pid == worker["agent_pid"])
        survivors = [a for a in agents.processes if a is not victim]
        assert parent_of(worker["pid"]) == victim.pid, show(job_dir)
        before = {int(p.name[len("pid-") :]) for p in job_dir.glob("pid-*")}  # every worker yet
        victim.kill()  # the agent's process group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker["pid"], signal.SIGKILL)  # the worker leads its own session

        two = wait_for(
            "the job running with world size 2 after the kill",
            lambda: full_run(job_dir, 2, min_iterations=3, exclude_pids=before),
            agents,
            survivors,
            job_dir,
        )
        report = finish(agents, survivors, stop_file, job_dir)
        assert [a.returncode for a in survivors] == [0, 0], report
        assert victim.returncode == -signal.SIGKILL, report

    assert {r["agent_pid"] for r in two} == {a.pid for a in survivors}, report
    final = full_run(job_dir, 2, min_iterations=3, exclude_pids=before)
    assert final is not None, report
    for record in final:
        assert record["value"] == 3.0, report
        assert record["stopped"], report
        assert record["run_id"] == run_id, report
    assert final[0]["iterations"] == final[1]["iterations"], report


def test_late_agent_after_finished_run_is_refused(
    torch_required: None, etcd_server: EtcdServer, etcd_key_prefix: str, tmp_path: Path
) -> None:
    """torch's launcher calls shutdown() when an agent is done; torch's handlers close
    the run then, so an agent arriving later fails instead of running the job again.
    Ours do so with ``restart_closed_run=false``; by default a new process starts a
    closed run again once the finished job's nodes are gone (a re-created or requeued
    job: ``test_torchrun_rerun.py``)."""
    run_id = f"native-late-{uuid.uuid4().hex[:8]}"
    out_dir = tmp_path / "results"
    out_dir.mkdir()

    def argv(nnodes: str) -> list[str]:
        return agent_argv(
            etcd_server,
            run_id,
            etcd_key_prefix,
            tmp_path / "torchelastic-logs",
            nnodes=nnodes,
            max_restarts=0,
            script=ALLREDUCE_JOB,
            script_args=[str(out_dir)],
            conf=",restart_closed_run=false",
        )

    with Fleet(tmp_path) as agents:
        for i in range(2):
            agents.run(f"agent{i}", argv("2"), env=agent_env())
        assert agents.wait_exit(timeout=PHASE_TIMEOUT), agents.describe()
        assert [a.returncode for a in agents.processes] == [0, 0], agents.describe()
        late = agents.run("late", argv("1:2"), env=agent_env())
        assert agents.wait_exit([late], timeout=PHASE_TIMEOUT), agents.describe()
        report = agents.describe()
        assert late.returncode != 0, f"a late agent ran the finished job again\n{report}"
        assert "RendezvousClosedError" in late.stderr(), report
    assert json.loads((out_dir / "rank0.json").read_text())["world_size"] == 2, report
