"""The ``etcd-rdzv`` command line run as users run it, in subprocesses, for tests: the
runner behind the pytest plugin's ``etcd_rdzv_cli`` fixture (see docs/testing.md).
Importing it imports no pytest."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["HARNESS_ENV", "CliProcess", "EtcdRdzvCli", "child_env", "cli_env", "wait_until"]


_PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent  # where etcd_rdzv is
HARNESS_ENV = ("ETCD_RDZV_IMAGE", "ETCD_RDZV_NO_SKIP", "ETCD_RDZV_SOAK_SEED")


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process of a test: this ``etcd_rdzv`` importable,
    unbuffered output, one OpenMP thread (torch), gloo on loopback (Linux); ``extra``
    added last."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    if sys.platform.startswith("linux"):
        # Everything runs on this machine: keep gloo off interfaces a sandbox may block.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.update(extra)
    return env


def cli_env(**changes: str) -> dict[str, str]:
    """The environment of a CLI subprocess: this one, with this ``etcd_rdzv`` importable
    and no ``ETCD_RDZV_*`` option variable (so a command sees only the options a test
    gives it), then ``changes``."""
    env = {
        name: value
        for name, value in child_env().items()
        if not name.startswith("ETCD_RDZV_")
        or name in HARNESS_ENV
        or name.startswith("ETCD_RDZV_REQUIRE_")
    }
    env.update(changes)
    return env


def wait_until(
    condition: Callable[[], object],
    timeout: float = 30.0,
    *,
    what: str = "the condition",
    interval: float = 0.1,
) -> float:
    """Poll ``condition()`` every ``interval`` seconds until it is true; return the
    seconds that took.

    Raises:
        pytest.fail.Exception: not true within ``timeout`` seconds.
    """
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            import pytest  # only a test fails here: importing this module needs no pytest

            pytest.fail(f"{what}: not reached within {timeout} s", pytrace=False)
        time.sleep(interval)
    return time.monotonic() - started


class CliProcess:
    """An ``etcd-rdzv`` command running in the background. Its output is read as it
    comes (stdout and stderr each by a thread of its own), so a test can wait for a
    line and the process never blocks on a full pipe."""

    def __init__(self, argv: list[str], env: dict[str, str], timeout: float) -> None:
        self.argv = argv
        self.timeout = timeout
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._read: dict[str, int] = {"stdout": 0, "stderr": 0}  # lines already waited for
        self._cond = threading.Condition()
        self._ended: set[str] = set()
        self._readers = [
            threading.Thread(
                target=self._reader, args=(name, stream), name=f"cli-{name}", daemon=True
            )
            for name, stream in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr))
        ]
        for reader in self._readers:
            reader.start()

    def _reader(self, name: str, stream: IO[str] | None) -> None:
        assert stream is not None
        for line in stream:
            with self._cond:
                self._lines[name].append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._ended.add(name)
            self._cond.notify_all()

    def _next(self, name: str, timeout: float | None) -> str:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._cond:
            while self._read[name] >= len(self._lines[name]):
                left = deadline - time.monotonic()
                if name in self._ended or left <= 0:
                    why = "it ended" if name in self._ended else "no line in time"
                    raise AssertionError(f"{self.argv[3:]}: {why} on {name}:\n{self._output()}")
                self._cond.wait(left)
            line = self._lines[name][self._read[name]]
            self._read[name] += 1
            return line

    def readline(self, timeout: float | None = None) -> str:
        """The next stdout line (failing the test if none comes in time)."""
        return self._next("stdout", timeout)

    def wait_line(self, pattern: str, timeout: float | None = None, count: int = 1) -> str:
        """The ``count``-th stderr line matching the regular expression ``pattern``
        (seen already or to come), failing the test if it does not come in time."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._cond:
            while True:
                seen = [line for line in self._lines["stderr"] if re.search(pattern, line)]
                if len(seen) >= count:
                    return seen[count - 1]
                left = deadline - time.monotonic()
                if "stderr" in self._ended or left <= 0:
                    why = "it ended" if "stderr" in self._ended else "not in time"
                    raise AssertionError(
                        f"{self.argv[3:]}: no line matching {pattern!r} ({why}):\n{self._output()}"
                    )
                self._cond.wait(left)

    def finish(self, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        """Wait for the exit; the exit code and everything it wrote (also the lines
        already waited for). May be called again."""
        limit = self.timeout if timeout is None else timeout
        try:
            code = self.proc.wait(limit)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"{self.argv[3:]} did not exit within {limit} s:\n{self._output()}"
            ) from None
        for reader in self._readers:
            reader.join(limit)
        with self._cond:
            out, err = ("\n".join(self._lines[n]) for n in ("stdout", "stderr"))
            if self._lines["stdout"]:
                out += "\n"
            if self._lines["stderr"]:
                err += "\n"
        return subprocess.CompletedProcess(self.argv, code, out, err)

    def send_signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL (if it still runs) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def _output(self) -> str:
        with self._cond:
            return "\n".join(
                f"{name}: {line}" for name in ("stdout", "stderr") for line in self._lines[name]
            )


class EtcdRdzvCli:
    """The ``etcd-rdzv`` command line, as users run it, in subprocesses: see the
    ``etcd_rdzv_cli`` fixture."""

    #: The command line that runs etcd-rdzv (this interpreter, this etcd_rdzv).
    ARGV: tuple[str, ...] = (sys.executable, "-m", "etcd_rdzv")

    def __init__(self, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self.started: list[CliProcess] = []

    def run(
        self, *args: str, timeout: float | None = None, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``etcd-rdzv *args`` to its end (no stdin); its exit code and output.
        ``env`` adds variables to :func:`cli_env`.

        Raises:
            subprocess.TimeoutExpired: it did not end within ``timeout`` (default: the
                fixture's, 60 s).
        """
        return subprocess.run(
            [*self.ARGV, *args],
            capture_output=True,
            check=False,
            text=True,
            timeout=self.timeout if timeout is None else timeout,
            env=cli_env(**(env or {})),
            stdin=subprocess.DEVNULL,
        )

    def start(self, *args: str, env: dict[str, str] | None = None) -> CliProcess:
        """Start ``etcd-rdzv *args`` in the background; stopped when the test ends."""
        proc = CliProcess([*self.ARGV, *args], cli_env(**(env or {})), self.timeout)
        self.started.append(proc)
        return proc

    def status(self, run_id: str, *options: str) -> dict[str, Any]:
        """``etcd-rdzv status --run-id RUN_ID --json *options``, parsed; fails the test
        unless it exits 0, or 3 for a run with no keys (``"exists": false``)."""
        done = self.run("status", "--run-id", run_id, "--json", *options)
        assert done.returncode in (0, 3), f"status exited {done.returncode}: {done.stderr}"
        status: dict[str, Any] = json.loads(done.stdout)
        assert status["exists"] is (done.returncode == 0), done.stderr
        return status

    def until(self, condition: Callable[[], object], timeout: float = 30.0) -> float:
        """:func:`wait_until` (for a status to show something)."""
        return wait_until(condition, timeout, what="the CLI's condition")

    def close(self) -> None:
        """End every command started that still runs: SIGTERM (``serve`` stops its
        etcd then), SIGKILL after 10 s."""
        for proc in self.started:
            proc.send_signal(signal.SIGTERM)
        for proc in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.proc.wait(10)
            proc.kill()
        self.started.clear()
