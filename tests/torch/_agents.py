"""What the torchrun tests share: the agents' command line, the looping job's
records, and waits on them (every wait bounded; an agent that exits early fails it).

The looping job (``_elastic_job.py``) writes one file per worker process, which is how
the tests follow restarts: no fixed sleeps, only waits on those files.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, TypeVar

from etcd_rdzv.testing import EtcdCluster, EtcdServer
from fleet import Fleet, Process, child_env

T = TypeVar("T")

HERE = Path(__file__).resolve().parent
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


def agent_argv(
    server: EtcdServer | EtcdCluster,
    run_id: str,
    key_prefix: str,
    log_dir: Path,
    *,
    nnodes: str,
    max_restarts: int,
    script: Path,
    script_args: list[str],
    api: str = "v2",
    backend: str = "etcd-rdzv",
    conf: str = "",
    rdzv_conf: str = RDZV_CONF,
    monitor_interval: str | None = MONITOR_INTERVAL,
) -> list[str]:
    """``rdzv_conf``: the settings before ``conf`` (the tests' fast ones by default);
    ``monitor_interval`` ``None``: torch's default."""
    monitor = [] if monitor_interval is None else [f"--monitor-interval={monitor_interval}"]
    return [
        sys.executable,
        "-c",
        _LAUNCH,
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={server.endpoint}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf=key_prefix={key_prefix},api={api},{rdzv_conf}{conf}",
        f"--max-restarts={max_restarts}",
        *monitor,
        "--local-addr=127.0.0.1",
        f"--log-dir={log_dir}",
        str(script),
        *script_args,
    ]


def agent_env() -> dict[str, str]:
    return child_env(LOGLEVEL="INFO", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")


def worker_records(out_dir: Path) -> list[dict[str, Any]]:
    """What every worker process of the looping job last wrote, oldest pid first."""
    found = []
    for path in out_dir.glob("ws*-rank*-pid*.json"):
        with contextlib.suppress(FileNotFoundError):
            found.append(json.loads(path.read_text()))
    return sorted(found, key=lambda r: (r["world_size"], r["rank"], r["pid"]))


def show(out_dir: Path) -> str:
    return "worker records:\n" + "\n".join(json.dumps(r) for r in worker_records(out_dir))


def wait_for(
    what: str, check: Callable[[], T | None], agents: Fleet, alive: list[Process], out_dir: Path
) -> T:
    """Poll ``check`` until it returns something; fail if an agent of ``alive`` exits."""
    return agents.wait_until(what, check, PHASE_TIMEOUT, alive=alive, details=lambda: show(out_dir))


def full_run(
    out_dir: Path, world_size: int, min_iterations: int, exclude_pids: Collection[int] = ()
) -> list[dict[str, Any]] | None:
    """One record per rank of a run at ``world_size`` by workers not in ``exclude_pids``."""
    records = [
        r
        for r in worker_records(out_dir)
        if r["world_size"] == world_size
        and r["pid"] not in exclude_pids
        and r["iterations"] >= min_iterations
    ]
    by_rank = {r["rank"]: r for r in records}  # the newest worker of each rank
    if sorted(by_rank) != list(range(world_size)):
        return None
    return [by_rank[rank] for rank in range(world_size)]


def is_job(pid: int) -> bool:
    try:
        return JOB.name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def job_args(out_dir: Path, finish_world_size: int, stop_file: Path) -> list[str]:
    return [
        str(out_dir),
        f"--finish-world-size={finish_world_size}",
        f"--iterations={FINISH_ITERATIONS}",
        f"--stop-file={stop_file}",
        "--max-seconds=100",
    ]


def running(
    agents: Fleet, argv: list[str], count: int, out_dir: Path, world_size: int, iterations: int
) -> list[dict[str, Any]]:
    """Start ``count`` agents; the workers' records once the job runs at ``world_size``."""
    for i in range(count):
        agents.run(f"agent{i}", argv, env=agent_env())
    return wait_for(
        f"the job running with world size {world_size}",
        lambda: full_run(out_dir, world_size, min_iterations=iterations),
        agents,
        agents.processes,
        out_dir,
    )


def finish(agents: Fleet, survivors: list[Process], stop_file: Path, out_dir: Path) -> str:
    """Stop the job; the agents' report once the survivors exited."""
    stop_file.touch()
    finished = agents.wait_exit(survivors, timeout=PHASE_TIMEOUT)
    report = f"{show(out_dir)}\n{agents.describe()}"
    assert finished, f"agents still running\n{report}"
    return report
