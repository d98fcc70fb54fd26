"""Run child processes for the torch tests: bounded waits, output kept, never leaked.

Every child runs in its own session (process group), so killing it also kills what it
started (torchrun's workers). Output goes to files, not pipes, so a chatty child can
never block on a full pipe while we wait for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
RESULT_MARK = "RESULT "


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child: one thread for torch, the repo importable, loopback gloo."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    if sys.platform.startswith("linux"):
        # Everything runs on this machine: keep gloo off interfaces the sandbox may block.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.update(extra)
    return env


class Child:
    """One child process whose stdout and stderr go to files under ``workdir``."""

    def __init__(self, name: str, argv: Sequence[str], workdir: Path, env: dict[str, str]) -> None:
        self.name = name
        self.argv = list(argv)
        self.stdout_path = workdir / f"{name}.stdout"
        self.stderr_path = workdir / f"{name}.stderr"
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.popen = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=str(workdir),
                start_new_session=True,
            )

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def kill(self) -> None:
        """SIGKILL the child's whole process group (it leads its own session).

        Only while the child is alive and unreaped: its pid is then surely still its
        group's id, never a recycled one.
        """
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def results(self) -> dict[str, dict[str, Any]]:
        """The ``RESULT <json>`` lines of stdout, keyed by their ``stage``."""
        found: dict[str, dict[str, Any]] = {}
        for line in self.stdout().splitlines():
            if line.startswith(RESULT_MARK):
                record = json.loads(line[len(RESULT_MARK) :])
                found[record["stage"]] = record
        return found

    def describe(self, tail: int = 60) -> str:
        def last(text: str) -> str:
            return "\n".join(text.splitlines()[-tail:])

        return (
            f"=== {self.name}: exit code {self.returncode}; argv {self.argv}\n"
            f"--- stdout (last {tail} lines)\n{last(self.stdout())}\n"
            f"--- stderr (last {tail} lines)\n{last(self.stderr())}"
        )


class Children:
    """Start children, wait for all of them within a deadline; kill leftovers on exit."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.children: list[Child] = []

    def start(self, name: str, argv: Sequence[str], env: dict[str, str]) -> Child:
        child = Child(name, argv, self.workdir, env)
        self.children.append(child)
        return child

    def wait_all(self, timeout: float) -> bool:
        """Wait until every child exited; False (and the rest killed) on timeout.

        A child that fails makes the others pointless (they would wait for it until
        their own timeouts), so the first non-zero exit also kills the rest.
        """
        deadline = time.monotonic() + timeout
        while True:
            codes = [child.popen.poll() for child in self.children]
            if all(code is not None for code in codes):
                return True
            if any(code not in (None, 0) for code in codes):
                self.kill_all()
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill_all()
                return False
            pending = next(c for c, code in zip(self.children, codes, strict=True) if code is None)
            with contextlib.suppress(subprocess.TimeoutExpired):
                pending.popen.wait(timeout=min(0.2, remaining))

    def kill_all(self) -> None:
        for child in self.children:
            child.kill()

    def describe(self) -> str:
        return "\n".join(child.describe() for child in self.children)

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()
