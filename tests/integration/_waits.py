"""Waiting in a test for a condition that etcd or another process makes true."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest


def until(what: str, condition: Callable[[], bool], timeout: float, pause: float = 0.02) -> None:
    """Return once ``condition()`` holds; fail the test naming ``what`` if it does not
    within ``timeout`` seconds (a bound that only catches hangs), asking every
    ``pause`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout} s")
        time.sleep(pause)
