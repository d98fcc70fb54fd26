"""The native handler's life: what it leaves behind and what it imports.

* a handler dropped without ``shutdown()`` is garbage-collected, and its finalizer
  stops its threads and deletes its join key (the others see the node gone at once);
* ``create_handler`` never imports torch, even where torch is installed;
* each heartbeat is bounded by ``heartbeat_timeout``, whatever etcd does.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousConnectionError, RendezvousParameters, _keys
from etcd_rdzv._kv import KV
from etcd_rdzv.rendezvous import join as join_module
from etcd_rdzv.rendezvous.heart import Heart
from etcd_rdzv.testing import EtcdServer

Params = Callable[..., RendezvousParameters]


def _threads(run_id: str) -> list[str]:
    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith(("etcd-rdzv-heart:", "etcd-rdzv-watch:")) and run_id in t.name
    ]


def _join_keys(kv: KV, prefix: str, run_id: str) -> list[str]:
    records, _ = kv.list_tree(_keys.rdzv_dir(prefix, run_id))
    return [r.key for r in records if "/nodes/" in r.key]


def test_dropped_handler_stops_its_threads_and_deletes_its_join_key(
    etcd_api_params: Params, etcd_key_prefix: str
) -> None:
    run_id = "dropped"
    params = etcd_api_params(run_id, keep_alive_interval=1, join_timeout=30)
    probe = etcd_rdzv.create_client(params)
    try:
        handler = etcd_rdzv.create_handler(params)
        result = handler.next_rendezvous()
        assert (result.rank, result.world_size) == (0, 1)
        assert _threads(run_id), "a completed round runs a heartbeat and a member watcher"
        assert len(_join_keys(probe, etcd_key_prefix, run_id)) == 1
        alive = weakref.ref(handler)
        del handler, result
        gc.collect()
        assert alive() is None, "something still holds the handler: it can never be finalized"
        deadline = time.monotonic() + 10
        while (_threads(run_id) or _join_keys(probe, etcd_key_prefix, run_id)) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert _threads(run_id) == []
        # Deleted, not expired: the key's TTL is 3 s and far from over when this looks.
        assert _join_keys(probe, etcd_key_prefix, run_id) == []
    finally:
        probe.close()


def test_a_built_handler_has_the_heart_of_its_first_join_running(
    etcd_api_params: Params,
) -> None:
    """Built, a handler starts the thread that keeps its join key alive: the join
    uses it (no thread started in the join's window but the member watcher), and a
    handler dropped before it joined stops it."""
    run_id = "early-heart"
    params = etcd_api_params(run_id, keep_alive_interval=1, join_timeout=30)

    def hearts() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == f"etcd-rdzv-heart:{run_id}"]

    handler = etcd_rdzv.create_handler(params)
    try:
        (built,) = hearts()
        result = handler.next_rendezvous()
        assert (result.rank, result.world_size) == (0, 1)
        assert hearts() == [built]
        # Prepared again (as the fleet's prepare does), it starts the next join's
        # heart once: the round's own beats on.
        handler.prepare_join()
        handler.prepare_join()
        (spare,) = set(hearts()) - {built}
        assert built.is_alive()
    finally:
        handler.shutdown()
    for heart in (built, spare):
        heart.join(10)
        assert not heart.is_alive()
    unjoined = etcd_rdzv.create_handler(params)
    (idle,) = hearts()
    del unjoined
    gc.collect()
    idle.join(10)
    assert not idle.is_alive(), "a dropped handler's early heart still runs"


def test_create_handler_does_not_import_torch(
    etcd_api_params: Params, torch_required: None
) -> None:
    params = etcd_api_params("no-torch", join_timeout=30)
    code = f"""
import sys
import etcd_rdzv
params = etcd_rdzv.RendezvousParameters(
    "etcd-rdzv", {params.endpoint!r}, "no-torch", 1, 1, **{params.config!r}
)
handler = etcd_rdzv.create_handler(params)
result = handler.next_rendezvous()
assert type(result).__name__ == "RendezvousResult", type(result)
handler.shutdown()
print("torch" in sys.modules)
"""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"], "create_handler imported torch"


@pytest.mark.etcd_variants("v2", "v3")
def test_a_heartbeat_is_bounded_by_heartbeat_timeout(
    etcd_api: str, etcd_key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """With etcd frozen and read_timeout=20, each beat gives up after heartbeat_timeout."""
    enable_v2 = etcd_api == "v2"
    with EtcdServer("frozen-heart", enable_v2=enable_v2) as server:
        kv = etcd_rdzv.create_client(
            server.params("hb", api=etcd_api, read_timeout=20, key_prefix=etcd_key_prefix)
        )
        key = f"{etcd_key_prefix}/hb"
        lease = kv.grant(30)
        kv.put_owned(key, "x", lease)
        caplog.set_level(logging.WARNING, logger="etcd_rdzv")
        heart = Heart(kv, "hb", interval=0.5, timeout=1.0)
        try:
            heart.keep(key, lease, required=True)
            time.sleep(1.2)  # a beat or two against a live etcd
            server.pause()
            try:
                frozen = time.monotonic()
                while time.monotonic() - frozen < 15:
                    if any("heartbeat for" in r.getMessage() for r in caplog.records):
                        break
                    time.sleep(0.05)
                waited = time.monotonic() - frozen
            finally:
                server.resume()
            failed = [r.getMessage() for r in caplog.records if "heartbeat for" in r.getMessage()]
            assert failed, "no heartbeat failed while etcd was frozen"
            # One interval plus heartbeat_timeout, with slack; read_timeout (20 s) is far off.
            assert waited < 6.0, f"a heartbeat against a frozen etcd took {waited:.1f}s"
        finally:
            heart.stop()
            kv.close()


def test_an_early_heart_beats_its_first_key_one_interval_after_its_lease_was_renewed(
    etcd_api_params: Params, etcd_key_prefix: str
) -> None:
    """A heart started when its handler was built beats its first key an interval
    after its lease's last renewal (here its grant, just before the key was handed
    over), not at the beat due from the heart's start: that one would land inside the
    rendezvous the key was just written for."""
    kv = etcd_rdzv.create_client(etcd_api_params("early-beat"))
    beats: list[float] = []
    interval = 1.0
    heart = Heart(
        kv,
        "early",
        interval=interval,
        timeout=5.0,
        on_beat=lambda: beats.append(time.monotonic()),
    )
    try:
        time.sleep(0.7 * interval)
        key = f"{etcd_key_prefix}/early-beat"
        lease = kv.grant(30)
        kv.put_owned(key, "x", lease)
        handed, renewed = time.monotonic(), lease.renewed
        heart.keep(key, lease, required=True)
        deadline = handed + 30
        while not beats and time.monotonic() < deadline:
            time.sleep(0.02)
        assert beats, "the heart never beat"
        # Never early (load only delays a beat): one interval after the lease's grant.
        assert beats[0] - renewed >= interval - 0.01, beats[0] - renewed
        assert beats[0] - handed >= 0.5 * interval, beats[0] - handed
        assert not heart.lost.is_set()
    finally:
        heart.stop()
        kv.close()


def test_shutdown_from_another_thread_ends_a_waiting_join_and_leaves_nothing(
    etcd_api_params: Params, etcd_key_prefix: str
) -> None:
    """An agent stopped while its join waits (shutdown() from a signal handler's
    thread, or the finalizer at interpreter exit): the join ends with a clear error,
    not a crash, and writes nothing after it."""
    run_id = "shut-while-joining"
    params = etcd_api_params(run_id, min_nodes=2, max_nodes=2, join_timeout=60)
    probe = etcd_rdzv.create_client(params)
    handler = etcd_rdzv.create_handler(params)
    failure: list[BaseException] = []

    def join() -> None:
        try:
            handler.next_rendezvous()
        except BaseException as exc:  # what the join ended with
            failure.append(exc)

    joiner = threading.Thread(target=join)
    joiner.start()
    try:
        for _ in range(200):
            if _join_keys(probe, etcd_key_prefix, run_id):
                break
            time.sleep(0.05)
        assert _join_keys(probe, etcd_key_prefix, run_id), "the join wrote no key"
        handler.shutdown()
        joiner.join(15)
        assert not joiner.is_alive(), "the join went on after shutdown()"
        assert len(failure) == 1 and isinstance(failure[0], etcd_rdzv.RendezvousError)
        assert "shut down while it joined" in str(failure[0]), failure[0]
        assert _join_keys(probe, etcd_key_prefix, run_id) == []
        records, _ = probe.list_tree(_keys.rdzv_dir(etcd_key_prefix, run_id))
        assert not [r.key for r in records if r.key.endswith("/coord")]
        # A closed watch stream's reader thread ends when its connection does: soon.
        deadline = time.monotonic() + 10
        while _threads(run_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _threads(run_id) == []
    finally:
        handler.shutdown()
        joiner.join(15)
        probe.close()


def test_a_beat_may_take_longer_while_its_lease_has_time_left(
    etcd_api_params: Params, etcd_key_prefix: str
) -> None:
    """A loaded etcd answers late: a beat may take what its lease has left (less half a
    second), up to one interval, before it is given up (and sent again, adding to the
    load); never less than half an interval, never past the lease."""
    kv = etcd_rdzv.create_client(etcd_api_params("beat-time"))
    heart = Heart(kv, "beat-time", interval=2.0, timeout=5.0)
    try:
        now = time.monotonic()
        assert heart._beat_time(now) == 1.0  # no key yet: half an interval
        long_lease = kv.grant(30)
        kv.put_owned(f"{etcd_key_prefix}/long", "x", long_lease)
        heart.keep(f"{etcd_key_prefix}/long", long_lease)
        assert heart._beat_time(time.monotonic()) == 2.0  # 30 s left, capped
        short_lease = kv.grant(3)
        kv.put_owned(f"{etcd_key_prefix}/short", "x", short_lease)
        heart.keep(f"{etcd_key_prefix}/short", short_lease)
        # The lease with the least time left counts: 3 s - 0.5 s, capped at an interval.
        assert heart._beat_time(short_lease.renewed) == 2.0
        assert heart._beat_time(short_lease.renewed + 1.0) == pytest.approx(1.5)
        assert heart._beat_time(short_lease.renewed + 1.25) == pytest.approx(1.25)
        # At least half an interval, also with less left.
        assert heart._beat_time(short_lease.renewed + 2.5) == 1.0
    finally:
        heart.stop()
        kv.close()


def test_a_beat_that_ran_out_of_time_is_not_sent_again_at_once(
    etcd_api_params: Params, etcd_key_prefix: str
) -> None:
    """A beat that failed at once (a member gone) is tried again a quarter interval
    later; one that ran out of time (a loaded etcd) once half its lease's time left
    has passed, a whole interval once the lease ran out, each spread at random: sent
    again sooner, it only added to the load (4,096 nodes: 36 failed beats each)."""
    kv = etcd_rdzv.create_client(etcd_api_params("beat-retry"))
    heart = Heart(kv, "beat-retry", interval=2.0, timeout=5.0)
    try:
        lease = kv.grant(30)
        kv.put_owned(f"{etcd_key_prefix}/k", "x", lease)
        heart.keep(f"{etcd_key_prefix}/k", lease)
        now = time.monotonic()
        assert heart._retry_after(now, 0.1, 2.0) == 0.5  # failed at once: a quarter
        left = lease.renewed + lease.ttl - now  # about 30 s: capped at one interval
        for _ in range(50):
            assert 1.0 <= heart._retry_after(now, 1.9, 2.0) <= 2.0
        late = lease.renewed + lease.ttl - 2.0  # 2 s left: half of it, 0.5-1x
        for _ in range(50):
            assert 0.5 <= heart._retry_after(late, 1.9, 2.0) <= 1.0
        spent = lease.renewed + lease.ttl + 1.0  # ran out: a whole interval, 0.5-1x
        pauses = [heart._retry_after(spent, 1.9, 2.0) for _ in range(50)]
        assert all(1.0 <= p <= 2.0 for p in pauses) and len(set(pauses)) > 1, pauses
        assert left > 2.0
    finally:
        heart.stop()
        kv.close()


def test_a_join_that_tries_again_after_failed_requests_keeps_its_key_alive(
    etcd_api_params: Params, etcd_key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that fails while a node waits in a round (a loaded etcd answering
    late, a member gone) makes the join pause and try again; all the while its heart
    renews the node's key, so the key never lapses, even when the pauses add up past
    its TTL (2 s here): a lapse would cost etcd a revoke, and the node a grant and a
    write, at the moment etcd is short of time. No heart is left behind either."""
    run_id = "retried"
    params = etcd_api_params(
        run_id,
        min_nodes=3,
        max_nodes=3,
        keep_alive_interval=1,
        keep_alive_max_attempt=2,
        join_timeout=60,
        read_timeout=5,
    )
    probe = etcd_rdzv.create_client(params)
    handlers = [etcd_rdzv.create_handler(params) for _ in range(3)]
    retrying = handlers[1]
    me = retrying._session.node_id
    key = _keys.node_key(etcd_key_prefix, run_id, 1, me)
    failed: list[float] = []
    real_follow = join_module.follow

    def follow(session: Any, *args: Any, **kwargs: Any) -> Any:
        if session.node_id == me and len(failed) < 3:
            failed.append(time.monotonic())
            raise RendezvousConnectionError("etcd did not answer in time (injected)")
        return real_follow(session, *args, **kwargs)

    monkeypatch.setattr(join_module, "follow", follow)
    results: dict[int, Any] = {}

    def join(index: int) -> None:
        results[index] = handlers[index].next_rendezvous()

    threads = [threading.Thread(target=join, args=(i,), daemon=True) for i in range(3)]
    try:
        _, start = probe.get(key)
        threads[0].start()
        while not _join_keys(probe, etcd_key_prefix, run_id):
            time.sleep(0.05)
        threads[1].start()
        deadline = time.monotonic() + 30
        while len(failed) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(failed) == 3, "the join did not try again three times"
        # The premise: the pauses outlasted the key's TTL (2 s).
        time.sleep(1.0)
        assert time.monotonic() - failed[0] > 2 * 1.0 + 0.5
        threads[2].start()
        for thread in threads:
            thread.join(30)
        assert sorted(r.rank for r in results.values()) == [0, 1, 2]
        deletes, revision = [], start + 1
        while events := probe.watch_events(key, revision, 0.5):
            deletes += [e for e in events if e.kind == "delete"]
            revision = events[-1].record.revision + 1
        assert deletes == [], "the retrying node's key lapsed while its join paused"
        hearts = [t for t in _threads(run_id) if t.startswith("etcd-rdzv-heart:")]
        assert len(hearts) == 3, hearts
    finally:
        for handler in handlers:
            handler.shutdown()
        probe.close()


def test_a_node_renews_its_lease_once_half_its_ttl_has_passed(etcd_api_params: Params) -> None:
    """A renewal keeps a node alive for its whole TTL, so the heart renews once half
    of it has passed, not every ``keep_alive_interval`` where that is shorter: with an
    interval of 1 s and 4 attempts (a TTL of 4 s), every 2 s. The node stays alive
    (its key is there) the whole time."""
    run_id = "pace"
    params = etcd_api_params(run_id, keep_alive_interval=1, keep_alive_max_attempt=4)
    handler = etcd_rdzv.create_handler(params)
    kv = handler._session.kv
    renewals: list[float] = []
    keep_alive = kv.keep_alive

    def counted(lease: Any) -> Any:
        renewals.append(time.monotonic())
        return keep_alive(lease)

    kv.keep_alive = counted  # type: ignore[method-assign]
    try:
        result = handler.next_rendezvous()
        assert (result.rank, result.world_size) == (0, 1)
        time.sleep(9.0)
        gaps = [b - a for a, b in itertools.pairwise(renewals)]
        # Every 1 s (the interval) would be 8-9 renewals; every 2 s, 4-5.
        assert 3 <= len(renewals) <= 5, renewals
        assert all(gap >= 1.9 for gap in gaps), gaps
        heart = handler._session.heart
        assert heart is not None and not heart.lost.is_set(), "the node's key lapsed"
        assert handler.num_nodes_waiting() == 0
    finally:
        handler.shutdown()


@pytest.mark.etcd_variants("v3", "v3-3.4")
def test_a_key_put_on_an_older_lease_is_beaten_when_the_lease_is_due(
    etcd_api_params: Params, etcd_key_prefix: str
) -> None:
    """A key put on a lease renewed a while ago: the heart renews the lease an
    interval after that renewal, not an interval after it got the key (which, with a
    beat every half TTL, could come after the lease ran out)."""
    kv = etcd_rdzv.create_client(etcd_api_params("late-beat"))
    beats: list[float] = []
    interval = 2.0
    heart = Heart(
        kv, "late", interval=interval, timeout=5.0, on_beat=lambda: beats.append(time.monotonic())
    )
    try:
        lease = kv.grant(30)
        time.sleep(0.75 * interval)
        key = f"{etcd_key_prefix}/late-beat"
        kv.put_owned(key, "x", lease)
        handed = time.monotonic()
        heart.keep(key, lease, required=True)
        deadline = handed + 30
        while not beats and time.monotonic() < deadline:
            time.sleep(0.02)
        assert beats, "the heart never beat"
        # Due at the grant + 2 s: about 0.5 s after the key came, not 2 s.
        assert beats[0] - handed < 0.6 * interval, beats[0] - handed
        assert not heart.lost.is_set()
    finally:
        heart.stop()
        kv.close()
