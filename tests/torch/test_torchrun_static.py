"""torchrun with ``--rdzv-backend=etcd-rdzv-static``: fixed ranks, a store in etcd.

* two agents, started in the opposite order of their ranks, one given its rank with
  ``--rdzv-conf=rank=1``, the other through ``$SLURM_NODEID``: the gloo all-reduce
  runs and each worker's ``GROUP_RANK`` is the rank its agent was given; no agent
  hosts a TCPStore for the rendezvous;
* two agents both given rank 0 fail within seconds, naming the rank.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

from etcd_rdzv.testing import EtcdServer
from fleet import Fleet

from ._agents import ALLREDUCE_JOB, PHASE_TIMEOUT, agent_argv, agent_env

pytestmark = pytest.mark.torch


def _argv(
    server: EtcdServer, run_id: str, prefix: str, tmp_path: Path, out_dir: Path, conf: str
) -> list[str]:
    return agent_argv(
        server,
        run_id,
        prefix,
        tmp_path / "torchelastic-logs",
        nnodes="2",
        max_restarts=0,
        script=ALLREDUCE_JOB,
        script_args=[str(out_dir)],
        api="v3",
        backend="etcd-rdzv-static",
        conf=conf,
    )


def test_two_static_agents_all_reduce_with_the_given_ranks(
    torch_required: None, etcd_server_v3: EtcdServer, etcd_key_prefix: str, tmp_path: Path
) -> None:
    run_id = f"static-{uuid.uuid4().hex[:8]}"
    out_dir = tmp_path / "results"
    out_dir.mkdir()
    with Fleet(tmp_path) as agents:
        agents.run(
            "rank1",
            _argv(etcd_server_v3, run_id, etcd_key_prefix, tmp_path, out_dir, ",rank=1"),
            env=agent_env() | {"ETCD_RDZV_TEST_GIVEN_RANK": "1"},
        )
        time.sleep(1.0)  # rank 1 arrives first
        agents.run(
            "rank0",
            _argv(etcd_server_v3, run_id, etcd_key_prefix, tmp_path, out_dir, ""),
            env=agent_env() | {"ETCD_RDZV_TEST_GIVEN_RANK": "0", "SLURM_NODEID": "0"},
        )
        finished = agents.wait_exit(timeout=PHASE_TIMEOUT)
        report = agents.describe()
        assert finished, f"agents still running after {PHASE_TIMEOUT} s\n{report}"
        assert [a.returncode for a in agents.processes] == [0, 0], report

    results = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert result["world_size"] == 2 and result["value"] == 3.0, f"{result}\n{report}"
        assert result["group_rank"] == result["given_rank"], f"{result}\n{report}"
    assert sorted(r["group_rank"] for r in results) == ["0", "1"], report
    # Each agent said where its rank came from.
    assert "claims static rank 1 of 2 (from option rank)" in report, report
    assert "claims static rank 0 of 2 (from $SLURM_NODEID)" in report, report


def test_two_agents_claiming_rank_0_fail_naming_it(
    torch_required: None, etcd_server_v3: EtcdServer, etcd_key_prefix: str, tmp_path: Path
) -> None:
    run_id = f"static-twins-{uuid.uuid4().hex[:8]}"
    out_dir = tmp_path / "results"
    out_dir.mkdir()
    argv = _argv(etcd_server_v3, run_id, etcd_key_prefix, tmp_path, out_dir, ",rank=0")
    started = time.monotonic()
    with Fleet(tmp_path) as agents:
        for name in ("twin-a", "twin-b"):
            agents.run(name, argv, env=agent_env())
        finished = agents.wait_exit(timeout=PHASE_TIMEOUT)
        took = time.monotonic() - started
        report = agents.describe()
        assert finished, f"agents still running after {PHASE_TIMEOUT} s\n{report}"
        assert all(a.returncode not in (0, None) for a in agents.processes), report
        for agent in agents.processes:
            assert "Rank 0 is claimed by more than one live node" in agent.stderr(), report
    print(f"two agents claiming rank 0 both failed {took:.1f}s after they started")
    assert not list(out_dir.iterdir()), "no worker may have started"
