"""torchrun, a job's end: the node that finishes first never stops the others' work.

Two agents (``--rdzv-backend=etcd-rdzv``) run one worker each; the worker of the
second works ``DRIFT`` seconds longer. The first agent's workers succeed, its exit
barrier runs out, and its launcher calls ``shutdown()``: the run is closed and its
key deleted while the second worker still works. The second agent must keep that
worker running to its end (it writes its file only then) and both agents exit 0; no
worker starts twice.

torch's launcher gives the exit barrier 300 s and no flag to change it; the agents
here get 1 s (their launch code hands ``exit_barrier_timeout`` to torch's agent), the
same case as nodes that finish more than 300 s apart. torch's own agent test
``test_workers_drift_fail`` is the same job with the barrier at 0.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from etcd_rdzv.testing import EtcdServer
from fleet import Fleet

from ._agents import HERE, PHASE_TIMEOUT, agent_argv, agent_env

pytestmark = pytest.mark.torch

DRIFT_JOB = HERE / "_drift_job.py"
DRIFT = 10.0  # seconds the second node's worker works longer than the first's
EXIT_BARRIER = 1.0  # seconds: the agents' exit barrier

# torch.distributed.run as ``python -m`` runs it, its agents with a short exit barrier.
_LAUNCH = f"""\
import functools, runpy
import torch.distributed.launcher.api as api
api.LocalElasticAgent = functools.partial(
    api.LocalElasticAgent, exit_barrier_timeout={EXIT_BARRIER}
)
runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
"""


def test_the_node_that_finishes_first_leaves_the_others_working(
    torch_required: None,
    etcd_api_server: EtcdServer,
    etcd_api: str,
    etcd_key_prefix: str,
    tmp_path: Path,
) -> None:
    run_id = f"drift-{uuid.uuid4().hex[:8]}"
    out_dir = tmp_path / "results"
    out_dir.mkdir()
    argv = agent_argv(
        etcd_api_server,
        run_id,
        etcd_key_prefix,
        tmp_path / "torchelastic-logs",
        nnodes="2",
        max_restarts=0,
        script=DRIFT_JOB,
        script_args=[str(out_dir)],
        api=etcd_api,
    )
    assert argv[1] == "-c"
    argv[2] = _LAUNCH
    with Fleet(tmp_path) as agents:
        fast = agents.run("fast", argv, env={**agent_env(), "ETCD_RDZV_TEST_DRIFT": "0"})
        slow = agents.run("slow", argv, env={**agent_env(), "ETCD_RDZV_TEST_DRIFT": str(DRIFT)})
        finished = agents.wait_exit([fast, slow], timeout=PHASE_TIMEOUT)
        report = agents.describe()
    assert finished, f"agents still running after {PHASE_TIMEOUT} s\n{report}"
    assert (fast.returncode, slow.returncode) == (0, 0), report

    done = sorted(out_dir.glob("done-rank*.json"))
    records = [json.loads(p.read_text()) for p in done]
    assert sorted(r["drift"] for r in records) == [0.0, DRIFT], (
        f"the slow worker did not finish its work: {records}\n{report}"
    )
    for record in records:
        assert (record["world_size"], record["sum"]) == (2, 1.0), f"{record}\n{report}"
        assert record["restart_count"] == "0", f"{record}\n{report}"
    started = sorted(p.name for p in out_dir.glob("start-rank*.json"))
    assert len(started) == 2, f"a worker started again: {started}\n{report}"
