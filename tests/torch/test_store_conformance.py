"""Store conformance: the behaviour torch's own store tests check, on torch's stores and ours.

Each test here states one behaviour that torch's store tests
(``test/distributed/test_store.py``: ``StoreTestBase``, ``PythonStoreTest``,
``TestMultiThreadedWait``, the ``PrefixStore`` tests) check on torch's stores, written
afresh for this suite. It runs on:

* the reference stores, ``hash`` (``torch.distributed.HashStore``) and ``tcp`` (a
  ``TCPStore`` server on a free port): these runs prove the test encodes torch's
  behaviour;
* our store, ``etcd-v2`` and ``etcd-v3`` (``create_backend``'s ``TorchEtcdStore`` on
  the session etcd of each API, a fresh run per test): these runs prove we match.

Most tests run on two sides: ``direct`` calls the store's methods from Python (for
ours, our Python methods themselves), ``prefixstore`` calls them through
``torch.distributed.PrefixStore``, i.e. through torch's C++ side, which reaches a Python
store through c10d's trampoline (the path process groups and torch elastic take).

Where our store differs from torch's on purpose, the difference is listed by name in
:data:`KNOWN_DIFFERENCES`, with the reason; those runs of ours are strict expected
failures, so a difference that goes away fails the suite until its entry is removed.
Nothing else may fail.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest

import etcd_rdzv

if TYPE_CHECKING:
    from torch.distributed import Store

pytestmark = pytest.mark.torch

#: Behaviour (a test's name here) in which our store differs from torch's on purpose:
#: why. Applied to every run of that test on our store (both APIs, both sides) as a
#: strict expected failure; the reference stores must pass it.
KNOWN_DIFFERENCES: dict[str, str] = {
    "test_zero_timeout_means_no_timeout": (
        "c10d reads a store timeout of 0 as 'no timeout' (wait forever); etcd_rdzv keeps "
        "one meaning for every blocking call: None waits forever and 0 does not wait "
        "(docs/STYLE rule 3; TorchEtcdStore keeps it for a C++ timeout of 0 too). "
        "Forever is timedelta.max / None here."
    ),
    "test_value_of_two_mib": (
        "etcd refuses a request above --max-request-bytes (1.5 MiB by default) and a "
        "value is stored base64-encoded, so a value above about 1.1 MiB is refused "
        "with a ValueError that names the key; torch's in-memory stores take any size. "
        "Store values in c10d (addresses, ids) are far smaller."
    ),
}

STORE_TIMEOUT = timedelta(seconds=2)  # each store's default: no test waits longer
SHORT = timedelta(seconds=0.3)  # a wait that is meant to time out
REFERENCE_KINDS = ("hash", "tcp")
OUR_KINDS = ("etcd-v2", "etcd-v3")
SIDES = ("direct", "prefixstore")
PREFIX = "conf"  # the PrefixStore's prefix on the ``prefixstore`` side


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test that takes ``kind`` runs on each store; one that takes ``side`` on each
    side. The runs of ours of a test in :data:`KNOWN_DIFFERENCES` are strict xfails."""
    if "kind" in metafunc.fixturenames:
        reason = KNOWN_DIFFERENCES.get(metafunc.function.__name__)
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        kinds = [pytest.param(k, id=k) for k in REFERENCE_KINDS]
        kinds += [pytest.param(k, id=k, marks=marks) for k in OUR_KINDS]
        metafunc.parametrize("kind", kinds)
    if "side" in metafunc.fixturenames:
        metafunc.parametrize("side", SIDES)


@dataclass
class Stores:
    """Makes store objects of one kind on one shared set of keys: :meth:`first` and any
    number of :meth:`peer` objects, each as another client of the same data would
    have (its own connection for tcp and ours)."""

    kind: str
    _make: Callable[[], Store]
    _made: list[Store] = field(default_factory=list)

    @property
    def ours(self) -> bool:
        return self.kind in OUR_KINDS

    def first(self) -> Store:
        return self._made[0] if self._made else self.peer()

    def peer(self) -> Store:
        store = self._make()
        store.set_timeout(STORE_TIMEOUT)
        self._made.append(store)
        return store


@pytest.fixture
def stores(torch_required: None, request: pytest.FixtureRequest, kind: str) -> Iterator[Stores]:
    import torch.distributed as dist

    if kind == "hash":
        hash_store = dist.HashStore()
        # HashStore has no client: another "client" is a clone on the same map.
        yield Stores(kind, lambda: hash_store if not made.first_done() else hash_store.clone())
        return
    if kind == "tcp":
        server = dist.TCPStore(
            "127.0.0.1", 0, None, True, timeout=STORE_TIMEOUT, wait_for_workers=False
        )
        first = [True]

        def tcp() -> Store:
            if first[0]:
                first[0] = False
                return server
            return dist.TCPStore(
                "127.0.0.1",
                server.port,
                None,
                False,
                timeout=STORE_TIMEOUT,
                wait_for_workers=False,
            )

        yield Stores(kind, tcp)
        return
    api = kind.removeprefix("etcd-")
    server_fixture = "etcd_server" if api == "v2" else "etcd_server_v3"
    etcd = request.getfixturevalue(server_fixture)
    prefix = request.getfixturevalue("etcd_key_prefix")
    params = etcd.params(f"conf-{uuid.uuid4().hex[:12]}", key_prefix=prefix, api=api)

    def ours() -> Store:
        _, store = etcd_rdzv.create_backend(params)
        return store  # type: ignore[return-value]

    yield Stores(kind, ours)


class made:  # noqa: N801 - a namespace
    pass
