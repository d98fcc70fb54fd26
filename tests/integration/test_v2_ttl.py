"""On etcd's v2 API, a finished run leaves nothing that never expires.

v2 creates the directories above a key without a TTL, and etcd 3.5 cannot give an
existing directory one (it refuses to update a directory's TTL), so the v2 layer
removes directories when they are empty instead (see ``docs/api.md``): a delete
removes the directories it empties, and a sweep at connect removes those that keys
leaving by their TTL emptied. Checked here on the raw v2 tree, read over HTTP without
the package:

* after a native run of several rounds is closed and its nodes have shut down, and a
  dynamic run's backend and store were used, every key has a TTL and no directory is
  empty (each holds a key that will expire);
* once those keys are gone as their TTLs would make them go, the next client to
  connect under the key prefix removes every directory left;
* a closed run deleted with ``delete_run`` (``etcd-rdzv delete``) leaves nothing, and
  what is left under the prefix (the sweep marker) has a TTL;
* etcd 3.5 really refuses a directory TTL (the reason for this design); when it
  starts accepting them, the choice should be looked at again.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv import EtcdRendezvousHandler, RendezvousParameters, RendezvousResult, _keys
from etcd_rdzv._kv.v2.kv import SWEEP_MARKER
from etcd_rdzv.runs.delete import delete_run
from etcd_rdzv.testing import EtcdServer

pytestmark = pytest.mark.etcd_variants("v2")

Params = Callable[..., RendezvousParameters]
HANG = 60.0  # a generous bound that only catches hangs


@dataclass(frozen=True)
class Node:
    """One node of the v2 tree as etcd lists it."""

    key: str
    dir: bool
    ttl: int | None
    expiration: str | None


def _tree(client_url: str, prefix: str) -> list[Node]:
    """Every node (directories and keys) under ``prefix``, ``prefix`` itself left out."""
    try:
        with urllib.request.urlopen(
            f"{client_url}/v2/keys{prefix}?recursive=true", timeout=5
        ) as resp:
            root = json.loads(resp.read())["node"]
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return []
        raise
    found: list[Node] = []

    def walk(node: dict[str, Any]) -> None:
        for child in node.get("nodes", []):
            found.append(
                Node(
                    child["key"], bool(child.get("dir")), child.get("ttl"), child.get("expiration")
                )
            )
            walk(child)

    walk(root)
    return found


def _raw_delete(client_url: str, key: str) -> None:
    request = urllib.request.Request(f"{client_url}/v2/keys{key}", method="DELETE")
    with urllib.request.urlopen(request, timeout=5):
        return


def _expire_marker(client_url: str, prefix: str) -> None:
    """As if the sweep marker's hour had passed."""
    _raw_delete(client_url, f"{prefix}/{SWEEP_MARKER}?dir=true")


def _nothing_left_forever(tree: list[Node]) -> list[str]:
    """What in ``tree`` would never go: keys without a TTL, and directories without a
    TTL that hold no key (a directory holding a key is removed with its last key)."""
    keys = [n for n in tree if not n.dir]
    bad = [f"key {n.key} has no TTL" for n in keys if n.ttl is None or n.expiration is None]
    for d in tree:
        if d.dir and d.ttl is None and not any(k.key.startswith(d.key + "/") for k in keys):
            bad.append(f"directory {d.key} is empty and has no TTL")
    return bad


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=4) as executor:
        yield executor


def _results(futures: list[Future[RendezvousResult]]) -> list[RendezvousResult]:
    return [f.result(timeout=HANG) for f in futures]


def test_a_finished_run_leaves_nothing_that_never_expires(
    etcd_api_params: Params,
    etcd_api_server: EtcdServer,
    etcd_key_prefix: str,
    pool: ThreadPoolExecutor,
) -> None:
    url = etcd_api_server.client_url
    params = etcd_api_params(
        "native", min_nodes=2, max_nodes=2, keep_alive_interval=1, join_timeout=30
    )
    a: EtcdRendezvousHandler = etcd_rdzv.create_handler(params)
    b: EtcdRendezvousHandler = etcd_rdzv.create_handler(params)
    try:
        for round_no in range(1, 5):  # four rounds: the first two are deleted on the way
            results = _results([pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous)])
            results[0].store.set(f"key{round_no}", b"value")
            assert results[1].store.get(f"key{round_no}") == b"value"
        rdzv = _keys.rdzv_dir(etcd_key_prefix, "native")
        during = {n.key for n in _tree(url, rdzv)}
        assert f"{rdzv}/r4/nodes" in during, "the premise: a live round has its nodes"
        a.set_closed()
    finally:
        a.shutdown()
        b.shutdown()

    # A dynamic run's backend and store, the keys of torch's own handler.
    dyn_params = etcd_api_params("dynamic")
    backend, store = etcd_rdzv.create_backend(dyn_params)
    written = backend.set_state(b"state")
    assert written is not None and written[2]
    store.set("plain", b"1")
    store.add("counter", 2)
    store.queue_push("queue", b"item")
    assert store.queue_pop("queue", block=False) == b"item"

    tree = _tree(url, etcd_key_prefix)
    keys = {n.key for n in tree if not n.dir}
    run = _keys.run_dir(etcd_key_prefix, "native")
    dyn = _keys.run_dir(etcd_key_prefix, "dynamic")
    # What the checks below look at is there.
    assert {f"{run}/rdzv/closed", f"{run}/rdzv/r4/result", f"{dyn}/state"} <= keys
    assert f"{dyn}/store/{_keys.b64_key('counter')}" in keys
    assert _nothing_left_forever(tree) == []
    dirs = {n.key for n in tree if n.dir}
    # The nodes left: their directories went with their last key; so did the popped
    # queue's, and rounds 1 and 2 (deleted when round 4 completed).
    assert not [d for d in dirs if d.endswith("/nodes")], dirs
    assert f"{dyn}/store/q" not in dirs
    assert f"{run}/rdzv/r1" not in dirs and f"{run}/rdzv/r2" not in dirs

    # The keys go as their TTLs would make them go (2 h here: deleted by hand, which
    # leaves their directories just as an expiry does) ...
    for key in sorted(keys):
        _raw_delete(url, key)
    left = _tree(url, etcd_key_prefix)
    assert left and all(n.dir for n in left), "the premise: empty directories are left"
    # ... and the next client to connect under the prefix (once the marker of the last
    # sweep, made when the nodes connected, is gone) removes what they left.
    _expire_marker(url, etcd_key_prefix)
    etcd_rdzv.create_client(etcd_api_params("someone-else")).close()
    after = _tree(url, etcd_key_prefix)
    # Only the marker, an empty directory that expires: one sweep per prefix and hour.
    assert [(n.key, n.dir) for n in after] == [(f"{etcd_key_prefix}/{SWEEP_MARKER}", True)]
    assert after[0].ttl is not None and 3500 < after[0].ttl <= 3600
    # The marker holds off the next sweep: one sweep per prefix and hour, not per client.
    _expire_marker(url, etcd_key_prefix)
    etcd_rdzv.create_client(etcd_api_params("one")).close()
    store.set("plain", b"2")
    _raw_delete(url, f"{dyn}/store/{_keys.b64_key('plain')}")
    etcd_rdzv.create_client(etcd_api_params("two")).close()
    assert f"{dyn}/store" in {n.key for n in _tree(url, etcd_key_prefix)}


def test_a_closed_and_deleted_run_leaves_nothing(
    etcd_api_params: Params,
    etcd_api_server: EtcdServer,
    etcd_key_prefix: str,
    pool: ThreadPoolExecutor,
) -> None:
    url = etcd_api_server.client_url
    params = etcd_api_params("gone", min_nodes=2, max_nodes=2, keep_alive_interval=1)
    a = etcd_rdzv.create_handler(params)
    b = etcd_rdzv.create_handler(params)
    try:
        for _ in range(3):
            _results([pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous)])
        a.set_closed()
    finally:
        a.shutdown()
        b.shutdown()
    _backend, store = etcd_rdzv.create_backend(params)  # the same run's store keys too
    store.set("k", b"v")
    run = _keys.run_dir(etcd_key_prefix, "gone")
    assert any(n.key.startswith(run + "/") for n in _tree(url, etcd_key_prefix))
    kv = etcd_rdzv.create_client(params)
    try:
        assert delete_run(kv, etcd_key_prefix, "gone").keys > 0
    finally:
        kv.close()
    tree = _tree(url, etcd_key_prefix)
    assert not [n.key for n in tree if n.key == run or n.key.startswith(run + "/")]
    # What is left under the prefix expires: only the sweep marker, with its TTL.
    assert [n for n in tree if n.ttl is None] == []


def test_a_store_cleared_and_a_deleted_key_leave_no_directory(
    etcd_api_params: Params, etcd_api_server: EtcdServer, etcd_key_prefix: str
) -> None:
    url = etcd_api_server.client_url
    _backend, store = etcd_rdzv.create_backend(etcd_api_params("cleared"))
    run = _keys.run_dir(etcd_key_prefix, "cleared")
    store.set("a", b"1")
    assert f"{run}/store" in {n.key for n in _tree(url, etcd_key_prefix)}
    assert store.delete_key("a")
    assert not [n.key for n in _tree(url, etcd_key_prefix) if n.key.startswith(run)]
    store.set("b", b"1")
    store.set("c", b"1")
    store.clear()
    assert not [n.key for n in _tree(url, etcd_key_prefix) if n.key.startswith(run)]


def test_etcd_refuses_to_change_a_directory_ttl(
    etcd_api_server: EtcdServer, etcd_key_prefix: str
) -> None:
    """Why directories are removed rather than given TTLs: etcd 3.5's v2 API (the etcd
    this project tests v2 on) refuses to change an existing directory's TTL."""
    url = etcd_api_server.client_url
    directory = f"{etcd_key_prefix}/d"
    data = b"value=1&ttl=60"
    put = urllib.request.Request(f"{url}/v2/keys{directory}/k", data=data, method="PUT")
    with urllib.request.urlopen(put, timeout=5):
        pass
    update = urllib.request.Request(
        f"{url}/v2/keys{directory}", data=b"dir=true&prevExist=true&ttl=60", method="PUT"
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(update, timeout=5)
    assert "Not a file" in refused.value.read().decode()
