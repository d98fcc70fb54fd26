"""pytest fixtures for a real etcd. Enable with::

    pytest_plugins = ["etcd_rdzv.testing.pytest_plugin"]

Fixtures:

* ``etcd_server`` (session): one member with the v2 API, on free loopback ports.
* ``etcd_key_prefix``: a fresh etcd key prefix per test, so tests never share keys.
* ``etcd_params``: a factory ``etcd_params(run_id="...", **options)`` of rendezvous
  parameters for ``etcd_server`` under ``etcd_key_prefix``.
* ``etcd_server_v3`` (session): one member *without* the v2 API (v3 only).
* ``etcd_api``: parametrised over ``"v2"`` and ``"v3"``; a test that uses it (or
  ``etcd_api_params``) runs once per API.
* ``etcd_api_params``: like ``etcd_params``, for the server that matches ``etcd_api``
  (v3 runs on ``etcd_server_v3``) with the ``api`` option set.

When a test fails, the last lines of every running member's log are added to the
report.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest

from ..params import RendezvousParameters
from ._server import EtcdServer, running_servers


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    """One etcd member (v2 API on) for the whole session."""
    with EtcdServer("session") as server:
        yield server


@pytest.fixture(scope="session")
def etcd_server_v3() -> Iterator[EtcdServer]:
    """One etcd member without the v2 API for the whole session."""
    with EtcdServer("session-v3", enable_v2=False) as server:
        yield server


@pytest.fixture(params=["v2", "v3"])
def etcd_api(request: pytest.FixtureRequest) -> str:
    """The etcd API a test runs on; the test runs once per API."""
    return str(request.param)


@pytest.fixture
def etcd_api_params(
    request: pytest.FixtureRequest, etcd_api: str, etcd_key_prefix: str
) -> Callable[..., RendezvousParameters]:
    """Factory of parameters for the server matching ``etcd_api``, under a fresh prefix."""
    server: EtcdServer = request.getfixturevalue(
        "etcd_server" if etcd_api == "v2" else "etcd_server_v3"
    )

    def make(run_id: str = "run", **config: Any) -> RendezvousParameters:
        config.setdefault("key_prefix", etcd_key_prefix)
        config.setdefault("api", etcd_api)
        return server.params(run_id, **config)

    return make


@pytest.fixture
def etcd_key_prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix no other test uses."""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", request.node.name)[:40]
    return f"/etcd_rdzv_test/{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def etcd_params(
    etcd_server: EtcdServer, etcd_key_prefix: str
) -> Callable[..., RendezvousParameters]:
    """Factory of parameters for ``etcd_server`` under a fresh prefix."""

    def make(run_id: str = "run", **config: Any) -> RendezvousParameters:
        config.setdefault("key_prefix", etcd_key_prefix)
        return etcd_server.params(run_id, **config)

    return make


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for server in running_servers():
            report.sections.append(
                (f"etcd log: {server.name} ({server.client_url})", server.log_tail(60))
            )
