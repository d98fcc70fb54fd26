"""torchrun with an excluded host: three agents ``--nnodes=2:3``, one of them on a
host excluded from the run (``etcd-rdzv exclude``; here the library call it makes).

The two others train to the end with world size 2; the excluded host's agent never
enters a round and leaves by itself: its ``next_rendezvous()`` raises ``HostExcluded``
(a graceful exit), its torchrun exits with status 0 and no traceback, and its log
says which host is excluded, why, and the command that lets it back in.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

import etcd_rdzv
from etcd_rdzv.admission.hosts import exclude
from etcd_rdzv.testing import EtcdServer
from fleet import Fleet

from ._agents import JOB, PHASE_TIMEOUT, agent_argv, agent_env, show, worker_records

pytestmark = pytest.mark.torch

TRAIN_ITERATIONS = 10


def test_an_excluded_hosts_agent_leaves_and_two_train(
    torch_required: None,
    etcd_api_server: EtcdServer,
    etcd_api: str,
    etcd_key_prefix: str,
    tmp_path: Path,
    job_dir: Path,
) -> None:
    run_id = f"excluded-{uuid.uuid4().hex[:8]}"
    kv = etcd_rdzv.create_client(
        etcd_api_server.params(run_id, key_prefix=etcd_key_prefix, api=etcd_api)
    )
    try:
        exclude(kv, etcd_key_prefix, run_id, "host-2", "NIC flaps", seconds=600)
    finally:
        kv.close()

    def argv(host: str) -> list[str]:
        return agent_argv(
            etcd_api_server,
            run_id,
            etcd_key_prefix,
            tmp_path / f"logs-{host}",
            nnodes="2:3",
            max_restarts=3,
            script=JOB,
            script_args=[
                str(job_dir),
                "--finish-world-size=2",
                f"--iterations={TRAIN_ITERATIONS}",
                "--max-seconds=100",
            ],
            api=etcd_api,
            conf=f",host_id={host}",
        )

    with Fleet(tmp_path) as agents:
        for i in range(3):
            agents.run(f"agent{i}", argv(f"host-{i}"), env=agent_env())
        agents.wait_until(
            "every agent exiting by itself",
            lambda: all(a.returncode is not None for a in agents.processes) or None,
            PHASE_TIMEOUT + 30,
            details=lambda: show(job_dir),
        )
        report = f"{show(job_dir)}\n{agents.describe()}"
        excluded = agents.processes[2]
        log = excluded.stderr()

    trained = [r for r in worker_records(job_dir) if r["iterations"] == TRAIN_ITERATIONS]
    assert sorted(r["rank"] for r in trained) == [0, 1], report
    assert {r["agent_pid"] for r in trained} == {a.pid for a in agents.processes[:2]}, report
    assert [a.returncode for a in agents.processes] == [0, 0, 0], report
    assert "Traceback" not in log, report
    assert "Host 'host-2' is excluded from run" in log and "NIC flaps" in log, report
    assert f"etcd-rdzv include --run-id {run_id} --host host-2" in log, report
