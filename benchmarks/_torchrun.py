"""Hosts of the recovery benchmark: torchrun agents (or in-process workers) as
processes, the signals that fault them, and the steps their workers
(:mod:`benchmarks._train_job`, :mod:`benchmarks._inprocess_job`) recorded.

A "host" is one torchrun agent and every process under it. torchrun starts each worker
with ``start_new_session=True``, so a host is found by walking ``/proc/*/stat`` for
parent pids; no signal ever goes to a process group. For the in-process handler a host
is one process that runs ``etcd_rdzv.inprocess.run`` (no launcher, nothing under it).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from fleet import child_env

JOB = Path(__file__).resolve().with_name("_train_job.py")

# The handlers of the recovery part: torchrun's --rdzv-backend and the etcd API the
# handler talks (None: no etcd). torch's etcd handlers speak v2 only. "inprocess" is
# no torchrun backend: etcd_rdzv.inprocess.run in plain processes (_inprocess_job);
# "nvrx" neither: NVRx's in-process Wrapper in plain processes (_nvrx_job), on its own
# TCPStores or on ours (EtcdWrapperStore and pg_store: v3 only, where it is tested).
# The faster detection setting docs/handler.md documents (a node TTL of 2 s).
FAST = "keep_alive_interval=1,keep_alive_max_attempt=2"

BACKENDS: dict[str, tuple[str, str | None]] = {
    "ours/v3": ("etcd-rdzv", "v3"),
    "ours/v2": ("etcd-rdzv", "v2"),
    "ours-fast/v3": ("etcd-rdzv", "v3"),
    "ours-fast/v2": ("etcd-rdzv", "v2"),
    "ours-dynamic/v3": ("etcd-rdzv-dynamic", "v3"),
    "ours-dynamic/v2": ("etcd-rdzv-dynamic", "v2"),
    "etcd-v2/v2": ("etcd-v2", "v2"),
    "etcd/v2": ("etcd", "v2"),
    "c10d": ("c10d", None),
    "inprocess/v3": ("inprocess", "v3"),
    "inprocess/v2": ("inprocess", "v2"),
    "nvrx-tcpstore": ("nvrx", None),
    "nvrx-etcd/v3": ("nvrx", "v3"),
}


@dataclass(frozen=True)
class Step:
    """One line a worker wrote: a step done (``world`` > 0) or the worker's start (0).
    ``restarts`` is torchrun's restart count, or in-process the function's call (0
    first); ``agent`` the agent's pid, or in-process the worker's own."""

    t: float
    world: int
    rank: int
    restarts: int
    pid: int
    agent: int
    group: int


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:
        return int(stat.rsplit(")", 1)[1].split()[1])
    except (IndexError, ValueError):
        return None


def descendants(pid: int) -> list[int]:
    """Every live process under ``pid`` (children first found by their parent pid)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _parent(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


class Host:
    """One torchrun agent (``--nproc-per-node=1``) in a session of its own, its output
    in ``log``."""

    def __init__(self, name: str, argv: list[str], log: Path) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        self._out: IO[bytes] = log.open("wb")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env=child_env(LOGLEVEL=os.environ.get("LOGLEVEL", "INFO")),
            start_new_session=True,
        )
        self.frozen = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tree(self) -> list[int]:
        """The agent and every process under it, the agent first."""
        return [self.pid, *descendants(self.pid)]

    def freeze(self) -> float:
        """SIGSTOP the agent, then everything under it (twice: a child started
        meanwhile is caught by the second walk). The moment of the first signal."""
        self.frozen = True
        tree = self.tree()
        now = time.monotonic()
        _signal(tree, signal.SIGSTOP)
        for _ in range(2):
            _signal(descendants(self.pid), signal.SIGSTOP)
        return now

    def kill(self) -> float:
        """SIGKILL the agent and everything under it (a host that dies); the moment of
        the first signal (walking ``/proc`` first takes a while on a busy machine)."""
        tree = self.tree()
        now = time.monotonic()
        _signal(tree, signal.SIGKILL)
        _signal(descendants(self.pid), signal.SIGKILL)
        return now

    def terminate(self) -> float:
        """SIGTERM to the agent alone (an operator scaling down): torchrun stops its
        workers and leaves the rendezvous. The moment of the signal."""
        now = time.monotonic()
        _signal([self.pid], signal.SIGTERM)
        return now

    def close(self) -> None:
        """Thaw (a frozen process cannot die before it runs again) and kill the whole
        host, then reap the agent."""
        tree = self.tree()
        _signal(tree, signal.SIGCONT)
        _signal(tree, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._out.close()

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no output)"


def torchrun_argv(
    handler: str,
    endpoint: str,
    run_id: str,
    nnodes: str,
    out_dir: Path,
    worker_timeout: float,
) -> list[str]:
    """The agent's command line: torch's defaults (monitor interval 0.1 s, each
    handler's own rendezvous settings) except what must be set: the API of our
    handler, a loopback address, and restarts enough for every fault."""
    backend, api = BACKENDS[handler]
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        "--max-restarts=100",
        "--local-addr=127.0.0.1",
    ]
    if backend.startswith("etcd-rdzv"):
        fast = f",{FAST}" if handler.startswith("ours-fast/") else ""
        argv.append(f"--rdzv-conf=api={api}{fast}")
    return [*argv, str(JOB), str(out_dir), f"--timeout={worker_timeout:g}"]


def host_argv(
    handler: str,
    endpoint: str,
    run_id: str,
    nnodes: str,
    out_dir: Path,
    worker_timeout: float,
) -> list[str]:
    """A host's command line: a torchrun agent (:func:`torchrun_argv`), or for the
    in-process handler the worker itself, with the rendezvous defaults but its API."""
    backend, api = BACKENDS[handler]
    if backend != "inprocess":
        return torchrun_argv(handler, endpoint, run_id, nnodes, out_dir, worker_timeout)
    return [
        sys.executable,
        "-m",
        "benchmarks._inprocess_job",
        str(out_dir),
        f"--endpoint={endpoint}",
        f"--run-id={run_id}",
        f"--nnodes={nnodes}",
        f"--api={api}",
        f"--timeout={worker_timeout:g}",
    ]


def nvrx_argv(
    handler: str,
    endpoint: str,
    run_id: str,
    out_dir: Path,
    worker_timeout: float,
    rank: int,
    world: int,
    master_port: int,
) -> list[str]:
    """An NVRx host's command line (:mod:`benchmarks._nvrx_job`): rank ``rank`` of a
    fixed ``world``, as NVRx's example starts its ranks; the stores by ``handler``."""
    backend, api = BACKENDS[handler]
    if backend != "nvrx":
        raise ValueError(f"handler {handler!r} is not an NVRx handler")
    argv = [
        sys.executable,
        "-m",
        "benchmarks._nvrx_job",
        str(out_dir),
        f"--rank={rank}",
        f"--world={world}",
        f"--master-port={master_port}",
        f"--timeout={worker_timeout:g}",
    ]
    if api is None:
        return [*argv, "--store=tcp"]
    return [*argv, "--store=etcd", f"--endpoint={endpoint}", f"--run-id={run_id}", f"--api={api}"]


@dataclass
class Steps:
    """The steps every worker wrote to ``out_dir``, read incrementally."""

    out_dir: Path
    steps: list[Step] = field(default_factory=list)
    _offsets: dict[Path, int] = field(default_factory=dict)

    def read(self) -> list[Step]:
        for path in sorted(self.out_dir.glob("w-*.jsonl")):
            offset = self._offsets.get(path, 0)
            with path.open("rb") as f:
                f.seek(offset)
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line being written is read next time
            for line in data[:end].splitlines():
                with contextlib.suppress(ValueError, TypeError):
                    t, world, rank, restarts, pid, agent, group = json.loads(line)
                    self.steps.append(Step(t, world, rank, restarts, pid, agent, group))
            self._offsets[path] = offset + end
        return self.steps


def trained(steps: list[Step], world: int, since: float) -> tuple[int, float] | None:
    """The first worker group at ``world`` size whose every rank completed a step after
    ``since``: (its group, the moment its last rank did), or None."""
    first: dict[int, dict[int, float]] = {}
    for s in steps:
        if s.world == world and s.t > since:
            ranks = first.setdefault(s.group, {})
            ranks[s.rank] = min(ranks.get(s.rank, s.t), s.t)
    done = [
        (max(ranks.values()), group)
        for group, ranks in first.items()
        if sorted(ranks) == list(range(world))
    ]
    if not done:
        return None
    moment, group = min(done)
    return group, moment


def final_group(steps: list[Step]) -> Step | None:
    """The newest step of all (its group is the one training at the end)."""
    done = [s for s in steps if s.world > 0]
    return max(done, key=lambda s: s.t) if done else None


def ranks_of(steps: list[Step], group: int) -> dict[int, int]:
    """agent pid -> rank, in one worker group."""
    return {s.agent: s.rank for s in steps if s.group == group and s.world > 0}


def starts_after(steps: list[Step], since: float) -> list[Step]:
    """The workers that started after ``since`` (their first line)."""
    return [s for s in steps if s.world == 0 and s.t > since]


def calls_after(steps: list[Step], since: float) -> int:
    """In-process: the function's calls again (call > 0) of any process whose first
    step came after ``since`` (calls that never completed a step are not seen)."""
    first: dict[tuple[int, int], float] = {}
    for s in steps:
        if s.world > 0 and s.restarts > 0:
            key = (s.pid, s.restarts)
            first[key] = min(first.get(key, s.t), s.t)
    return sum(t > since for t in first.values())
