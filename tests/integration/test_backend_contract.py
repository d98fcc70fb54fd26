"""The RendezvousBackend contract, against a real etcd.

Written as a suite over a ``make_backend`` fixture so every KV implementation runs
the same assertions: v2 (etcd 3.5 with --enable-v2), v3 on etcd 3.5 and v3 on Debian's
etcd 3.4, both without the v2 API.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

import etcd_rdzv
from etcd_rdzv import EtcdRendezvousBackend, RendezvousConnectionError, RendezvousStateError
from etcd_rdzv.testing import EtcdServer
from etcd_rdzv.testing.pytest_plugin import variant_server_options

from ._rawkv import raw_get, raw_put

pytestmark = pytest.mark.etcd_variants("v2", "v3", "v3-3.4")

MakeBackend = Callable[..., EtcdRendezvousBackend]


@pytest.fixture
def make_backend(
    etcd_api_params: Callable[..., etcd_rdzv.RendezvousParameters],
) -> Iterator[MakeBackend]:
    clients = []

    def make(run_id: str = "run", **kwargs: object) -> EtcdRendezvousBackend:
        params = etcd_api_params(run_id)
        client = etcd_rdzv.create_client(params)
        clients.append(client)
        return EtcdRendezvousBackend(
            client,
            run_id,
            key_prefix=params.get("key_prefix"),
            **kwargs,  # type: ignore[arg-type]
        )

    yield make
    for c in clients:
        c.close()


def test_absent_state_is_none(make_backend: MakeBackend) -> None:
    assert make_backend().get_state() is None


def test_create_then_read(make_backend: MakeBackend) -> None:
    backend = make_backend()
    state, token, has_set = backend.set_state(b"first")  # type: ignore[misc]
    assert (state, has_set) == (b"first", True)
    assert backend.get_state() == (b"first", token)


def test_create_when_present_returns_current(make_backend: MakeBackend) -> None:
    backend = make_backend()
    _, token, _ = backend.set_state(b"first")  # type: ignore[misc]
    assert backend.set_state(b"second") == (b"first", token, False)
    assert backend.set_state(b"second", None) == (b"first", token, False)


def test_write_with_current_token(make_backend: MakeBackend) -> None:
    backend = make_backend()
    _, token1, _ = backend.set_state(b"one")  # type: ignore[misc]
    state, token2, has_set = backend.set_state(b"two", token1)  # type: ignore[misc]
    assert (state, has_set) == (b"two", True)
    assert token2 != token1
    assert backend.get_state() == (b"two", token2)


def test_stale_token_returns_current_unset(make_backend: MakeBackend) -> None:
    backend = make_backend()
    _, token1, _ = backend.set_state(b"one")  # type: ignore[misc]
    _, token2, _ = backend.set_state(b"two", token1)  # type: ignore[misc]
    assert backend.set_state(b"three", token1) == (b"two", token2, False)


@pytest.mark.parametrize("token", ["garbage", b"\xff", -1, 0, "0", 1.5, object(), [1]])
def test_malformed_token_never_raises(make_backend: MakeBackend, token: object) -> None:
    backend = make_backend()
    assert backend.set_state(b"x", token) is None  # nothing stored, nothing written
    assert backend.get_state() is None
    _, current, _ = backend.set_state(b"one")  # type: ignore[misc]
    assert backend.set_state(b"two", token) == (b"one", current, False)


def test_token_as_string_is_accepted(make_backend: MakeBackend) -> None:
    backend = make_backend()
    _, token, _ = backend.set_state(b"one")  # type: ignore[misc]
    assert backend.set_state(b"two", str(token))[2] is True  # type: ignore[index]


def test_binary_state_round_trips(make_backend: MakeBackend) -> None:
    backend = make_backend()
    blob = bytes(range(256)) * 40
    backend.set_state(blob)
    assert backend.get_state()[0] == blob  # type: ignore[index]


def test_corrupt_state_is_a_state_error(
    make_backend: MakeBackend, etcd_api_server: EtcdServer, etcd_api: str
) -> None:
    backend = make_backend()
    raw_put(etcd_api_server.client_url, etcd_api, backend.key, "not base64 ###")
    with pytest.raises(RendezvousStateError, match="not valid base64"):
        backend.get_state()
    with pytest.raises(RendezvousStateError):
        backend.set_state(b"x")  # the create fails, the read back is corrupt


def test_state_has_ttl_refreshed_on_each_write(
    make_backend: MakeBackend, etcd_api_server: EtcdServer, etcd_api: str
) -> None:
    backend = make_backend()
    assert backend.ttl == 7200
    _, token, _ = backend.set_state(b"one")  # type: ignore[misc]
    raw = raw_get(etcd_api_server.client_url, etcd_api, backend.key)
    assert raw is not None and raw.ttl is not None and 7100 < raw.ttl <= 7200
    assert raw.revision == token  # the token is the v2 modifiedIndex / v3 mod_revision
    _, token2, _ = backend.set_state(b"two", token)  # type: ignore[misc]
    raw = raw_get(etcd_api_server.client_url, etcd_api, backend.key)
    assert raw is not None and raw.ttl is not None and 7100 < raw.ttl <= 7200
    assert raw.revision == token2


def test_state_expires_after_its_ttl(make_backend: MakeBackend) -> None:
    backend = make_backend(ttl=1)
    _, token, _ = backend.set_state(b"short-lived")  # type: ignore[misc]
    kv = backend._kv
    event = kv.watch(backend.key, int(token) + 1, timeout=10)  # the expiry, watch-driven
    assert event is not None and event.kind == "delete"
    assert backend.get_state() is None


def test_runs_do_not_see_each_other(make_backend: MakeBackend) -> None:
    a, b, odd = make_backend("run-a"), make_backend("run-b"), make_backend("run a/b ü")
    a.set_state(b"A")
    odd.set_state(b"odd")
    assert b.get_state() is None
    assert a.get_state()[0] == b"A"  # type: ignore[index]
    assert odd.get_state()[0] == b"odd"  # type: ignore[index]


def test_exactly_one_concurrent_writer_wins(make_backend: MakeBackend) -> None:
    backends = [make_backend() for _ in range(6)]
    _, token, _ = backends[0].set_state(b"base")  # type: ignore[misc]
    results: list[bool] = []
    barrier = threading.Barrier(len(backends))

    def write(i: int) -> None:
        barrier.wait()
        results.append(backends[i].set_state(f"w{i}".encode(), token)[2])  # type: ignore[index]

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(backends))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == [False] * 5 + [True]


def test_name_and_bad_ttl(make_backend: MakeBackend) -> None:
    assert make_backend().name == "etcd-rdzv-dynamic"
    assert make_backend(name="custom").name == "custom"
    with pytest.raises(ValueError, match="ttl"):
        make_backend(ttl=0)


def test_unreachable_etcd_is_a_connection_error(
    etcd_key_prefix: str, etcd_variant: str, etcd_api: str
) -> None:
    with EtcdServer("short-lived", **variant_server_options(etcd_variant)) as server:
        params = server.params("run", key_prefix=etcd_key_prefix, read_timeout=3, api=etcd_api)
        backend, _store = etcd_rdzv.create_backend(params)
        backend.set_state(b"x")
        server.kill()
        with pytest.raises(RendezvousConnectionError, match=server.endpoint):
            backend.get_state()
        with pytest.raises(RendezvousConnectionError):
            backend.set_state(b"y")
