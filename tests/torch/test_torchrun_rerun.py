"""torchrun with ``--rdzv-backend=etcd-rdzv``: a job run twice with the same
``--rdzv-id`` (a re-created Kubernetes job, a requeued Slurm job) completes both
times, with no ``etcd-rdzv delete`` in between.

The first run's agents close the run when they finish (torch's launcher calls
``shutdown()``); the second run's first agent starts it again (a new incarnation, see
:mod:`etcd_rdzv.rendezvous.incarnation`), on each etcd API.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

import etcd_rdzv
from etcd_rdzv import _keys
from etcd_rdzv.testing import EtcdServer
from fleet import Fleet

from ..integration._rawkv import raw_get
from ._agents import ALLREDUCE_JOB, PHASE_TIMEOUT, agent_argv, agent_env

pytestmark = pytest.mark.torch


def _run_job(
    server: EtcdServer, api: str, run_id: str, key_prefix: str, tmp_path: Path, name: str
) -> str:
    """Two agents run the all-reduce job to its end; their output."""
    out_dir = tmp_path / name
    out_dir.mkdir()
    argv = agent_argv(
        server,
        run_id,
        key_prefix,
        tmp_path / f"{name}-logs",
        nnodes="2",
        max_restarts=0,
        script=ALLREDUCE_JOB,
        script_args=[str(out_dir)],
        api=api,
    )
    fleet_dir = tmp_path / f"{name}-fleet"
    fleet_dir.mkdir()
    with Fleet(fleet_dir) as agents:
        for i in range(2):
            agents.run(f"{name}-agent{i}", argv, env=agent_env())
        finished = agents.wait_exit(timeout=PHASE_TIMEOUT)
        report = agents.describe()
        assert finished, f"{name}: agents still running after {PHASE_TIMEOUT} s\n{report}"
        assert [a.returncode for a in agents.processes] == [0, 0], f"{name}\n{report}"
    results = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in results] == [2, 2], f"{name}: {results}\n{report}"
    assert [r["value"] for r in results] == [3.0, 3.0], f"{name}: {results}\n{report}"
    return report


def test_a_job_run_twice_with_one_rdzv_id_completes_both_times(
    torch_required: None,
    etcd_api_server: EtcdServer,
    etcd_api: str,
    etcd_key_prefix: str,
    tmp_path: Path,
) -> None:
    run_id = f"rerun-{uuid.uuid4().hex[:8]}"
    url = etcd_api_server.client_url
    closed = _keys.closed_key(etcd_key_prefix, run_id)
    incarnation = _keys.incarnation_key(etcd_key_prefix, run_id)

    _run_job(etcd_api_server, etcd_api, run_id, etcd_key_prefix, tmp_path, "first")
    assert raw_get(url, etcd_api, closed) is not None, "the first run did not close the run"
    first = raw_get(url, etcd_api, incarnation)
    assert first is not None

    # A requeued job comes back later than records.ENDED_TTL (15 s) after the close, in
    # which nothing starts the closed run again (a slow node of the first run must not).
    # What the window's passing brings is its marker gone (its lease runs out; waited
    # for for real in tests/integration/test_rerun.py): deleted here, not waited for.
    kv = etcd_rdzv.create_client(etcd_api_server.params(run_id, api=etcd_api))
    try:
        kv.delete(_keys.ended_key(etcd_key_prefix, run_id))
    finally:
        kv.close()
    report = _run_job(etcd_api_server, etcd_api, run_id, etcd_key_prefix, tmp_path, "second")
    assert "starts it again" in report, "no agent said it started the closed run again"
    second = raw_get(url, etcd_api, incarnation)
    assert second is not None and second.value != first.value, "no new incarnation"
    # The second run ended as the first did: closed, ready for a third.
    assert raw_get(url, etcd_api, closed) is not None
