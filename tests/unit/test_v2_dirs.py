"""Which v2 directories the v2 layer may remove: the pure parts (no server)."""

from __future__ import annotations

from typing import Any

from etcd_rdzv._kv._http import Transport
from etcd_rdzv._kv.v2._pool import Pool
from etcd_rdzv._kv.v2._requests import collect_empty
from etcd_rdzv._kv.v2.kv import V2KV


def _kv(root: str | None) -> V2KV:
    return V2KV([object()], ["http://127.0.0.1:1"], 5, Pool(Transport()), dir_root=root)


def test_the_parents_of_a_key_stop_below_the_key_prefix() -> None:
    kv = _kv("/etcd_rdzv/")
    assert kv._parents("/etcd_rdzv/job/rdzv/r3/nodes/abc") == [
        "/etcd_rdzv/job/rdzv/r3/nodes",
        "/etcd_rdzv/job/rdzv/r3",
        "/etcd_rdzv/job/rdzv",
        "/etcd_rdzv/job",
    ]
    assert kv._parents("/etcd_rdzv/job") == []  # a run's directory: its parent is the root
    assert kv._parents("/elsewhere/job/state") == []  # never outside the prefix
    assert kv._parents("/etcd_rdzvX/job/state") == []  # a sibling with the same start
    assert _kv(None)._parents("/etcd_rdzv/job/state") == []


def _dir(key: str, *children: Any, ttl: int | None = None) -> dict[str, Any]:
    node: dict[str, Any] = {"key": key, "dir": True, "nodes": list(children)}
    if ttl is not None:
        node["ttl"] = ttl
    return node


def _key(key: str) -> dict[str, Any]:
    return {"key": key, "value": "v", "ttl": 60}


def test_empty_directories_are_found_deepest_first_and_keys_keep_theirs() -> None:
    tree = _dir(
        "/p",
        _dir("/p/a", _dir("/p/a/b", _dir("/p/a/b/c")), _dir("/p/a/d")),
        _dir("/p/k", _key("/p/k/x"), _dir("/p/k/empty")),
        _dir("/p/~swept", ttl=3600),  # a directory with a TTL goes by itself
    )
    found: list[str] = []
    assert collect_empty(tree, "/p", found) is False
    assert found == ["/p/a/b/c", "/p/a/b", "/p/a/d", "/p/a", "/p/k/empty"]


def test_an_odd_listing_is_kept_not_removed() -> None:
    """Untrusted input: anything that is not plainly an empty directory under the root
    counts as something to keep."""
    odd = [
        _dir("/elsewhere"),  # outside the root
        {"key": "/p/x", "dir": "true", "nodes": []},  # not a JSON true
        {"key": "/p/y", "dir": True, "nodes": "no list"},
        {"key": 7, "dir": True},
        "not a node",
    ]
    for node in odd:
        found: list[str] = []
        assert collect_empty(_dir("/p", node), "/p", found) is False, node
        assert found == [], node
