"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from etcd_rdzv.rendezvous.handler import EtcdRendezvousHandler
from fleet import Fleet


@pytest.fixture
def handlers() -> Iterator[list[EtcdRendezvousHandler]]:
    """A list for the handlers a test makes: each is shut down when the test ends."""
    made: list[EtcdRendezvousHandler] = []
    yield made
    for h in made:
        h.shutdown()


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    """Threads for handlers that join at once (each its own client)."""
    with ThreadPoolExecutor(max_workers=8) as executor:
        yield executor


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """Node processes (each exits by itself after 150 s should the test die)."""
    with Fleet(tmp_path, max_life=150.0) as nodes:
        yield nodes
