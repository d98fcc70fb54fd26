"""Under a plain torchrun (no logging set up by anyone), etcd_rdzv's lines reach the
agent's log: a closed run's ERROR at the default level, the join at LOGLEVEL=INFO."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import etcd_rdzv
from etcd_rdzv.testing import EtcdServer
from etcd_rdzv.testing.fleet import child_env

from ._agents import ALLREDUCE_JOB

pytestmark = pytest.mark.torch


def _torchrun(server: EtcdServer, run_id: str, prefix: str, out: Path, **env: str) -> str:
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1",
        "--rdzv-backend=etcd-rdzv", f"--rdzv-endpoint={server.endpoint}",
        f"--rdzv-id={run_id}", f"--rdzv-conf=key_prefix={prefix}", "--max-restarts=0",
        "--local-addr=127.0.0.1", str(ALLREDUCE_JOB), str(out),
    ]  # fmt: skip
    done = subprocess.run(
        argv,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", **env),
    )
    return f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"


def test_etcd_rdzv_lines_reach_a_plain_torchrun_log(
    torch_required: None, etcd_server_v3: EtcdServer, etcd_key_prefix: str, tmp_path: Path
) -> None:
    run_id = f"logs-{uuid.uuid4().hex[:8]}"
    ok = _torchrun(etcd_server_v3, run_id, etcd_key_prefix, tmp_path, LOGLEVEL="INFO")
    assert ok.startswith("exit 0"), ok
    assert "INFO etcd_rdzv.rendezvous.handler: run " in ok, ok
    assert f"run {run_id} round 1 complete" in ok, ok

    # The run is closed now (the agent's shutdown closed it): a second torchrun of it
    # fails, and the reason stands out at the default level, before the traceback.
    etcd_rdzv.create_handler(
        etcd_server_v3.params(run_id, backend="etcd-rdzv", key_prefix=etcd_key_prefix)
    ).set_closed()
    again = _torchrun(etcd_server_v3, run_id, etcd_key_prefix, tmp_path)
    assert not again.startswith("exit 0"), again
    error = next(line for line in again.splitlines() if "ERROR etcd_rdzv" in line)
    assert "is closed" in error and "etcd-rdzv delete --run-id" in error, again
    assert again.index(error) < again.index("Traceback"), again
