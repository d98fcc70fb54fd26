"""EtcdStore on a real etcd: every method of the torch Store surface, on each API
(v2; v3 on etcd 3.5 and on Debian's etcd 3.4, without the v2 API)."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest

import etcd_rdzv
from etcd_rdzv import EtcdStore, RendezvousParameters, StoreQueueEmptyError, StoreTimeoutError
from etcd_rdzv.testing import EtcdServer

from . import _store_worker
from ._rawkv import raw_exists_under, raw_get

pytestmark = pytest.mark.etcd_variants("v2", "v3", "v3-3.4")

Params = Callable[..., RendezvousParameters]


@pytest.fixture
def make_store(etcd_api_params: Params) -> Iterator[Callable[..., EtcdStore]]:
    clients = []

    def make(run_id: str = "run", **kwargs: object) -> EtcdStore:
        params = etcd_api_params(run_id)
        client = etcd_rdzv.create_client(params)
        clients.append(client)
        prefix = f"{params.get('key_prefix')}/{run_id}/store"
        return EtcdStore(client, prefix, **kwargs)  # type: ignore[arg-type]

    yield make
    for c in clients:
        c.close()


@pytest.fixture
def store(make_store: Callable[..., EtcdStore]) -> EtcdStore:
    return make_store()


def test_set_get_bytes_and_str(store: EtcdStore) -> None:
    store.set("k", b"\x00\xffbin")
    store.set(b"k2", "tëxt")
    assert store.get("k") == b"\x00\xffbin"
    assert store.get(b"k2") == "tëxt".encode()
    store.set("k", b"")
    assert store.get("k") == b""


def test_keys_with_slashes_spaces_and_unicode(store: EtcdStore) -> None:
    keys = ["a/b", "/lead", "with space", "ünï", "x" * 300, "a+b=c"]
    for i, key in enumerate(keys):
        store.set(key, str(i))
    assert [store.get(k) for k in keys] == [str(i).encode() for i in range(len(keys))]
    assert store.num_keys() == len(keys)


def test_get_times_out_with_store_timeout_error(store: EtcdStore) -> None:
    store.set_timeout(timedelta(seconds=0.3))
    assert store.timeout == timedelta(seconds=0.3)
    started = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="missing") as info:
        store.get("missing")
    assert isinstance(info.value, LookupError)
    # torch's store tests (and code reading the message) look for "timeout".
    assert "timeout" in str(info.value).lower()
    assert time.monotonic() - started < 5  # bounded: no hang past the timeout


def test_zero_timeout_does_not_wait(store: EtcdStore) -> None:
    store.set_timeout(0)
    with pytest.raises(StoreTimeoutError):
        store.get("nothing")
    store.set("there", "1")
    assert store.get("there") == b"1"


def test_negative_timeout_rejected(store: EtcdStore) -> None:
    with pytest.raises(ValueError, match="negative"):
        store.set_timeout(-1)


def test_get_blocks_until_another_process_sets(
    store: EtcdStore, etcd_api_server: EtcdServer, etcd_api_params: Params, etcd_api: str
) -> None:
    params = etcd_api_params("run")
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(
        target=_store_worker.late_setter,
        args=(etcd_api_server.endpoint, params.get("key_prefix"), "run", "late", 1.0, etcd_api),
    )
    proc.start()
    try:
        store.set_timeout(60)
        assert not store.check(["late"])
        store.set("go", "1")
        started = time.monotonic()
        value = store.get("late")
        waited = time.monotonic() - started
        assert value.startswith(b"set-at-")
        assert waited >= 0.9  # it really blocked until the other process wrote
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


def test_concurrent_adds_from_processes_are_exact(
    store: EtcdStore, etcd_api_server: EtcdServer, etcd_api_params: Params, etcd_api: str
) -> None:
    params = etcd_api_params("run")
    ctx = multiprocessing.get_context("spawn")
    workers, times = 4, 40
    key_prefix = params.get("key_prefix")
    procs = [
        ctx.Process(
            target=_store_worker.adder,
            args=(etcd_api_server.endpoint, key_prefix, "run", "counter", times, etcd_api),
        )
        for _ in range(workers)
    ]
    for p in procs:
        p.start()
    try:
        store.set("go", "1")
        for p in procs:
            p.join(120)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * workers
    assert store.get("counter") == str(workers * times).encode()
    assert store.add("counter", 0) == workers * times


def test_add(store: EtcdStore) -> None:
    assert store.add("n", 5) == 5
    assert store.add("n", -7) == -2
    assert store.get("n") == b"-2"
    store.set("text", "abc")
    with pytest.raises(ValueError, match="not an integer"):
        store.add("text", 1)


def test_compare_set(store: EtcdStore) -> None:
    # absent key, expected empty: set
    assert store.compare_set("k", "", "v1") == b"v1"
    # matches: swap
    assert store.compare_set("k", "v1", "v2") == b"v2"
    # mismatch: current value back, unchanged
    assert store.compare_set("k", "nope", "v3") == b"v2"
    assert store.get("k") == b"v2"
    # absent key, expected non-empty: expected back, nothing written
    assert store.compare_set("absent", "e", "d") == b"e"
    assert not store.check(["absent"])


def test_wait_and_check(store: EtcdStore) -> None:
    store.set("a", "1")
    store.set("b", "2")
    store.wait(["a", "b"])
    assert store.check(["a", "b"])
    assert not store.check(["a", "c"])
    with pytest.raises(StoreTimeoutError, match="'c'"):
        store.wait(["a", "c"], timedelta(seconds=0.2))


def test_delete_and_num_keys(store: EtcdStore) -> None:
    assert store.num_keys() == 0
    store.set("a", "1")
    store.set("b", "1")
    assert store.num_keys() == 2
    assert store.delete_key("a") is True
    assert store.delete_key("a") is False
    assert store.num_keys() == 1


def test_multi_get_and_set(store: EtcdStore) -> None:
    store.multi_set(["x", "y"], [b"1", "2"])
    assert store.multi_get(["y", "x"]) == [b"2", b"1"]
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        store.multi_set(["p", "q"], ["1"])
    assert not store.check(["p"])  # nothing half-written
    store.set_timeout(0.2)
    with pytest.raises(StoreTimeoutError):
        store.multi_get(["x", "never"])


def test_append(store: EtcdStore) -> None:
    store.append("log", "a")
    store.append("log", b"bc")
    assert store.get("log") == b"abc"


def test_keys_carry_a_ttl_and_clear_removes_them(
    make_store: Callable[..., EtcdStore], etcd_api_server: EtcdServer, etcd_api: str
) -> None:
    url = etcd_api_server.client_url
    store = make_store(ttl=600)
    store.set("k", "v")
    raw = raw_get(url, etcd_api, store._path("k"))
    assert raw is not None and raw.ttl is not None and 500 < raw.ttl <= 600
    store.add("n", 1)
    raw = raw_get(url, etcd_api, store._path("n"))
    assert raw is not None and raw.ttl is not None and raw.ttl <= 600
    store.clear()
    assert store.num_keys() == 0
    assert not raw_exists_under(url, etcd_api, store.prefix)


def test_ttl_zero_means_no_expiry(
    make_store: Callable[..., EtcdStore], etcd_api_server: EtcdServer, etcd_api: str
) -> None:
    store = make_store(ttl=0)
    store.set("k", "v")
    raw = raw_get(etcd_api_server.client_url, etcd_api, store._path("k"))
    assert raw is not None and raw.ttl is None


def test_runs_are_isolated(make_store: Callable[..., EtcdStore]) -> None:
    a, b = make_store("run-a"), make_store("run-b")
    a.set("shared-name", "A")
    b.set_timeout(0)
    assert not b.check(["shared-name"])
    assert b.num_keys() == 0


def test_bad_arguments(make_store: Callable[..., EtcdStore], store: EtcdStore) -> None:
    with pytest.raises(TypeError):
        store.set("k", 5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        store.set("", "v")
    with pytest.raises(ValueError, match="store_ttl"):
        make_store(ttl=-1)


def test_create_backend_store_uses_run_prefix(etcd_api_params: Params) -> None:
    params = etcd_api_params("my run/1")
    _backend, store = etcd_rdzv.create_backend(params)
    assert store.prefix.startswith(str(params.get("key_prefix")) + "/~")
    assert store.prefix.endswith("/store")
    store.set("k", "v")
    assert store.get("k") == b"v"


def test_list_keys(store: EtcdStore) -> None:
    assert store.list_keys() == []
    for key in ["b", "a/x", "ünï", "with space"]:
        store.set(key, "1")
    store.add("n", 1)
    # Not keys of this store: a sub-store's keys, and a key somebody else wrote here.
    EtcdStore(store._kv, f"{store.prefix}/r1").set("inner", "1")
    store._kv.put(f"{store.prefix}/not=base64!", "x", 60)
    assert store.list_keys() == sorted(["b", "a/x", "ünï", "with space", "n"])
    store.delete_key("b")
    assert "b" not in store.list_keys()


def test_clone_shares_the_keys_and_works_from_another_thread(store: EtcdStore) -> None:
    store.set_timeout(timedelta(seconds=7))
    twin = store.clone()
    assert twin is not store and type(twin) is type(store)
    assert (twin.prefix, twin.timeout) == (store.prefix, store.timeout)
    twin.set_timeout(timedelta(seconds=3))  # its own timeout from here on
    assert store.timeout == timedelta(seconds=7)

    got: list[bytes] = []
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            mine = store.clone()  # one clone per thread, as torch intends
            got.append(mine.get("later"))  # blocks until the other thread writes
            assert mine.add("count", 5) == 6
        except BaseException as exc:  # reported by the assertions below
            errors.append(exc)

    store.add("count", 1)
    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    time.sleep(0.2)
    twin.set("later", "from the clone")
    thread.join(30)
    assert not errors, errors
    assert got == [b"from the clone"]
    assert store.get("count") == b"6"


def test_queue_push_pop_in_order(store: EtcdStore) -> None:
    assert store.queue_len("jobs") == 0
    for item in ["a", b"\x00b", "ç"]:
        store.queue_push("jobs", item)
    assert store.queue_len("jobs") == 3
    assert [store.queue_pop("jobs") for _ in range(3)] == [b"a", b"\x00b", "ç".encode()]
    assert store.queue_len("jobs") == 0
    # Queues are not keys: neither listed nor counted, and a key of the same name is
    # another thing.
    store.queue_push("jobs", "x")
    store.set("jobs", "plain")
    assert (store.list_keys(), store.num_keys()) == (["jobs"], 1)
    assert (store.get("jobs"), store.queue_pop("jobs")) == (b"plain", b"x")


def test_queue_pop_empty(store: EtcdStore) -> None:
    with pytest.raises(StoreQueueEmptyError, match="empty"):
        store.queue_pop("none", block=False)
    store.set_timeout(timedelta(seconds=0.5))
    started = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
        store.queue_pop("none")
    assert "timeout" in str(info.value).lower()
    assert 0.4 < time.monotonic() - started < 5  # waited its timeout, no hang


def test_blocked_queue_pop_wakes_on_a_push(store: EtcdStore) -> None:
    store.set_timeout(timedelta(seconds=30))
    got: list[tuple[bytes, float]] = []

    def pop() -> None:
        got.append((store.clone().queue_pop("q"), time.monotonic()))

    thread = threading.Thread(target=pop, daemon=True)
    thread.start()
    time.sleep(0.5)
    pushed = time.monotonic()
    store.queue_push("q", "wake")
    thread.join(30)
    assert got and got[0][0] == b"wake"
    assert got[0][1] - pushed < 2.0, "the pop polled instead of waiting on a watch"


def test_a_queue_is_set_while_it_holds_items(store: EtcdStore) -> None:
    # As on torch's stores: check and wait see a queue at its key while it holds
    # items; delete_key and num_keys do not touch it.
    assert not store.check(["q"])
    store.queue_push("q", "a")
    store.set("plain", "v")
    assert store.check(["q"]) and store.check(["q", "plain"])
    store.wait(["q", "plain"], timedelta(seconds=5))
    assert store.delete_key("q") is False and store.queue_len("q") == 1
    assert store.num_keys() == 1
    assert store.queue_pop("q") == b"a"
    assert not store.check(["q"])
    started = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="'q'"):
        store.wait(["q"], timedelta(seconds=0.3))
    assert time.monotonic() - started < 5


def test_wait_on_a_queue_wakes_on_its_push_only(store: EtcdStore) -> None:
    woke: list[float] = []

    def wait() -> None:
        store.clone().wait(["q"], timedelta(seconds=30))
        woke.append(time.monotonic())

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    time.sleep(0.3)
    for i in range(5):  # other keys and queues change: the wait goes on
        store.set(f"other-{i}", "x")
        store.queue_push("other-queue", "x")
    time.sleep(0.3)
    assert not woke, "the wait ended on a change of another key"
    pushed = time.monotonic()
    store.queue_push("q", "wake")
    thread.join(30)
    assert woke and woke[0] - pushed < 2.0, "the wait polled instead of watching"


def test_each_item_goes_to_one_popper(store: EtcdStore) -> None:
    store.set_timeout(timedelta(seconds=20))
    items = [f"item-{i}" for i in range(30)]
    popped: list[bytes] = []
    lock = threading.Lock()

    def popper() -> None:
        mine = store.clone()
        for _ in range(10):
            value = mine.queue_pop("work")
            with lock:
                popped.append(value)

    threads = [threading.Thread(target=popper, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    for item in items:
        store.queue_push("work", item)
    for t in threads:
        t.join(60)
    assert sorted(popped) == sorted(i.encode() for i in items)
    assert store.queue_len("work") == 0
