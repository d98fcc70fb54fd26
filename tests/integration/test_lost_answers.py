"""Writes whose answer is lost are applied exactly once, on both APIs.

A small TCP proxy stands between one client and etcd. Armed, it forwards the next
compare-and-set request, lets etcd apply it, lets another client write over the key,
and then cuts the connection instead of passing etcd's answer on: the client cannot
know whether its write happened, and by the time it reads the key back, the value is
no longer its own. The store must still recognise its write (the value carries the
tags of the writes before it) and not apply it a second time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousParameters, _keys
from etcd_rdzv._kv import KV
from etcd_rdzv.rendezvous.completion import create_unless_gone, withdraw
from etcd_rdzv.testing import EtcdServer

from ._losing_proxy import LosingProxy, in_front_of

pytestmark = pytest.mark.etcd_variants("v2", "v3")


@pytest.fixture
def proxy(etcd_api_server: EtcdServer) -> Iterator[LosingProxy]:
    with in_front_of(etcd_api_server) as p:
        yield p


def test_add_whose_answer_is_lost_is_applied_once_though_overwritten(
    proxy: LosingProxy,
    etcd_api_params: Callable[..., RendezvousParameters],
    etcd_api: str,
) -> None:
    direct = etcd_api_params("lost", read_timeout=5)
    _, other = etcd_rdzv.create_backend(direct)
    through = etcd_api_params("lost", read_timeout=5)
    through.endpoint = f"127.0.0.1:{proxy.port}"
    _, mine = etcd_rdzv.create_backend(through)

    assert other.add("n", 10) == 10
    assert mine.add("n", 1) == 11  # through the proxy; on v3 this also grants the lease
    marker = b"prevIndex=" if etcd_api == "v2" else b"/v3/kv/txn"
    proxy.arm(marker, lambda: other.add("n", 100))  # 12 -> 112 behind our back

    assert mine.add("n", 1) == 12  # applied once, recognised under the later write
    assert proxy.lost == 1
    assert other.get("n") == b"112"  # not 113: no second application
    assert mine.add("n", 1) == 113

    # append: the same, with bytes that would show a duplicate
    other.set("log", "a")
    proxy.arm(marker, lambda: other.append("log", "c"))
    mine.append("log", "b")
    assert proxy.lost == 2
    assert other.get("log") == b"abc"


def test_an_add_or_append_applied_though_reported_refused_is_not_applied_again(
    etcd_api_params: Callable[..., RendezvousParameters],
) -> None:
    # What a stale read-back (a follower behind the leader, v2) or a proposal applied
    # after its request timed out makes of a write: etcd applied it, the client was
    # told it did not. The next read shows the add's own tag: its total is returned.
    _, store = etcd_rdzv.create_backend(etcd_api_params("refused", read_timeout=5))
    kv: Any = store._kv
    real = kv.compare_and_set
    lies = []

    def applied_but_refused(*args: Any, **kwargs: Any) -> Any:
        answer = real(*args, **kwargs)
        if answer is not None and not lies:
            lies.append(answer)
            return None
        return answer

    try:
        assert store.add("n", 10) == 10
        kv.compare_and_set = applied_but_refused
        assert store.add("n", 1) == 11
        assert len(lies) == 1
        assert store.get("n") == b"11"  # not 12
        store.set("log", "a")
        lies.clear()
        store.append("log", "b")
        assert len(lies) == 1
        assert store.get("log") == b"ab"  # not abb
    finally:
        kv.close()


# -- a round's completion and a node's withdrawal (rendezvous/completion.py) ------------


def _through(
    proxy: LosingProxy, etcd_api_params: Callable[..., RendezvousParameters], direct: str
) -> KV:
    """A client whose first endpoint is the proxy and whose second is etcd itself: a
    write whose answer the proxy loses is resent to etcd."""
    params = etcd_api_params("lost", read_timeout=5)
    params.endpoint = f"127.0.0.1:{proxy.port},{direct}"
    return etcd_rdzv.create_client(params)


def test_a_result_whose_answer_is_lost_is_created_once_and_reported_created(
    proxy: LosingProxy,
    etcd_api_params: Callable[..., RendezvousParameters],
    etcd_api_server: EtcdServer,
    etcd_api: str,
) -> None:
    kv = _through(proxy, etcd_api_params, etcd_api_server.endpoint)
    other = etcd_rdzv.create_client(etcd_api_params("lost", read_timeout=5))
    prefix = str(etcd_api_params().get("key_prefix"))
    result = _keys.result_key(prefix, "lost", 1)
    gone_dir = _keys.gone_dir(prefix, "lost", 1)
    try:
        picture = kv.put(_keys.node_key(prefix, "lost", 1, "n1"), "n1", 60).revision
        # v3: the one transaction; v2: the result's create (after its seal's).
        proxy.arm(b"/v3/kv/txn" if etcd_api == "v3" else b"/result HTTP", lambda: None)
        created, existing = create_unless_gone(kv, result, "r1", 60, gone_dir, picture, 5)
        assert proxy.lost == 1
        assert created is not None and created.value == "r1" and existing is None
        assert other.get(result)[0] is not None
        # Once more, as a second coordinator: the result exists.
        again, existing = create_unless_gone(other, result, "r2", 60, gone_dir, picture, 5)
        assert again is None and existing is not None and existing.value == "r1"
    finally:
        kv.close()
        other.close()


def test_a_withdrawal_whose_answer_is_lost_is_done_once(
    proxy: LosingProxy,
    etcd_api_params: Callable[..., RendezvousParameters],
    etcd_api_server: EtcdServer,
    etcd_api: str,
) -> None:
    kv = _through(proxy, etcd_api_params, etcd_api_server.endpoint)
    other = etcd_rdzv.create_client(etcd_api_params("lost", read_timeout=5))
    prefix = str(etcd_api_params().get("key_prefix"))
    node = _keys.node_key(prefix, "lost", 1, "n1")
    result = _keys.result_key(prefix, "lost", 1)
    gone_dir = _keys.gone_dir(prefix, "lost", 1)
    gone = _keys.gone_key(prefix, "lost", 1, "n1")
    try:
        picture = kv.put(node, "n1", 60).revision
        # v3: the one transaction; v2: the join key's delete, its last step.
        proxy.arm(b"/v3/kv/txn" if etcd_api == "v3" else b"DELETE ", lambda: None)
        withdrawn, found = withdraw(kv, node, result, gone, "n1", 60, 5)
        assert proxy.lost == 1
        assert (withdrawn, found) == (True, None)
        assert other.get(node)[0] is None and other.get(gone)[0] is not None
        # A result made from the picture that held the node is refused.
        refused = create_unless_gone(other, result, "r", 60, gone_dir, picture, 5)
        assert refused == (None, None)
    finally:
        kv.close()
        other.close()
