"""A member that freezes (SIGSTOP: a stopped process, a paused VM) without an election
costs a client about ``LOST + LOST_ASK`` seconds once, not ``read_timeout`` per request,
on both APIs and with the default ``read_timeout`` (60 s).

Before, a request to a frozen follower waited its whole timeout: a store read 60 s, a
v3 handler's build 60 s, and a v2 round of two nodes never formed within 120 s (each
of its clients, the one-API check's included, paid the wait again). A frozen follower
causes no election, so the stall check (which gives a request up on a new raft term)
never fired; now a request that waited ``lost_after`` while its member does not answer
a question for its term within ``LOST_ASK`` goes to the next endpoint."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest

import etcd_rdzv
from etcd_rdzv._kv import _stall
from etcd_rdzv.testing import EtcdCluster, EtcdServer

from ._harness import rotated_endpoint

#: What one lost request costs at most: it waits LOST, its member is asked for
#: LOST_ASK, and the request goes to the next endpoint (a second or two of slack for
#: the resend and a loaded test machine).
ONCE = _stall.LOST + _stall.LOST_ASK + 3.0
DEFAULT_READ_TIMEOUT = 60.0  # what the option's default is; the test asserts it
HANG = 120  # seconds: a generous bound that only catches hangs


@pytest.fixture
def frozen_first(cluster: EtcdCluster) -> Iterator[tuple[EtcdServer, str]]:
    """A follower of ``cluster``, frozen, and the cluster's endpoints with it first
    (where every client starts); resumed afterwards."""
    leader = cluster.leader(10)
    index, first = next((i, m) for i, m in enumerate(cluster.members) if m is not leader)
    endpoint = rotated_endpoint(cluster, index)
    first.pause()
    try:
        yield first, endpoint
    finally:
        first.resume()


def _lost_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The failover loop's moves after a request counted as lost to a frozen member
    (only a member that does not answer at all says this)."""
    return [
        r.getMessage()
        for r in caplog.records
        if "did not answer a question for its raft term" in r.getMessage()
    ]


def test_a_store_read_moves_on_from_a_frozen_member(
    cluster: EtcdCluster,
    frozen_first: tuple[EtcdServer, str],
    etcd_key_prefix: str,
    api: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="etcd_rdzv")
    frozen, endpoint = frozen_first
    frozen.resume()  # the client is built, and writes, while the member answers
    params = cluster.params("r", key_prefix=etcd_key_prefix, api=api)
    params.endpoint = endpoint
    assert params.get_as_int("read_timeout", 0) == 0  # not set: the default holds
    _backend, store = etcd_rdzv.create_backend(params)
    store.set("k", "v")
    frozen.pause()
    began = time.monotonic()
    assert store.get("k") == b"v"
    took = time.monotonic() - began
    print(f"{api}: a read whose member froze took {took:.2f}s")
    assert took < ONCE, f"the read took {took:.2f}s (read_timeout {DEFAULT_READ_TIMEOUT:g}s)"
    lost = _lost_lines(caplog)
    assert lost and frozen.endpoint in lost[0], lost
    began = time.monotonic()
    assert store.add("n", 1) == 1  # the client stays on the member that answered
    assert time.monotonic() - began < 2.0


def test_a_round_forms_while_the_first_member_is_frozen(
    cluster: EtcdCluster,
    frozen_first: tuple[EtcdServer, str],
    etcd_key_prefix: str,
    api: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two nodes start while the member every node lists first is frozen: each pays
    one lost request (its handler's build, on v3; its first read, on v2), and the
    round forms. The one-API check's own client starts where the node's client is."""
    caplog.set_level(logging.WARNING, logger="etcd_rdzv")
    _frozen, endpoint = frozen_first
    params = cluster.params(
        "frozen",
        key_prefix=etcd_key_prefix,
        api=api,
        min_nodes=2,
        max_nodes=2,
        join_timeout=HANG,
        local_addr="127.0.0.1",
    )
    params.endpoint = endpoint
    results: list[object] = []
    took: list[float] = []

    def node() -> None:
        began = time.monotonic()
        handler = None
        try:
            handler = etcd_rdzv.create_handler(params)
            results.append(handler.next_rendezvous())
        except Exception as exc:  # reported by the assertion below
            results.append(exc)
        finally:
            took.append(time.monotonic() - began)
            if handler is not None:
                handler.shutdown()

    threads = [threading.Thread(target=node) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG + 30)
    assert not any(t.is_alive() for t in threads)
    ranks = sorted(getattr(r, "rank", r) for r in results)  # type: ignore[arg-type]
    assert ranks == [0, 1], results
    print(f"{api}: built and joined in {max(took):.2f}s with the first member frozen")
    assert max(took) < ONCE + 3.0, (
        f"the round took {max(took):.2f}s: more than one lost request per node"
    )
    assert _lost_lines(caplog), "no request was given up as lost"
