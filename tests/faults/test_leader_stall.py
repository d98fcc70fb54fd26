"""A request stuck behind a leader that died or froze is sent again once a new leader
is elected, instead of waiting for etcd's own request timeout (5 s plus two election
timeouts), on both APIs: v3 answers carry the raft term in their header, v2 results in
their ``X-Raft-Term`` header."""

from __future__ import annotations

import logging
import threading
import time

import pytest

import etcd_rdzv
from etcd_rdzv._kv import KV, _stall
from etcd_rdzv.client import build_kv
from etcd_rdzv.config.params import ClientConfig
from etcd_rdzv.testing import EtcdCluster

HANG = 30.0  # seconds: a generous bound that only catches hangs
#: etcd's own request timeout for the test members (5 s plus two election timeouts of
#: 500 ms): when the stuck write's member answers it. The resend must beat it; without
#: the resend the write takes at least this long (it is answered only then).
ETCD_REQUEST_TIMEOUT = 5.0 + 2 * 0.5
#: How many times a kill is made before a write stuck behind it is demanded.
ATTEMPTS = 3


def _write_in_thread(kv: KV, key: str, value: str) -> tuple[threading.Event, list[object]]:
    """``kv.put(key, value)`` in a thread of its own: set when it ended, and its
    record or the exception it raised."""
    done = threading.Event()
    outcome: list[object] = []

    def write() -> None:
        try:
            outcome.append(kv.put(key, value, None))
        except Exception as exc:  # the caller's assertions report it
            outcome.append(exc)
        done.set()

    threading.Thread(target=write, daemon=True).start()
    return done, outcome


def _no_question(monkeypatch: pytest.MonkeyPatch) -> None:
    """A waiting request asks its member only after 60 s: with fewer answers than
    KNOWN (ASK), and with more (ASK_KNOWN; a test's reads are answers too: in CI an
    election of over 1.5 s once made the stuck write ask before a read showed the term)."""
    monkeypatch.setattr(_stall, "ASK", 60.0)
    monkeypatch.setattr(_stall, "ASK_KNOWN", 60.0)


def _stalled(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "elected a new leader" in r.getMessage()]


@pytest.mark.parametrize(
    ("fault", "first"), [("pause", "write"), ("kill", "write"), ("pause", "miss")]
)
def test_a_write_stuck_behind_a_frozen_or_killed_leader_is_sent_again(
    cluster: EtcdCluster,
    api: str,
    fault: str,
    first: str,
    etcd_key_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A killed leader's peers see its connections close: on a loaded machine the write
    # may reach the follower after it gave the leader up, and land with the next leader
    # without being stuck (once in CI: 0.66 s). The kill is then made again, with the
    # member started again; a paused leader holds every write sent to it.
    for attempt in range(1, ATTEMPTS + 1):
        stalled, took, elected = _stuck_write(cluster, api, fault, first, etcd_key_prefix, caplog)
        if stalled or fault != "kill" or took >= _stall.ASK or attempt == ATTEMPTS:
            break
        print(f"attempt {attempt}: the write was not stuck ({took:.2f}s); the kill again")
    assert stalled, f"no stalled request was found (the write took {took:.2f}s)"
    # What the resend buys: the write lands before etcd would have answered it
    # (about ASK seconds plus an election here, against etcd's timeout).
    assert took < ETCD_REQUEST_TIMEOUT, (
        f"the write took {took:.2f}s, not less than etcd's request timeout "
        f"({ETCD_REQUEST_TIMEOUT:g}s): it was not sent again in time; {stalled}"
    )
    # The bound, the election + 3 s: the client asks its member ASK
    # seconds after sending, which finds the new leader when the election took
    # less; then one resend.
    if elected < _stall.ASK:
        assert took < _stall.ASK + 1.5, (
            f"the write took {took:.2f}s; the new leader was seen after {elected:.2f}s"
        )
    # Nothing else came to this client: it asked its member.
    assert "raft term" in stalled[0] and "answer when asked" in stalled[0], stalled


def _stuck_write(
    cluster: EtcdCluster,
    api: str,
    fault: str,
    first: str,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> tuple[list[str], float, float]:
    """One write sent through a follower right after the leader's ``fault``: the
    stall messages logged, the seconds the write took and (at most) the election's.
    The faulted member is running again when this returns."""
    leader = cluster.leader(timeout=15)
    follower = next(m for m in cluster.members if m is not leader)
    # One endpoint, a follower: the write is forwarded to the leader, and only a new
    # leader can apply it. read_timeout is longer than etcd's request timeout, so
    # without the check the write would wait for etcd's answer.
    params = cluster.params("stall", api=api, key_prefix=prefix, read_timeout=20)
    params.endpoint = follower.endpoint
    # A client built without requests (as a handler's is), so that its first answer is
    # the one this test makes.
    kv = build_kv(ClientConfig.from_params(params))
    key = f"{prefix}/stall/key"
    caplog.clear()
    try:
        if first == "write":
            kv.put(key, "before", None)  # an answer: the client knows the raft term
        else:
            # A key not found: v2 answers it without a raft term, as a fresh run's
            # first reads; the client learns the term all the same.
            assert kv.get(f"{prefix}/stall/absent")[0] is None
        caplog.set_level(logging.INFO, logger="etcd_rdzv")
        getattr(leader, fault)()
        began = time.monotonic()
        done, outcome = _write_in_thread(kv, key, "after")
        assert cluster.leader(timeout=15) is not leader
        elected = time.monotonic() - began  # at most: the test's own polls take time
        assert done.wait(HANG), "the write hung"
        took = time.monotonic() - began
        assert not isinstance(outcome[0], Exception), outcome
        record, _ = kv.get(key)
        assert record is not None and record.value == "after"
        return _stalled(caplog), took, elected
    finally:
        if fault == "pause":
            leader.resume()
        else:
            leader.start()
        kv.close()


@pytest.mark.parametrize("api", ["v3"])
def test_a_stuck_write_is_sent_again_when_the_clients_watch_shows_the_new_term(
    cluster: EtcdCluster,
    api: str,
    etcd_key_prefix: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The client's watch (as every node has one) brings an event from the new
    # leader's term: the stuck write sees it there, without asking its member (which
    # it would do only after ASK seconds: made longer than the test here).
    _no_question(monkeypatch)
    leader = cluster.leader(timeout=15)
    follower, other = (m for m in cluster.members if m is not leader)
    params = cluster.params("stall", api=api, key_prefix=etcd_key_prefix, read_timeout=20)
    params.endpoint = follower.endpoint
    kv = etcd_rdzv.create_client(params)
    params.endpoint = other.endpoint
    writer = etcd_rdzv.create_client(params)
    watched = f"{etcd_key_prefix}/stall/watched"  # a directory: the keys below it
    key = f"{etcd_key_prefix}/stall/key"
    try:
        at = kv.put(key, "before", None).revision  # the client knows the raft term
        caplog.set_level(logging.INFO, logger="etcd_rdzv")
        seen: list[object] = []
        watch = threading.Thread(
            target=lambda: seen.append(kv.watch_events(watched, at + 1, HANG, prefix=True)),
            daemon=True,
        )
        watch.start()
        leader.pause()
        began = time.monotonic()
        done, outcome = _write_in_thread(kv, key, "after")
        assert cluster.leader(timeout=15) is not leader
        writer.put(watched + "/x", "from the new term", None)
        assert done.wait(HANG), "the write hung"
        took = time.monotonic() - began
        assert took < ETCD_REQUEST_TIMEOUT, (
            f"the write took {took:.2f}s, not less than etcd's request timeout "
            f"({ETCD_REQUEST_TIMEOUT:g}s): it was not sent again when the watch saw the term"
        )
        assert not isinstance(outcome[0], Exception), outcome
        watch.join(HANG)
        assert seen and seen[0], "the watch saw nothing"
        stalled = _stalled(caplog)
        assert stalled and "seen in this client's answers" in stalled[0], stalled
        record, _ = kv.get(key)
        assert record is not None and record.value == "after"
    finally:
        leader.resume()
        kv.close()
        writer.close()


def test_a_stuck_write_is_sent_again_when_another_answer_shows_the_new_term(
    cluster: EtcdCluster,
    api: str,
    etcd_key_prefix: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A read of the same client, answered by its member after the election, carries
    # the new term (v2: a result's X-Raft-Term; a v2 watch's headers come when it
    # starts, so they do not): the stuck write sees it there, without asking its
    # member (which it would do only after ASK seconds: made longer than the test).
    _no_question(monkeypatch)
    leader = cluster.leader(timeout=15)
    follower = next(m for m in cluster.members if m is not leader)
    params = cluster.params("stall", api=api, key_prefix=etcd_key_prefix, read_timeout=20)
    params.endpoint = follower.endpoint
    kv = etcd_rdzv.create_client(params)
    key = f"{etcd_key_prefix}/stall/key"
    try:
        kv.put(key, "before", None)  # an answer: the client knows the raft term
        caplog.set_level(logging.INFO, logger="etcd_rdzv")
        leader.pause()
        began = time.monotonic()
        done, outcome = _write_in_thread(kv, key, "after")
        assert cluster.leader(timeout=15) is not leader
        deadline = time.monotonic() + HANG
        while not done.is_set() and time.monotonic() < deadline:
            kv.get(key)  # served by the follower, in its current term
            done.wait(0.1)
        assert done.wait(HANG), "the write hung"
        took = time.monotonic() - began
        assert took < ETCD_REQUEST_TIMEOUT, (
            f"the write took {took:.2f}s, not less than etcd's request timeout "
            f"({ETCD_REQUEST_TIMEOUT:g}s): it was not sent again when a read saw the term"
        )
        assert not isinstance(outcome[0], Exception), outcome
        stalled = _stalled(caplog)
        assert stalled and "seen in this client's answers" in stalled[0], stalled
        record, _ = kv.get(key)
        assert record is not None and record.value == "after"
    finally:
        leader.resume()
        kv.close()
