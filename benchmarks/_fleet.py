"""A fleet of benchmark node processes (:mod:`benchmarks._node`) and their events."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["REPO_ROOT", "Fleet", "FleetError", "child_env"]

REPO_ROOT = Path(__file__).resolve().parent.parent

Event = dict[str, Any]


class FleetError(RuntimeError):
    """A node failed or did not answer in time; the message has the details."""


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("LOGLEVEL", "WARNING")  # torch's elastic logging
    return env


class Fleet:
    """``layout[i]`` nodes in process ``i``, all sharing one go, stop and report pipe.

    Args:
        kind: the handler kind (see :func:`benchmarks._node.build`).
        layout: nodes per process.
        params: the rendezvous parameters (endpoint, run_id, min, max, config).
        mode: what nodes do after the rendezvous (see :mod:`benchmarks._node`).
        workdir: where each process's stderr goes.
        death_params: the parameters of the second handler (death mode).
        max_life: seconds after which a process exits on its own.
    """

    def __init__(
        self,
        kind: str,
        layout: list[int],
        params: dict[str, Any],
        mode: str,
        workdir: Path,
        *,
        monitor_interval: float = 0.1,
        death_params: dict[str, Any] | None = None,
        max_life: float = 900.0,
    ) -> None:
        self.kind = kind
        self.layout = layout
        self.workdir = workdir
        self.events: list[Event] = []
        self._queue: queue.Queue[Event | None] = queue.Queue()
        go_r, self._go_w = os.pipe()
        stop_r, self._stop_w = os.pipe()
        self._report_r, report_w = os.pipe()
        self.procs: list[subprocess.Popen[bytes]] = []
        env = child_env()
        try:
            for index, nodes in enumerate(layout):
                spec = {
                    "kind": kind,
                    "proc": index,
                    "nodes": nodes,
                    "host": index == 0,
                    "params": params,
                    "death_params": death_params,
                    "mode": mode,
                    "monitor_interval": monitor_interval,
                    "go_fd": go_r,
                    "stop_fd": stop_r,
                    "report_fd": report_w,
                    "max_life": max_life,
                }
                with open(workdir / f"p{index}.stderr", "wb") as err:
                    self.procs.append(
                        subprocess.Popen(
                            [sys.executable, "-m", "benchmarks._node", json.dumps(spec)],
                            stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL,
                            stderr=err,
                            env=env,
                            cwd=str(REPO_ROOT),
                            pass_fds=(go_r, stop_r, report_w),
                            start_new_session=True,
                        )
                    )
        finally:
            for fd in (go_r, stop_r, report_w):
                os.close(fd)
        self._reader = threading.Thread(target=self._read, name="fleet-reader", daemon=True)
        self._reader.start()

    @property
    def size(self) -> int:
        return sum(self.layout)

    def _read(self) -> None:
        with os.fdopen(self._report_r, "rb") as stream:
            for line in stream:
                with contextlib.suppress(ValueError):
                    self._queue.put(json.loads(line))
        self._queue.put(None)

    def _pump(self, timeout: float) -> bool:
        """Move one event from the pipe to :attr:`events`; False on timeout."""
        try:
            event = self._queue.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return False
        if event is None:
            raise FleetError(f"every {self.kind} process exited\n{self.describe()}")
        self.events.append(event)
        if event["event"] == "error":
            raise FleetError(
                f"{self.kind} process {event['proc']} node {event.get('node')}: "
                f"{event['message']}\n{self.describe()}"
            )
        return True

    def wait(self, kind: str, count: int, timeout: float) -> list[Event]:
        """The first ``count`` events of ``kind``; FleetError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            found = [e for e in self.events if e["event"] == kind]
            if len(found) >= count:
                return found[:count]
            if not self._pump(deadline - time.monotonic()) and time.monotonic() >= deadline:
                raise FleetError(
                    f"{len(found)} of {count} {kind!r} events from {self.kind} within "
                    f"{timeout:.0f}s\n{self.describe()}"
                )

    def ready(self, timeout: float) -> None:
        for event in self.wait("ready", len(self.layout), timeout):
            if event["nodes"] != self.layout[event["proc"]]:
                raise FleetError(f"process {event['proc']} built {event['nodes']} nodes")

    def go(self) -> float:
        """Start every node at once; returns the moment (``time.monotonic()``)."""
        started = time.monotonic()
        os.write(self._go_w, b"g" * len(self.layout))
        return started

    def kill(self, index: int) -> float:
        """SIGKILL process ``index``; returns the moment."""
        killed = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[index].pid, signal.SIGKILL)
        return killed

    def stop(self, timeout: float = 30.0) -> None:
        """Ask every process to shut its handlers down and exit; kill what remains."""
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"s" * len(self.layout))
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for fd in (self._go_w, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def describe(self, tail: int = 15) -> str:
        parts = []
        for index, proc in enumerate(self.procs[:8]):
            path = self.workdir / f"p{index}.stderr"
            try:
                lines = path.read_text(errors="replace").splitlines()[-tail:]
            except OSError:
                lines = []
            parts.append(f"--- process {index} (exit {proc.poll()}):\n" + "\n".join(lines))
        return "\n".join(parts)
