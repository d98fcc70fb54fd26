"""torchrun agents on an etcd that serves both APIs: an agent on the wrong API.

Two agents run the looping job on ``api=v3``; a third, started with ``api=v2`` (the
mis-configured one), is refused: its torchrun exits non-zero with the error naming
both APIs, the v2 keyspace holds nothing of the run afterwards (torch's launcher calls
``shutdown()``, which must not close the run there), and the job goes on untouched:
the same workers keep counting iterations, no restart.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from etcd_rdzv.testing import EtcdServer
from fleet import Fleet

from ..integration._rawkv import raw_listing
from ._agents import (
    JOB,
    PHASE_TIMEOUT,
    agent_argv,
    agent_env,
    finish,
    full_run,
    job_args,
    running,
    wait_for,
)

pytestmark = pytest.mark.torch


def test_an_agent_on_the_wrong_api_is_refused_and_the_job_goes_on(
    torch_required: None,
    etcd_server: EtcdServer,
    etcd_key_prefix: str,
    tmp_path: Path,
    job_dir: Path,
) -> None:
    run_id = f"mixed-{uuid.uuid4().hex[:8]}"
    stop_file = tmp_path / "stop"

    def argv(api: str) -> list[str]:
        return agent_argv(
            etcd_server,
            run_id,
            etcd_key_prefix,
            tmp_path / "torchelastic-logs",
            nnodes="2:3",
            max_restarts=3,
            script=JOB,
            script_args=job_args(job_dir, 0, stop_file),
            api=api,
        )

    with Fleet(tmp_path) as agents:
        two = running(agents, argv("v3"), 2, job_dir, world_size=2, iterations=2)
        members = list(agents.processes)
        wrong = agents.run("wrong", argv("v2"), env=agent_env())
        assert agents.wait_exit([wrong], timeout=PHASE_TIMEOUT), agents.describe()
        report = agents.describe()
        assert wrong.returncode != 0, report
        said = wrong.stderr()
        assert f"has keys under {etcd_key_prefix}/{run_id}/ in etcd's v3 keyspace" in said, report
        assert "this node uses api=v2" in said, report
        assert not raw_listing(etcd_server.client_url, "v2", etcd_key_prefix), report

        # The job went on: the same workers, more iterations, no restart.
        done = max(r["iterations"] for r in two)
        later = wait_for(
            "the job going on after the refusal",
            lambda: full_run(job_dir, 2, min_iterations=done + 3),
            agents,
            members,
            job_dir,
        )
        report = finish(agents, members, stop_file, job_dir)
        assert [a.returncode for a in members] == [0, 0], report
    assert {r["pid"] for r in later} == {r["pid"] for r in two}, report
    assert not any("new nodes from group_rank" in a.stderr() for a in members), report
