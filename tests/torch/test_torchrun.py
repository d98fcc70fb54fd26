"""torchrun with ``--rdzv-backend=etcd-rdzv-dynamic``: two agents meet through etcd.

torch finds our handler through the ``torchrun.handlers`` entry point; nothing here
registers it by hand. Each agent is its own ``python -m torch.distributed.run``.
"""

from __future__ import annotations

import json
import pickle
import sys
import uuid
from pathlib import Path

import pytest

import etcd_rdzv
from etcd_rdzv.testing import EtcdServer
from fleet import Fleet, child_env

pytestmark = pytest.mark.torch

HERE = Path(__file__).resolve().parent

AGENTS = 2
AGENT_TIMEOUT = 120.0  # seconds for both agents together; they normally need ~15


def test_entry_point_is_registered(torch_required: None) -> None:
    from importlib.metadata import entry_points

    from etcd_rdzv import _factory

    found = [e for e in entry_points(group="torchrun.handlers") if e.name == "etcd-rdzv-dynamic"]
    assert len(found) == 1, found
    assert found[0].load() is _factory.dynamic_handler
    assert callable(_factory.dynamic_handler())


def test_handler_from_torch_registry(
    torch_required: None, etcd_server: EtcdServer, etcd_key_prefix: str
) -> None:
    """What torchrun does: torch's own parameters class, through torch's registry."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
    )

    run_id = f"reg-{uuid.uuid4().hex[:8]}"
    params = RendezvousParameters(
        "etcd-rdzv-dynamic",
        etcd_server.endpoint,
        run_id,
        1,
        1,
        key_prefix=etcd_key_prefix,
        join_timeout="30",
        last_call_timeout="1",
    )
    handler = registry.get_rendezvous_handler(params)
    assert isinstance(handler, DynamicRendezvousHandler)
    assert handler.get_backend() == "etcd-rdzv-dynamic"
    assert handler.get_run_id() == run_id
    assert handler.settings.timeout.join.total_seconds() == 30
    assert handler.settings.timeout.last_call.total_seconds() == 1

    info = handler.next_rendezvous()
    try:
        assert (info.rank, info.world_size) == (0, 1)
        info.store.set("through-handler", b"yes")
    finally:
        handler.shutdown()
    assert handler.is_closed()

    _, store = etcd_rdzv.create_backend(etcd_server.params(run_id, key_prefix=etcd_key_prefix))
    assert store.get(f"torch.rendezvous.{run_id}.0/through-handler") == b"yes"


def test_two_torchrun_agents_all_reduce(
    torch_required: None, etcd_server: EtcdServer, etcd_key_prefix: str, tmp_path: Path
) -> None:
    run_id = f"torchrun-{uuid.uuid4().hex[:8]}"
    out_dir = tmp_path / "results"
    out_dir.mkdir()
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={AGENTS}",
        "--nproc-per-node=1",
        "--rdzv-backend=etcd-rdzv-dynamic",
        f"--rdzv-endpoint={etcd_server.endpoint}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf=key_prefix={etcd_key_prefix},join_timeout=60,last_call_timeout=1",
        "--max-restarts=0",
        "--local-addr=127.0.0.1",
        f"--log-dir={tmp_path / 'torchelastic-logs'}",
        str(HERE / "_allreduce_job.py"),
        str(out_dir),
    ]
    with Fleet(tmp_path) as agents:
        for i in range(AGENTS):
            agents.run(f"agent{i}", argv, env=child_env(LOGLEVEL="INFO"))
        finished = agents.wait_exit(timeout=AGENT_TIMEOUT)
        report = agents.describe()
        assert finished, f"agents still running after {AGENT_TIMEOUT} s\n{report}"
        assert [a.returncode for a in agents.processes] == [0] * AGENTS, report

    written = sorted(p.name for p in out_dir.iterdir())
    assert written == [f"rank{r}.json" for r in range(AGENTS)], f"{written}\n{report}"
    results = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(AGENTS)]
    expected = float(sum(range(1, AGENTS + 1)))
    for rank, result in enumerate(results):
        assert result["rank"] == rank, f"{result}\n{report}"
        assert result["env_rank"] == str(rank), f"{result}\n{report}"
        assert result["world_size"] == AGENTS, f"{result}\n{report}"
        assert result["value"] == expected, f"{result}\n{report}"
        assert result["run_id"] == run_id, f"{result}\n{report}"
        assert result["restart_count"] == "0", f"{result}\n{report}"
    # One worker per agent, so the agents got distinct group ranks from the rendezvous.
    assert sorted(r["group_rank"] for r in results) == ["0", "1"], report

    # The agents met through etcd, under the prefix we gave them, and closed the run.
    backend, _ = etcd_rdzv.create_backend(etcd_server.params(run_id, key_prefix=etcd_key_prefix))
    assert backend.key.startswith(etcd_key_prefix + "/")
    found = backend.get_state()
    assert found is not None, "no rendezvous state in etcd under the run's key"
    state = pickle.loads(found[0])  # torch's own _RendezvousState, as its handler wrote it
    assert state.closed is True, vars(state)
    assert len(state.participants) == AGENTS, vars(state)
