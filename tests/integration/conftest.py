"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from etcd_rdzv.rendezvous.handler import EtcdRendezvousHandler


@pytest.fixture
def handlers() -> Iterator[list[EtcdRendezvousHandler]]:
    """A list for the handlers a test makes: each is shut down when the test ends."""
    made: list[EtcdRendezvousHandler] = []
    yield made
    for h in made:
        h.shutdown()
