"""torchrun with a health check: a host whose check fails is kept out of the job.

Three agents at ``--nnodes=2:3``, each its own host (``host_id``); the third one's
``health_check`` fails. The other two train together (world size 2, no restart) and
end the job; the third never joins a round and its agent exits by itself once its
``join_timeout`` is spent, with status 1 (a failure of that host, for the scheduler to
see) and the check, the host and the check's output in its log. Its shutdown does not
close the run (it never was in the job).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from etcd_rdzv.testing import EtcdServer
from fleet import Fleet

from ._agents import JOB, PHASE_TIMEOUT, RDZV_CONF, agent_argv, agent_env, show, worker_records

pytestmark = pytest.mark.torch

TRAIN_ITERATIONS = 20
BAD_JOIN_TIMEOUT = 15


def test_an_agent_whose_check_fails_exits_and_the_others_train_with_two(
    torch_required: None,
    etcd_api_server: EtcdServer,
    etcd_api: str,
    etcd_key_prefix: str,
    tmp_path: Path,
    job_dir: Path,
) -> None:
    run_id = f"health-{uuid.uuid4().hex[:8]}"
    check = tmp_path / "check.sh"
    check.write_text("#!/bin/sh\necho nvidia-smi: 7 of 8 GPUs\necho gpu 3 missing\nexit 4\n")
    check.chmod(0o755)

    def argv(host: str, conf: str = "", rdzv_conf: str = RDZV_CONF) -> list[str]:
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
            conf=f",host_id={host}{conf}",
            rdzv_conf=rdzv_conf,
        )

    bad_conf = RDZV_CONF.replace("join_timeout=60", f"join_timeout={BAD_JOIN_TIMEOUT}")
    assert bad_conf != RDZV_CONF
    with Fleet(tmp_path) as agents:
        bad = agents.run("bad", argv("gpu-c", f",health_check={check}", bad_conf), env=agent_env())
        for host in ("gpu-a", "gpu-b"):
            agents.run(host, argv(host), env=agent_env())
        agents.wait_until(
            "every agent exiting by itself",
            lambda: all(a.returncode is not None for a in agents.processes) or None,
            PHASE_TIMEOUT + BAD_JOIN_TIMEOUT,
            details=lambda: show(job_dir),
        )
        report = f"{show(job_dir)}\n{agents.describe()}"

    records = worker_records(job_dir)
    trained = [r for r in records if r["iterations"] == TRAIN_ITERATIONS]
    assert len({r["pid"] for r in records}) == 2, f"not one worker per good host\n{report}"
    assert sorted(r["rank"] for r in trained) == [0, 1], report
    assert {r["world_size"] for r in trained} == {2}, report
    assert {r["restart_count"] for r in trained} == {"0"}, report
    assert bad.pid not in {r["agent_pid"] for r in records}, report
    good = [a for a in agents.processes if a is not bad]
    assert [a.returncode for a in good] == [0, 0], report
    assert bad.returncode == 1, report
    log = bad.stderr()
    for part in ("failed its health check", str(check), "'gpu-c'", "exit code 4", "gpu 3 missing"):
        assert part in log, f"{part!r} not in the bad agent's log\n{report}"
    assert "HealthCheckError" in log, report
