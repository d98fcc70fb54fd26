"""Worker processes, bounded waits and cluster helpers for the fault tests.

Each worker is ``_node.py`` in a process (and session) of its own; commands go to its
stdin, events come back as ``EVT <json>`` lines in a file. Every wait has a deadline,
and a failed check shows every worker's output. Workers exit on their own after
``max_life`` seconds should the test process die.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from etcd_rdzv import RendezvousParameters
from etcd_rdzv.testing import EtcdCluster, EtcdServer

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
NODE_SCRIPT = HERE / "_node.py"
MARK = "EVT "
READY_TIMEOUT = 60.0  # several interpreters starting at once on 2 busy cores
MAX_LIFE = 300.0

Event = dict[str, Any]


class Proc:
    """One worker process; its events are parsed incrementally from its stdout file."""

    def __init__(self, name: str, spec: dict[str, Any], workdir: Path) -> None:
        self.name = name
        self.stdout_path = workdir / f"{name}.stdout"
        self.stderr_path = workdir / f"{name}.stderr"
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        spec = {**spec, "max_life": MAX_LIFE}
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.popen = subprocess.Popen(
                [sys.executable, str(NODE_SCRIPT), json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                env=env,
                cwd=str(workdir),
                start_new_session=True,
            )
        self.node_id: str | None = None
        self._offset = 0
        self._events: list[Event] = []

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def send(self, command: str) -> None:
        assert self.popen.stdin is not None
        with contextlib.suppress(BrokenPipeError, OSError):
            self.popen.stdin.write(command.encode() + b"\n")
            self.popen.stdin.flush()

    def events(self, kind: str | None = None) -> list[Event]:
        with open(self.stdout_path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # only whole lines; the rest is still being written
        self._offset += end
        for line in data[:end].decode(errors="replace").splitlines():
            if line.startswith(MARK):
                with contextlib.suppress(ValueError):
                    self._events.append(json.loads(line[len(MARK) :]))
        return [e for e in self._events if kind is None or e["event"] == kind]

    def kill(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)
        if self.popen.stdin is not None:
            with contextlib.suppress(OSError):
                self.popen.stdin.close()

    def describe(self, tail: int = 30) -> str:
        def last(path: Path) -> str:
            try:
                return "\n".join(path.read_text(errors="replace").splitlines()[-tail:])
            except OSError:
                return "(none)"

        return (
            f"=== {self.name} ({self.node_id}): exit code {self.popen.poll()}\n"
            f"--- stdout\n{last(self.stdout_path)}\n--- stderr\n{last(self.stderr_path)}"
        )


class Group:
    """The worker processes of one test."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.all: list[Proc] = []

    def start(self, name: str, mode: str, params: RendezvousParameters) -> Proc:
        spec = {
            "mode": mode,
            "backend": params.backend,
            "endpoint": params.endpoint,
            "run_id": params.run_id,
            "min_nodes": params.min_nodes,
            "max_nodes": params.max_nodes,
            "config": params.config,
        }
        proc = Proc(name, spec, self.workdir)
        self.all.append(proc)
        return proc

    def describe(self) -> str:
        return "\n".join(p.describe() for p in self.all)

    def check(self, condition: bool, message: str) -> None:
        if not condition:
            pytest.fail(f"{message}\n{self.describe()}", pytrace=False)

    def wait_event(
        self,
        proc: Proc,
        kind: str,
        timeout: float,
        match: Callable[[Event], bool] = lambda e: True,
    ) -> Event:
        """The first matching ``kind`` event of ``proc``; fails after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            alive = proc.alive  # before reading: an event written before the exit counts
            for event in proc.events(kind):
                if match(event):
                    return event
            self.check(alive, f"{proc.name} exited without a matching {kind!r} event")
            self.check(
                time.monotonic() < deadline,
                f"no matching {kind!r} event from {proc.name} within {timeout} s",
            )
            time.sleep(0.02)

    def wait_count(self, procs: Iterable[Proc], kind: str, count: int, timeout: float) -> None:
        """Wait until each of ``procs`` reported at least ``count`` ``kind`` events."""
        deadline = time.monotonic() + timeout
        for proc in procs:
            while True:
                alive = proc.alive
                if len(proc.events(kind)) >= count:
                    break
                self.check(alive, f"{proc.name} exited with fewer than {count} {kind!r} events")
                self.check(
                    time.monotonic() < deadline,
                    f"{proc.name}: fewer than {count} {kind!r} events within {timeout} s",
                )
                time.sleep(0.02)

    def ready(self, procs: Iterable[Proc] | None = None) -> None:
        """Wait until every worker built its client; learn the node ids."""
        for proc in self.all if procs is None else procs:
            proc.node_id = self.wait_event(proc, "ready", READY_TIMEOUT).get("node_id")

    def kill_all(self) -> None:
        for proc in self.all:
            proc.kill()


def rotated_endpoint(cluster: EtcdCluster, first: int) -> str:
    """Every member's endpoint, starting with member ``first % size``."""
    members = cluster.members
    n = first % len(members)
    return ",".join(m.endpoint for m in members[n:] + members[:n])


def _status(member: EtcdServer, timeout: float) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{member.client_url}/v3/maintenance/status", data=b"{}", method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        status: dict[str, Any] = json.loads(resp.read())
    return status


def leader_of(cluster: EtcdCluster, timeout: float = 15.0) -> EtcdServer:
    """The member that leads now, asked over the v3 status API (served with or without
    the v2 API, unlike the v2 stats that ``EtcdCluster.leader()`` asks)."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        for member in cluster.members:
            if not member.running:
                continue
            with contextlib.suppress(OSError, ValueError, KeyError):
                status = _status(member, 1.0)
                if status["header"]["member_id"] == status["leader"]:
                    return member
        if time.monotonic() >= deadline:
            raise RuntimeError(f"no member of {cluster.endpoint} reports being leader")
        time.sleep(delay)  # back-off while an election runs, bounded by the deadline
        delay = min(delay * 1.5, 0.25)


def etcd_version(member: EtcdServer) -> tuple[int, ...]:
    """The etcd server version of ``member``, e.g. ``(3, 5, 1)``."""
    with urllib.request.urlopen(f"{member.client_url}/version", timeout=5) as resp:
        text = str(json.loads(resp.read())["etcdserver"])
    return tuple(int(part) for part in text.split(".")[:3])


def describe_members(cluster: EtcdCluster) -> str:
    """Each member's view (revision, raft index, leader): members that applied the same
    raft index but report different revisions hold different data."""
    lines = []
    for member in cluster.members:
        try:
            status = _status(member, 2.0)
            header = status.get("header", {})
            lines.append(
                f"{member.name}: revision {header.get('revision')}, raft index "
                f"{status.get('raftIndex')}, applied {status.get('raftAppliedIndex')}, "
                f"member {header.get('member_id')}, leader {status.get('leader')}"
            )
        except (OSError, ValueError) as exc:
            lines.append(f"{member.name}: no status ({exc})")
    return "\n".join(lines)


def wait_healthy(cluster: EtcdCluster, timeout: float = 30.0) -> None:
    """Wait until every running member reports healthy (it has a leader again)."""
    for member in cluster.members:
        if member.running:
            member.wait_ready(timeout)


def assert_round(group: Group, results: list[Event], expected: set[str] | None) -> tuple[str, ...]:
    """Every result of one round agrees on the members; ranks are 0..n-1, each its own;
    with ``expected``, the members are exactly those node ids."""
    lists = {tuple(r["members"]) for r in results}
    group.check(len(lists) == 1, f"members differ between nodes: {lists}")
    (members,) = lists
    n = len(members)
    group.check(
        len(set(members)) == n
        and sorted(r["rank"] for r in results) == list(range(len(results)))
        and all(r["world_size"] == n for r in results)
        and all(members[r["rank"]] == r["node_id"] for r in results),
        f"ranks are not 0..{n - 1}, one per member in member-list order: {results}",
    )
    if expected is not None:
        group.check(set(members) == expected, f"members {members}, expected {sorted(expected)}")
    return members
