"""``KV.bounded(deadline)``: every call inside the scope ends by the deadline.

A member frozen with SIGSTOP accepts connections but never answers, so without a
bound each request waits its whole ``read_timeout`` (20 s here). Inside
``kv.bounded(now + 1)`` the call must raise RendezvousConnectionError, saying that
the deadline passed, about a second later. The waits below are bounded generously
(5 s) to tell "ended at the deadline" from "hung until read_timeout".
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousConnectionError
from etcd_rdzv._kv import KV, Lease
from etcd_rdzv._kv._base import current_bound
from etcd_rdzv.testing import EtcdServer
from etcd_rdzv.testing.pytest_plugin import variant_server_options

# v2 and v3 (etcd 3.5); the v3 code path is the same on 3.4, which test_kv_v3 covers.
pytestmark = pytest.mark.etcd_variants("v2", "v3")

SLACK = 5.0  # seconds a bounded call may take in all: the 1 s bound and a busy machine


@pytest.fixture(scope="module")
def members() -> Iterator[dict[str, EtcdServer]]:
    """One member per variant for this module, started on first use: its tests pause
    it, which must not freeze the session members other tests use."""
    started: dict[str, EtcdServer] = {}
    yield started
    for server in started.values():
        server.stop()


@pytest.fixture
def member(members: dict[str, EtcdServer], etcd_variant: str) -> Iterator[EtcdServer]:
    server = members.get(etcd_variant)
    if server is None:
        server = EtcdServer(f"bounded-{etcd_variant}", **variant_server_options(etcd_variant))
        server.start()
        members[etcd_variant] = server
    yield server
    server.resume()  # a no-op unless the test left it paused


@pytest.fixture
def client(
    member: EtcdServer, etcd_api: str, etcd_key_prefix: str
) -> Iterator[Callable[[float], KV]]:
    """A factory of clients of ``member``; each is closed after the test."""
    made: list[KV] = []

    def make(read_timeout: float) -> KV:
        params = member.params(
            "r", key_prefix=etcd_key_prefix, read_timeout=read_timeout, api=etcd_api
        )
        made.append(etcd_rdzv.create_client(params))
        return made[-1]

    yield make
    for kv in made:
        kv.close()


def _stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (state ``T``)."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        with contextlib.suppress(OSError):  # a thread that just ended
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(state in "Tt" for state in states)


@contextlib.contextmanager
def _paused(member: EtcdServer) -> Iterator[None]:
    """``member`` frozen for the block. SIGSTOP takes effect after kill() returns: a
    request sent at once may still be answered, so wait until every thread stopped."""
    member.pause()
    try:
        assert member.pid is not None
        deadline = time.monotonic() + 5
        while not _stopped(member.pid):
            assert time.monotonic() < deadline, "the member did not stop"
            time.sleep(0.001)
        yield
    finally:
        member.resume()


def _deadline_error(call: Callable[[], object], name: str, started: float) -> str:
    """``call()`` must raise the deadline error from 0.9 s to :data:`SLACK` after
    ``started``. Returns the message."""
    try:
        result = call()
    except RendezvousConnectionError as exc:
        elapsed = time.monotonic() - started
        assert "deadline passed" in str(exc), exc
        assert 0.9 <= elapsed < SLACK, f"{name} ended after {elapsed:.2f} s"
        return str(exc)
    pytest.fail(f"{name} returned {result!r} after {time.monotonic() - started:.2f} s")


def _raises_at_deadline(call: Callable[[], object], kv: KV, name: str) -> str:
    """Run ``call()`` inside ``kv.bounded(now + 1)``; it must raise the deadline error
    about a second later. Returns the message."""
    started = time.monotonic()

    def bounded() -> object:
        with kv.bounded(started + 1):
            return call()

    return _deadline_error(bounded, name, started)


_LEASES: weakref.WeakKeyDictionary[KV, Lease] = weakref.WeakKeyDictionary()

OPS: dict[str, Callable[[KV, str], object]] = {
    "get": lambda kv, k: kv.get(k),
    "list_tree": lambda kv, k: kv.list_tree(k),
    "put": lambda kv, k: kv.put(k, "new", None),
    "put_ttl": lambda kv, k: kv.put(k, "new", 45),  # v3: a clean-up lease grant
    "create": lambda kv, k: kv.create(k + "-new", "v", None),
    "compare_and_set": lambda kv, k: kv.compare_and_set(k, "new", 1, None),
    "refresh": lambda kv, k: kv.refresh(k + "-owned", 30),
    "keep_alive": lambda kv, k: kv.keep_alive(_LEASES[kv]),
    "put_owned": lambda kv, k: kv.put_owned(k + "-owned2", "me", _LEASES[kv]),
    "create_owned": lambda kv, k: kv.create(k + "-coord", "me", None, lease=_LEASES[kv]),
    "delete": lambda kv, k: kv.delete(k),
    "watch": lambda kv, k: kv.watch(k, 10**9, timeout=30),
    "watch_events": lambda kv, k: kv.watch_events(k, 10**9, timeout=None, prefix=True),
}


@pytest.mark.parametrize("op", list(OPS))
def test_a_call_to_a_paused_member_ends_at_the_deadline(
    client: Callable[[float], KV], member: EtcdServer, etcd_key_prefix: str, op: str
) -> None:
    kv = client(20)
    key = f"{etcd_key_prefix}/k"
    kv.put(key, "v", None)
    _LEASES[kv] = lease = kv.grant(30)
    kv.put_owned(key + "-owned", "me", lease)
    with _paused(member):
        message = _raises_at_deadline(lambda: OPS[op](kv, key), kv, op)
    assert member.client_url in message
    if op not in ("put_ttl", "keep_alive"):  # v3: about a lease, not a key
        assert key in message


def test_a_watcher_on_a_paused_member_ends_at_the_deadline(
    client: Callable[[float], KV], member: EtcdServer, etcd_key_prefix: str
) -> None:
    kv = client(20)
    key = f"{etcd_key_prefix}/w"
    with kv.watcher(key) as watcher:
        watcher.reread(lambda: kv.get(key))
        with _paused(member):
            _raises_at_deadline(lambda: watcher.next(30), kv, "Watcher.next")


def test_close_on_a_paused_member_ends_at_the_deadline(
    client: Callable[[float], KV], member: EtcdServer, etcd_key_prefix: str
) -> None:
    kv = client(20)
    kv.put_owned(f"{etcd_key_prefix}/owned", "me", kv.grant(30))  # v3: a lease to revoke
    with _paused(member):
        started = time.monotonic()
        with kv.bounded(started + 1):
            kv.close()  # logs that the lease could not be revoked; never raises
        assert time.monotonic() - started < SLACK


def test_nested_scopes_keep_the_earlier_deadline(
    client: Callable[[float], KV], member: EtcdServer, etcd_key_prefix: str
) -> None:
    kv = client(20)
    with _paused(member):
        for outer, inner in ((1, 30), (30, 1)):
            started = time.monotonic()

            def nested(
                outer: float = outer, inner: float = inner, started: float = started
            ) -> object:
                with (
                    kv.bounded(started + outer),
                    kv.bounded(started + inner),
                    kv.bounded(None),  # adds no bound, keeps the one outside
                ):
                    assert current_bound() == started + 1
                    return kv.get(f"{etcd_key_prefix}/k")

            _deadline_error(nested, f"get in scopes {outer} s, {inner} s", started)
    assert current_bound() is None


def test_calls_without_a_scope_are_unaffected(
    client: Callable[[float], KV], member: EtcdServer, etcd_key_prefix: str
) -> None:
    """A scope bounds the thread that opened it only; outside, read_timeout rules."""
    kv = client(3)
    key = f"{etcd_key_prefix}/k"
    kv.put(key, "v", None)
    unbounded: list[tuple[float, BaseException | None]] = []

    def read_unbounded() -> None:
        started = time.monotonic()
        error: BaseException | None = None
        try:
            kv.get(key)
        except BaseException as exc:  # recorded, asserted on below
            error = exc
        unbounded.append((time.monotonic() - started, error))

    with _paused(member):
        other = threading.Thread(target=read_unbounded)
        other.start()
        _raises_at_deadline(lambda: kv.get(key), kv, "get")
        other.join(20)
    assert not other.is_alive()
    [(elapsed, error)] = unbounded
    assert isinstance(error, RendezvousConnectionError)
    assert "deadline" not in str(error) and "No etcd endpoint completed" in str(error)
    assert elapsed >= 2.5  # its whole read_timeout (3 s), not the other thread's bound
    assert current_bound() is None
    record, _ = kv.get(key)  # the member is back; the client still works
    assert record is not None and record.value == "v"


def test_a_scope_on_a_healthy_member(
    client: Callable[[float], KV], member: EtcdServer, etcd_key_prefix: str
) -> None:
    kv = client(20)
    key = f"{etcd_key_prefix}/k"
    started = time.monotonic()
    with kv.bounded(started + 10):
        written = kv.put(key, "v", 30)
        record, _ = kv.get(key)
        assert record is not None and record.revision == written.revision
        assert kv.compare_and_set(key, "w", written.revision, None) is not None
        assert kv.refresh(key, 30)
        assert kv.watch(key, written.revision + 10, timeout=0.3) is None  # its own timeout
    assert time.monotonic() - started < SLACK
    # A watch that would outlast the scope raises at the deadline, not empty early.
    _raises_at_deadline(lambda: kv.watch(key, written.revision + 10, timeout=10), kv, "watch")
    # A deadline already passed: nothing is sent.
    started = time.monotonic()
    with (
        pytest.raises(RendezvousConnectionError, match="deadline passed"),
        kv.bounded(started - 1),
    ):
        kv.put(f"{key}-late", "v", None)
    assert time.monotonic() - started < 1
    assert kv.get(f"{key}-late")[0] is None
