"""Under a plain torchrun (no logging set up by anyone), etcd_rdzv's lines reach the
agent's log: a closed run's ERROR at the default level, the join at LOGLEVEL=INFO; and
at the default level (LOGLEVEL unset) the events a person follows a job by: the dead
member named and the new round, a lone agent's wait, the launcher that will not
restart failed workers."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import pytest

import etcd_rdzv
from etcd_rdzv.config._options import ENV_HOST_ID
from etcd_rdzv.testing import EtcdServer
from fleet import Fleet, child_env

from ._agents import (
    ALLREDUCE_JOB,
    JOB,
    agent_argv,
    agent_env,
    finish,
    full_run,
    job_args,
    wait_for,
    worker_records,
)

pytestmark = pytest.mark.torch

T = TypeVar("T")


def _torchrun(
    server: EtcdServer, run_id: str, prefix: str, out: Path, conf: str = "", **env: str
) -> str:
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1",
        "--rdzv-backend=etcd-rdzv", f"--rdzv-endpoint={server.endpoint}",
        f"--rdzv-id={run_id}", f"--rdzv-conf=key_prefix={prefix}{conf}", "--max-restarts=0",
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
    assert "INFO etcd_rdzv.rendezvous.join: run " in ok, ok
    assert re.search(rf"INFO etcd_rdzv.events: run {run_id}: node \S+: round 1 formed", ok), ok

    # The run is closed now (the agent's shutdown closed it): a second torchrun of it
    # that may not start it again fails, and the reason stands out at the default
    # level, before the traceback.
    etcd_rdzv.create_handler(
        etcd_server_v3.params(run_id, backend="etcd-rdzv", key_prefix=etcd_key_prefix)
    ).set_closed()
    strict = ",restart_closed_run=false"
    again = _torchrun(etcd_server_v3, run_id, etcd_key_prefix, tmp_path, conf=strict)
    assert not again.startswith("exit 0"), again
    error = next(line for line in again.splitlines() if "ERROR etcd_rdzv" in line)
    assert "is closed" in error and "etcd-rdzv delete --run-id" in error, again
    assert again.index(error) < again.index("Traceback"), again


# -- the default log level: what a person sees with LOGLEVEL unset --------------------------


def _plain(argv: list[str]) -> list[str]:
    """``agent_argv``'s command as a plain torchrun runs it: nobody configures logging."""
    assert argv[1] == "-c"
    return [sys.executable, "-m", "torch.distributed.run", *argv[3:]]


def _default_env() -> dict[str, str]:
    env = agent_env()
    env.pop("LOGLEVEL")  # torch's default: WARNING
    return env


def _ours(log: str) -> list[str]:
    """etcd_rdzv's lines in an agent's log."""
    return [line for line in log.splitlines() if " etcd_rdzv" in line]


def _node_of(log: str, round_no: int) -> str:
    """The node id an agent's log gives itself in the event of ``round_no``."""
    found = re.search(rf"INFO etcd_rdzv\.events: run \S+: node (\S+): round {round_no} formed", log)
    assert found, log
    return found.group(1)


def test_at_the_default_level_the_survivors_name_the_dead_node_and_the_new_round(
    torch_required: None,
    etcd_server_v3: EtcdServer,
    etcd_key_prefix: str,
    tmp_path: Path,
    job_dir: Path,
) -> None:
    run_id = f"dead-{uuid.uuid4().hex[:8]}"
    argv = agent_argv(
        etcd_server_v3, run_id, etcd_key_prefix, tmp_path / "logs", nnodes="2:3",
        max_restarts=3, script=JOB, api="v3",
        script_args=job_args(job_dir, finish_world_size=0, stop_file=tmp_path / "stop"),
    )  # fmt: skip
    with Fleet(tmp_path) as agents:
        for i in range(3):
            agents.run(f"agent{i}", _plain(argv), env={**_default_env(), ENV_HOST_ID: f"host-{i}"})
        three = wait_for(
            "the job running at world size 3",
            lambda: full_run(job_dir, 3, min_iterations=2),
            agents,
            agents.processes,
            job_dir,
        )
        victim = next(a for a in agents.processes if a.pid == three[1]["agent_pid"])
        survivors = [a for a in agents.processes if a is not victim]
        dead = _node_of(victim.stderr(), 1)
        dead_host = f"host-{agents.processes.index(victim)}"
        before = {r["pid"] for r in worker_records(job_dir)}
        for pid in (victim.pid, three[1]["pid"]):  # the worker runs in a session of its own
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        wait_for(
            "the survivors training at world size 2",
            lambda: full_run(job_dir, 2, min_iterations=2, exclude_pids=before),
            agents,
            survivors,
            job_dir,
        )
        logs = [s.stderr() for s in survivors]
        finish(agents, survivors, tmp_path / "stop", job_dir)
    for log in logs:
        formed = [line for line in _ours(log) if " formed: world size 2," in line]
        assert formed, log
        # The dead member named, with its host and address; nothing of it in round 2.
        named = f"not back from round 1: {dead!r} (host {dead_host!r}, address '127.0.0.1')"
        assert named in formed[0], log
        # Without noise: etcd_rdzv's INFO lines are the events only, and --max-restarts
        # was given, so no warning about it.
        noise = [line for line in _ours(log) if "INFO" in line and "etcd_rdzv.events" not in line]
        assert noise == [], log
        assert "--max-restarts is 0" not in log, log


def test_a_lone_agent_says_what_it_waits_for_and_that_it_would_not_restart(
    torch_required: None, etcd_server_v3: EtcdServer, etcd_key_prefix: str, tmp_path: Path
) -> None:
    run_id = f"lone-{uuid.uuid4().hex[:8]}"
    # torchrun's defaults: no --max-restarts, join_timeout 600 s.
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
        "--rdzv-backend=etcd-rdzv", f"--rdzv-endpoint={etcd_server_v3.endpoint}",
        f"--rdzv-id={run_id}", f"--rdzv-conf=key_prefix={etcd_key_prefix}",
        "--local-addr=127.0.0.1", str(ALLREDUCE_JOB), str(tmp_path),
    ]  # fmt: skip
    with Fleet(tmp_path) as agents:
        lone = agents.run("lone", argv, env=_default_env())
        started = time.monotonic()
        line = agents.wait_until(
            "the lone agent saying what it waits for",
            lambda: next((x for x in _ours(lone.stderr()) if "has waited" in x), None),
            60.0,
            alive=[lone],
        )
        took = time.monotonic() - started
        log = lone.stderr()
    assert "INFO etcd_rdzv.events" in line, log
    assert re.search(
        r"1 of 2 node\(s\) joined \(min 2, max 2\); waiting for more \(\d+s left of join_timeout\)",
        line,
    ), log
    assert took < 60.0
    warning = next(x for x in _ours(log) if "--max-restarts is 0" in x)
    assert "WARNING etcd_rdzv.torch" in warning and "set --max-restarts=N" in warning, log
    # Said once, at the start, before any wait.
    assert log.count("--max-restarts is 0") == 1, log
    assert log.index(warning) < log.index(line), log


def _agent_shuts_down_first() -> bool:
    """Whether torch's agent calls its handler's ``shutdown()`` from ``run()`` when its
    workers failed (torch 2.6 and 2.7; removed in 2.8 by pytorch#152525)."""
    try:
        import torch
    except ImportError:
        return False
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    return (major, minor) < (2, 8)


_AGENT_SHUTS_DOWN_FIRST = _agent_shuts_down_first()


def test_an_agent_that_gives_up_says_it_closes_the_run_for_the_others(
    torch_required: None,
    etcd_server_v3: EtcdServer,
    etcd_key_prefix: str,
    tmp_path: Path,
    job_dir: Path,
) -> None:
    run_id = f"gaveup-{uuid.uuid4().hex[:8]}"
    argv = agent_argv(
        etcd_server_v3, run_id, etcd_key_prefix, tmp_path / "logs", nnodes="2",
        max_restarts=0, script=JOB, api="v3",
        script_args=job_args(job_dir, finish_world_size=0, stop_file=tmp_path / "stop"),
    )  # fmt: skip
    with Fleet(tmp_path) as agents:
        for i in range(2):
            agents.run(f"agent{i}", _plain(argv), env=_default_env())
        two = wait_for(
            "the job running at world size 2",
            lambda: full_run(job_dir, 2, min_iterations=2),
            agents,
            agents.processes,
            job_dir,
        )
        os.kill(two[1]["pid"], signal.SIGKILL)  # one worker dies; its agent gives up
        assert agents.wait_exit(agents.processes, timeout=60.0), agents.describe()
        logs = [a.stderr() for a in agents.processes]
    # Both were told at the start; the one that closed the run while the other was
    # still a live member says so, and what to set.
    assert all("--max-restarts is 0" in log for log in logs), logs
    said = [
        line
        for log in logs
        for line in _ours(log)
        if "closes the run for every node: its workers failed" in line
    ]
    if _AGENT_SHUTS_DOWN_FIRST:
        # torch 2.6 and 2.7: the agent's run() shuts the handler down itself, before
        # the launcher raises ChildFailedError, so the handler cannot tell a failure
        # from a finish (a known difference: docs/handler.md, "torchrun's
        # --max-restarts"); the warning at the start is what these releases get.
        assert not said, said
        return
    assert said, logs
    assert "WARNING etcd_rdzv.torch" in said[0], said
    assert "torchrun's --max-restarts is 0" in said[0] and "--max-restarts=N" in said[0], said


def _launch_agent(config: object, build: Callable[[], T]) -> T:
    """``build()`` called as torch's launcher calls a handler's creator: inside a
    function ``launch_agent(config, ...)`` of the module ``torch.distributed.launcher.api``
    (a stand-in defined in a namespace of that name; the real one runs in the torchrun
    tests above)."""
    space: dict[str, Any] = {"__name__": "torch.distributed.launcher.api"}
    exec("def launch_agent(config, build):\n    return build()\n", space)
    result: T = space["launch_agent"](config, build)
    return result


def test_max_restarts_is_read_from_the_launcher_on_the_stack(
    torch_required: None,
    etcd_server_v3: EtcdServer,
    etcd_key_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from etcd_rdzv._factory import dynamic_handler
    from etcd_rdzv.torch import launcher_max_restarts

    assert launcher_max_restarts() is None  # no launcher here
    for value, read in ((0, 0), (3, 3), ("3", None), (True, None)):
        config = SimpleNamespace(max_restarts=value)
        assert _launch_agent(config, launcher_max_restarts) == read
    assert _launch_agent(object(), launcher_max_restarts) is None

    # The dynamic handler's creator warns too (torch's handler, our backend).
    params = etcd_server_v3.params(
        f"dyn-{uuid.uuid4().hex[:8]}", min_nodes=1, max_nodes=2, key_prefix=etcd_key_prefix
    )
    for restarts, warned in ((0, True), (2, False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="etcd_rdzv"):
            handler = _launch_agent(
                SimpleNamespace(max_restarts=restarts), lambda: dynamic_handler()(params)
            )
        handler.shutdown()
        said = [r.getMessage() for r in caplog.records if "--max-restarts is 0" in r.getMessage()]
        assert len(said) == (1 if warned else 0), said
