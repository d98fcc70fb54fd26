"""Fixtures of the fault suite: a fresh local 3-member cluster per test, per etcd API.

Every test here runs once with ``api=v2`` (a cluster with ``--enable-v2``) and once
with ``api=v3`` (a cluster without the v2 API). Containers and network partitions
live elsewhere; these faults are process signals (kill, stop, pause, restart).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from etcd_rdzv import RendezvousParameters
from etcd_rdzv.testing import EtcdCluster
from fleet import Fleet

from ._harness import MAX_LIFE, rotated_endpoint


@pytest.fixture(params=["v2", "v3"])
def api(request: pytest.FixtureRequest) -> str:
    """The etcd API under test; each test runs once per API."""
    return str(request.param)


@pytest.fixture
def cluster(api: str) -> Iterator[EtcdCluster]:
    """A fresh 3-member cluster: faults never leak into the next test."""
    with EtcdCluster(3, enable_v2=api == "v2") as c:
        yield c


@pytest.fixture
def cluster_params(
    cluster: EtcdCluster, api: str, etcd_key_prefix: str
) -> Callable[..., RendezvousParameters]:
    """``cluster_params(run_id, first=0, **options)``: every member, starting at member
    ``first``, under a fresh key prefix, with ``api`` set and a short read timeout."""

    def make(run_id: str = "run", *, first: int = 0, **config: Any) -> RendezvousParameters:
        config.setdefault("key_prefix", etcd_key_prefix)
        config.setdefault("api", api)
        config.setdefault("read_timeout", 3)
        params = cluster.params(run_id, **config)
        params.endpoint = rotated_endpoint(cluster, first)
        return params

    return make


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """The node processes of a test; all killed when it ends."""
    with Fleet(tmp_path, max_life=MAX_LIFE) as nodes:
        yield nodes
