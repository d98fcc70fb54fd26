"""torchrun with ``--rdzv-backend=etcd-rdzv``: our own handler under torch's elastic agent.

Each agent is its own torchrun (``torch.distributed.run`` run as ``__main__``, as
``python -m`` does) that finds the handler through the ``torchrun.handlers`` entry
point. The only addition: a handler on the ``etcd_rdzv`` logger, so the agents' output
shows the handler's INFO lines next to torch's.

* two agents run a gloo all-reduce once, on each etcd API (``api=v3`` on an etcd
  without the v2 API);
* scale-up: a third agent arrives while two run; the members see
  ``num_nodes_waiting() > 0``, re-rendezvous, and the job continues with three;
* fault: one of three agents is SIGKILLed with its worker; the other two re-rendezvous
  and continue with two.

The looping job (``_elastic_job.py``) writes one file per worker process, which is how
the tests follow the restarts: no fixed sleeps, only waits on those files.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from etcd_rdzv.testing import EtcdServer

from ..integration._rawkv import raw_get
from ._procs import HERE, Child, Children, child_env

pytestmark = pytest.mark.torch

T = TypeVar("T")

JOB = HERE / "_elastic_job.py"
ALLREDUCE_JOB = HERE / "_allreduce_job.py"
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=60"
MONITOR_INTERVAL = "0.5"
FINISH_ITERATIONS = 10
PHASE_TIMEOUT = 60.0  # seconds for one phase (agents start, re-rendezvous, finish)

# torch.distributed.run as ``python -m`` runs it, plus our logger on stderr.
_LAUNCH = """\
import logging, runpy
handler = logging.StreamHandler()
handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
logger = logging.getLogger("etcd_rdzv")
logger.addHandler(handler)
logger.setLevel(logging.INFO)
runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
"""


def _agent_argv(
    server: EtcdServer,
    run_id: str,
    key_prefix: str,
    log_dir: Path,
    *,
    nnodes: str,
    max_restarts: int,
    script: Path,
    script_args: list[str],
    api: str = "v2",
) -> list[str]:
    return [
        sys.executable,
        "-c",
        _LAUNCH,
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        "--rdzv-backend=etcd-rdzv",
        f"--rdzv-endpoint={server.endpoint}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf=key_prefix={key_prefix},api={api},{RDZV_CONF}",
        f"--max-restarts={max_restarts}",
        f"--monitor-interval={MONITOR_INTERVAL}",
        "--local-addr=127.0.0.1",
        f"--log-dir={log_dir}",
        str(script),
        *script_args,
    ]


def _env() -> dict[str, str]:
    return child_env(LOGLEVEL="INFO", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")


def _records(out_dir: Path) -> list[dict[str, Any]]:
    """What every worker process of the looping job last wrote, oldest pid first."""
    found = []
    for path in out_dir.glob("ws*-rank*-pid*.json"):
        with contextlib.suppress(FileNotFoundError):
            found.append(json.loads(path.read_text()))
    return sorted(found, key=lambda r: (r["world_size"], r["rank"], r["pid"]))


def _show(out_dir: Path) -> str:
    return "worker records:\n" + "\n".join(json.dumps(r) for r in _records(out_dir))


def _wait_for(
    what: str,
    check: Callable[[], T | None],
    agents: Children,
    alive: list[Child],
    out_dir: Path,
    timeout: float = PHASE_TIMEOUT,
) -> T:
    """Poll ``check`` until it returns something; fail if an agent of ``alive`` exits."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found is not None:
            return found
        gone = [c.name for c in alive if c.returncode is not None]
        if gone:
            pytest.fail(
                f"{what}: agent(s) {gone} exited first\n{_show(out_dir)}\n{agents.describe()}"
            )
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout}s\n{_show(out_dir)}\n{agents.describe()}")
        time.sleep(0.1)


def _wait_exit(children: list[Child], timeout: float = PHASE_TIMEOUT) -> bool:
    """Wait until all of ``children`` exited, or one failed; False on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [c.returncode for c in children]
        if all(code is not None for code in codes) or any(code not in (None, 0) for code in codes):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def _full_run(
    out_dir: Path, world_size: int, min_iterations: int, exclude_pids: Collection[int] = ()
) -> list[dict[str, Any]] | None:
    """One record per rank of a run at ``world_size`` by workers not in ``exclude_pids``."""
    records = [
        r
        for r in _records(out_dir)
        if r["world_size"] == world_size
        and r["pid"] not in exclude_pids
        and r["iterations"] >= min_iterations
    ]
    by_rank = {r["rank"]: r for r in records}  # the newest worker of each rank
    if sorted(by_rank) != list(range(world_size)):
        return None
    return [by_rank[rank] for rank in range(world_size)]


def _is_job(pid: int) -> bool:
    try:
        return JOB.name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


@pytest.fixture
def job_dir(tmp_path: Path) -> Iterator[Path]:
    """The job's output directory; afterwards, no worker of the job is left running.

    torch starts each worker in its own session, so killing an agent's process group
    does not reach its worker: the worker notices its agent is gone and exits by
    itself, and this kills whatever is still running anyway.
    """
    out_dir = tmp_path / "results"
    out_dir.mkdir()
    yield out_dir
    for marker in out_dir.glob("pid-*"):
        pid = int(marker.name[len("pid-") :])
        if _is_job(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _job_args(out_dir: Path, finish_world_size: int, stop_file: Path) -> list[str]:
    return [
        str(out_dir),
        f"--finish-world-size={finish_world_size}",
        f"--iterations={FINISH_ITERATIONS}",
        f"--stop-file={stop_file}",
        "--max-seconds=100",
    ]


def test_two_native_agents_all_reduce(
    torch_required: None,
    etcd_api_server: EtcdServer,
    etcd_api: str,
    etcd_key_prefix: str,
    tmp_path: Path,
) -> None:
    run_id = f"native-{uuid.uuid4().hex[:8]}"
    out_dir = tmp_path / "results"
    out_dir.mkdir()
    argv = _agent_argv(
        etcd_api_server,
        run_id,
        etcd_key_prefix,
        tmp_path / "torchelastic-logs",
        nnodes="2",
        max_restarts=0,
        script=ALLREDUCE_JOB,
        script_args=[str(out_dir)],
        api=etcd_api,
    )
    with Children(tmp_path) as agents:
        for i in range(2):
            agents.start(f"agent{i}", argv, _env())
        finished = agents.wait_all(PHASE_TIMEOUT)
        report = agents.describe()
        assert finished, f"agents still running after {PHASE_TIMEOUT} s\n{report}"
        assert [a.returncode for a in agents.children] == [0, 0], report

    written = sorted(p.name for p in out_dir.iterdir())
    assert written == ["rank0.json", "rank1.json"], f"{written}\n{report}"
    results = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(results):
        assert result["rank"] == rank, f"{result}\n{report}"
        assert result["world_size"] == 2, f"{result}\n{report}"
        assert result["value"] == 3.0, f"{result}\n{report}"
        assert result["run_id"] == run_id, f"{result}\n{report}"
        assert result["restart_count"] == "0", f"{result}\n{report}"
    assert sorted(r["group_rank"] for r in results) == ["0", "1"], report

    # The agents met through our handler's keys, under the prefix we gave them, in the
    # keyspace of the API they were told to use.
    result_key = f"{etcd_key_prefix}/{run_id}/rdzv/r1/result"
    result_node = raw_get(etcd_api_server.client_url, etcd_api, result_key)
    assert result_node is not None, f"no round result in etcd\n{report}"
    assert len(json.loads(result_node.value)["members"]) == 2, result_node
    assert "etcd_rdzv.handler: run" in report, "the handler's log lines are missing"


def test_third_agent_scales_the_job_up(
    torch_required: None,
    etcd_server: EtcdServer,
    etcd_key_prefix: str,
    tmp_path: Path,
    job_dir: Path,
) -> None:
    run_id = f"native-up-{uuid.uuid4().hex[:8]}"
    argv = _agent_argv(
        etcd_server,
        run_id,
        etcd_key_prefix,
        tmp_path / "torchelastic-logs",
        nnodes="2:3",
        max_restarts=3,
        script=JOB,
        script_args=_job_args(job_dir, 3, tmp_path / "stop"),
    )
    with Children(tmp_path) as agents:
        first = [agents.start(f"agent{i}", argv, _env()) for i in range(2)]
        two = _wait_for(
            "the job running with world size 2",
            lambda: _full_run(job_dir, 2, min_iterations=2),
            agents,
            first,
            job_dir,
        )
        third = agents.start("agent2", argv, _env())
        finished = _wait_exit(agents.children)
        report = f"{_show(job_dir)}\n{agents.describe()}"
        assert finished, f"agents still running after {PHASE_TIMEOUT} s\n{report}"
        assert [a.returncode for a in agents.children] == [0, 0, 0], report

    first_pids = {a.popen.pid for a in first}
    assert {r["agent_pid"] for r in two} == first_pids, report
    three = _full_run(job_dir, 3, min_iterations=FINISH_ITERATIONS)
    assert three is not None, f"no complete run with world size 3\n{report}"
    assert {r["agent_pid"] for r in three} == first_pids | {third.popen.pid}, report
    for record in three:
        assert record["value"] == 6.0, report
        assert record["iterations"] == FINISH_ITERATIONS, report
        assert record["run_id"] == run_id, report
        assert not record["stopped"], report
    # The members restarted because their monitor saw a waiting node.
    assert any("new nodes from group_rank" in a.stderr() for a in first), report


def test_killed_agent_leaves_the_others_running(
    torch_required: None,
    etcd_server: EtcdServer,
    etcd_key_prefix: str,
    tmp_path: Path,
    job_dir: Path,
) -> None:
    run_id = f"native-kill-{uuid.uuid4().hex[:8]}"
    stop_file = tmp_path / "stop"
    argv = _agent_argv(
        etcd_server,
        run_id,
        etcd_key_prefix,
        tmp_path / "torchelastic-logs",
        nnodes="2:3",
        max_restarts=3,
        script=JOB,
        script_args=_job_args(job_dir, 0, stop_file),
    )
    with Children(tmp_path) as agents:
        for i in range(3):
            agents.start(f"agent{i}", argv, _env())
        three = _wait_for(
            "the job running with world size 3",
            lambda: _full_run(job_dir, 3, min_iterations=2),
            agents,
            agents.children,
            job_dir,
        )
        # The victim: the agent whose worker is rank 0 (it published MASTER_ADDR/PORT).
        worker = three[0]
        victim = next(a for a in agents.children if a.popen.pid == worker["agent_pid"])
        survivors = [a for a in agents.children if a is not victim]
        assert _parent_of(worker["pid"]) == victim.popen.pid, _show(job_dir)
        before = {int(p.name[len("pid-") :]) for p in job_dir.glob("pid-*")}  # every worker yet
        victim.kill()  # the agent's process group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker["pid"], signal.SIGKILL)  # the worker leads its own session

        two = _wait_for(
            "the job running with world size 2 after the kill",
            lambda: _full_run(job_dir, 2, min_iterations=3, exclude_pids=before),
            agents,
            survivors,
            job_dir,
        )
        stop_file.touch()
        finished = _wait_exit(survivors)
        report = f"{_show(job_dir)}\n{agents.describe()}"
        assert finished, f"agents still running after {PHASE_TIMEOUT} s\n{report}"
        assert [a.returncode for a in survivors] == [0, 0], report
        assert victim.returncode == -signal.SIGKILL, report

    assert {r["agent_pid"] for r in two} == {a.popen.pid for a in survivors}, report
    final = _full_run(job_dir, 2, min_iterations=3, exclude_pids=before)
    assert final is not None, report
    for record in final:
        assert record["value"] == 3.0, report
        assert record["stopped"], report
        assert record["run_id"] == run_id, report
    assert final[0]["iterations"] == final[1]["iterations"], report


def test_late_agent_after_finished_run_is_refused(
    torch_required: None, etcd_server: EtcdServer, etcd_key_prefix: str, tmp_path: Path
) -> None:
    """torch's launcher calls shutdown() when an agent is done; torch's handlers close
    the run then, so an agent arriving later fails instead of running the job again."""
    run_id = f"native-late-{uuid.uuid4().hex[:8]}"
    out_dir = tmp_path / "results"
    out_dir.mkdir()

    def argv(nnodes: str) -> list[str]:
        return _agent_argv(
            etcd_server,
            run_id,
            etcd_key_prefix,
            tmp_path / "torchelastic-logs",
            nnodes=nnodes,
            max_restarts=0,
            script=ALLREDUCE_JOB,
            script_args=[str(out_dir)],
        )

    with Children(tmp_path) as agents:
        for i in range(2):
            agents.start(f"agent{i}", argv("2"), _env())
        assert agents.wait_all(PHASE_TIMEOUT), agents.describe()
        assert [a.returncode for a in agents.children] == [0, 0], agents.describe()
        late = agents.start("late", argv("1:2"), _env())
        assert _wait_exit([late]), agents.describe()
        report = agents.describe()
        assert late.returncode != 0, f"a late agent ran the finished job again\n{report}"
        assert "RendezvousClosedError" in late.stderr(), report
    assert json.loads((out_dir / "rank0.json").read_text())["world_size"] == 2, report
