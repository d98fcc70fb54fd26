"""The README's torchrun line, copied as a new user would, survives a killed host.

The line is read from README.md's ``sh`` blocks (the one with
``--rdzv-backend=etcd-rdzv``), and run as written on three "hosts" (three agents on
this machine) against one local etcd. Only what a user must change is changed: the
etcd endpoints (one member here), the training script (``train.py``: the looping job
of these tests) and nothing else; ``--nnodes`` must admit 3 hosts as written. Each
agent gets its own host id through the environment, as three machines would have
three host names. One host, its agent and its worker (torch starts each worker in a
session of its own), is killed; the two others must train again at world size 2
within 30 s.

Without ``--max-restarts`` (torch's default, 0) the survivors' torchrun exits with
``ChildFailedError`` instead, and this test fails.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import sysconfig
import time
from pathlib import Path
from typing import Any

import pytest

from etcd_rdzv.testing import EtcdServer
from fleet import Fleet, Process, child_env

from ._agents import JOB, full_run, show, worker_records

pytestmark = pytest.mark.torch

README = Path(__file__).resolve().parents[2] / "README.md"
HOSTS = 3
RECOVERY_BOUND = 30.0  # seconds from the kill to the survivors' first step at world 2
START_TIMEOUT = 120.0  # seconds: three agents start, wait out the last call (30 s), train

_SH_BLOCK = re.compile(r"^```sh\n(.*?)^```$", re.M | re.S)


def readme_commands(text: str) -> list[str]:
    """Every command of the README's ``sh`` blocks, continuation lines joined."""
    commands: list[str] = []
    for block in _SH_BLOCK.findall(text):
        parts: list[str] = []
        for line in block.splitlines():
            continued = line.endswith("\\")
            parts.append(line.removesuffix("\\").strip())
            if not continued:
                command = " ".join(p for p in parts if p)
                if command:
                    commands.append(command)
                parts = []
    return commands


def readme_torchrun_line() -> list[str]:
    """The README's torchrun line with the native handler, as words."""
    found = [
        shlex.split(c)
        for c in readme_commands(README.read_text(encoding="utf-8"))
        if c.startswith("torchrun ") and "--rdzv-backend=etcd-rdzv " in c + " "
    ]
    assert len(found) == 1, f"README.md: {len(found)} torchrun lines with etcd-rdzv: {found}"
    return found[0]


def as_run_here(words: list[str], endpoint: str, script: list[str]) -> list[str]:
    """The README's line with this machine's torchrun, etcd endpoint and script."""
    assert words[0] == "torchrun", words
    torchrun = shutil.which("torchrun", path=sysconfig.get_path("scripts")) or shutil.which(
        "torchrun"
    )
    assert torchrun is not None, "no torchrun next to this Python or on PATH"
    first_argument = next((i for i, w in enumerate(words) if i and not w.startswith("--")), 0)
    options, rest = words[1:first_argument], words[first_argument:]
    assert first_argument and rest[0].endswith(".py"), f"README: no script in {words}"
    nnodes = next(w.split("=", 1)[1] for w in options if w.startswith("--nnodes="))
    low, _, high = nnodes.partition(":")
    assert int(low) <= HOSTS <= int(high or low), f"--nnodes={nnodes} does not admit {HOSTS}"
    endpoint_options = [w for w in options if w.startswith("--rdzv-endpoint=")]
    assert len(endpoint_options) == 1, options
    options = [f"--rdzv-endpoint={endpoint}" if w in endpoint_options else w for w in options]
    return [torchrun, *options, *script]


def _host_of(agents: Fleet, record: dict[str, Any]) -> Process:
    return next(a for a in agents.processes if a.pid == record["agent_pid"])


def _kill_host(agent: Process, worker_pid: int) -> float:
    """SIGKILL to the agent's session and to its worker's; the moment just before."""
    at = time.monotonic()
    for pid in (agent.pid, worker_pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    return at


def test_the_readme_torchrun_line_survives_a_killed_host(
    torch_required: None, tmp_path: Path, job_dir: Path
) -> None:
    words = readme_torchrun_line()
    assert any(w.startswith("--max-restarts=") for w in words), words  # what recovery needs
    # torchrun runs a script whose name ends in .py with its own Python, as it would
    # run the README's train.py.
    script = [
        str(JOB),
        str(job_dir),
        "--finish-world-size=0",
        f"--stop-file={tmp_path / 'stop'}",
        "--max-seconds=200",
    ]
    with EtcdServer(enable_v2=False) as etcd, Fleet(tmp_path) as agents:
        argv = as_run_here(words, etcd.endpoint, script)
        for i in range(HOSTS):
            agents.run(f"host{i}", argv, env=child_env(ETCD_RDZV_HOST_ID=f"host{i}"))
        three = agents.wait_until(
            "the job training at world size 3",
            lambda: full_run(job_dir, HOSTS, min_iterations=3),
            START_TIMEOUT,
            alive=agents.processes,
            details=lambda: show(job_dir),
        )
        victim_record = three[1]
        victim = _host_of(agents, victim_record)
        survivors = [a for a in agents.processes if a is not victim]
        before = {r["pid"] for r in worker_records(job_dir)}
        killed_at = _kill_host(victim, victim_record["pid"])
        two = agents.wait_until(
            "the survivors training at world size 2",
            lambda: full_run(job_dir, HOSTS - 1, min_iterations=2, exclude_pids=before),
            RECOVERY_BOUND,
            alive=survivors,
            details=lambda: show(job_dir),
        )
        took = max(r["first_step_at"] for r in two) - killed_at
        report = f"{show(job_dir)}\n{agents.describe()}"
        (tmp_path / "stop").touch()
        finished = agents.wait_exit(survivors, timeout=60.0)
    print(f"README's torchrun line: training at world size 2 {took:.1f}s after the kill")
    assert {r["agent_pid"] for r in two} == {s.pid for s in survivors}, report
    assert all(r["value"] == 3.0 for r in two), report  # 1 + 2: the sum over world 2
    assert took < RECOVERY_BOUND, report
    assert finished, f"the survivors did not finish\n{report}"
