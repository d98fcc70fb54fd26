"""Fixtures of the torchrun tests."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from ._agents import is_job


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
        if is_job(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
