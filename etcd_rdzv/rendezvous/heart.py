"""The liveness owner: keeps a node's keys alive while it takes part in a round.

A node is alive for the others exactly as long as its join key exists in etcd: the
key is on the node's lease (:class:`~etcd_rdzv._kv.Lease`), and :class:`Heart` renews
that lease every ``interval`` seconds from a named daemon thread: one request per beat
on v3, whatever the number of keys (v2 refreshes each key's TTL). The thread waits on
an Event, so :meth:`Heart.stop` is immediate.

The heart holds its owner (the handler) only weakly: its callbacks are kept as weak
methods, so a handler that is dropped without ``shutdown()`` is garbage-collected, and
its ``weakref.finalize`` stops this thread and deletes the node's keys.
"""

from __future__ import annotations

import inspect
import logging
import random
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from .._kv import KV, Lease
from ..errors import RendezvousConnectionError

__all__ = ["Heart"]

log = logging.getLogger(__name__)

#: Seconds of a lease's time left that a beat leaves unused: its answer has to come
#: back, and the lease's time is counted from when its last renewal was sent.
_MARGIN = 0.5


def _weakly(fn: Callable[..., Any] | None) -> Callable[[], Callable[..., Any] | None]:
    """A getter for ``fn`` that does not keep a bound method's object alive."""
    if fn is None:
        return lambda: None
    if inspect.ismethod(fn):
        return weakref.WeakMethod(fn)
    return lambda: fn


class Heart:
    """Renews the lease of this node's liveness keys every ``interval`` seconds.

    A key found gone (this node missed its beats, e.g. it was paused) is handed to its
    ``on_gone`` callback, which may write it again (and returns whether it did);
    otherwise the key is dropped, and for a ``required`` key :attr:`lost` is set.
    Each beat's requests together take at most ``timeout`` seconds, whatever etcd
    does, so a slow etcd cannot stretch a beat past the keys' TTL. No exception ends
    the thread: each is logged and the next beat tries again.
    """

    def __init__(
        self,
        kv: KV,
        name: str,
        interval: float,
        timeout: float,
        on_beat: Callable[[], None] | None = None,
    ) -> None:
        self._kv, self._interval, self._timeout = kv, interval, timeout
        self._on_beat = _weakly(on_beat)
        self._keys: dict[str, tuple[Lease, Callable[[], Callable[..., Any] | None], bool]] = {}
        self._deletes: set[str] = set()
        self._regone: set[str] = set()  # gone keys whose on_gone failed: again next beat
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.lost = threading.Event()
        self._due = time.monotonic() + interval  # of the next beat
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-rdzv-heart:{name}", daemon=True
        )
        self._thread.start()

    def keep(
        self,
        key: str,
        lease: Lease,
        on_gone: Callable[[str], bool] | None = None,
        required: bool = False,
    ) -> None:
        """Renew ``lease``, which ``key`` is on, from the next beat on, and watch over
        ``key``: ``on_gone(key)`` (held weakly) is called if the key is found gone.

        The lease is renewed ``interval`` seconds after its last renewal (or grant),
        not at the beat that a heart started earlier (when its handler was built) has
        due: that one could land inside the rendezvous the key was just written for,
        and a later one could come after the lease ran out. (Nodes that joined
        together are spread by their joins; an earlier first beat, to spread them
        more, measured slower: it put a beat of every node inside the round.)"""
        with self._lock:
            due = lease.renewed + self._interval
            if not self._keys and not self._deletes:
                self._due = due
            else:
                self._due = min(self._due, due)
            self._keys[key] = (lease, _weakly(on_gone), required)
        self._wake.set()

    def drop(self, key: str) -> None:
        """Stop watching over ``key``; it is no longer on the node's lease (the
        caller deletes it, or writes it without the lease)."""
        with self._lock:
            held = self._keys.pop(key, None)
        if held is not None:
            held[0].forget(key)

    def delete_later(self, key: str) -> None:
        """Stop watching over ``key`` and delete it at the next beats until that
        works (for a key that must go now)."""
        self.drop(key)
        with self._lock:
            self._deletes.add(key)

    def _gone(
        self, key: str, on_gone: Callable[[], Callable[..., Any] | None], required: bool
    ) -> None:
        with self._lock:
            if key not in self._keys:  # dropped meanwhile: nothing lost
                return
        callback = on_gone()
        if callback is not None and callback(key):
            return
        log.warning("key %s expired: this node missed its heartbeats", key)
        self.drop(key)
        if required:
            self.lost.set()

    def _run(self) -> None:
        while True:
            with self._lock:
                wait = self._due - time.monotonic()
            if wait > 0:
                self._wake.wait(wait)  # the beat is due, or a key moved it (keep)
                self._wake.clear()
                if self._stop.is_set():
                    return
                continue
            if self._stop.is_set():
                return
            with self._lock:
                started = time.monotonic()
                if started < self._due:  # a first key moved the beat (keep)
                    continue
            renewed = False
            allowed = self._beat_time(started)
            try:
                with self._kv.bounded(started + allowed):
                    renewed = self._beat_all()
            except Exception:
                # Never end silently: the next beat tries again.
                log.warning("heartbeat failed", exc_info=True)
            ended = time.monotonic()
            pause = (
                self._interval if renewed else self._retry_after(ended, ended - started, allowed)
            )
            with self._lock:
                self._due = max(self._due, ended + pause)
            took = ended - started
            if took > self._interval:
                log.warning("heartbeat took %.1fs, longer than its interval", took)

    def _retry_after(self, now: float, took: float, allowed: float) -> float:
        """Seconds from ``now`` to the next try of a beat that failed after ``took``
        seconds of the ``allowed``.

        One that failed at once (a member gone: another may answer) is tried again a
        quarter interval later: the lease lasts keep_alive_max_attempt intervals (2 at
        least), and must not run out on one failed beat. One that ran out of time met
        a loaded etcd or a process short of CPU, where a renewal sent again soon only
        adds to the load while the first is still being served (measured: 4,096
        nodes on one machine retried every 2 s, 36 failed beats per node, and the
        round failed): it is tried again once half the time its leases have left has
        passed, between a quarter and a whole interval, and a whole one once they ran
        out (the key is then written again when etcd answers). Both spread at random
        (0.5-1 times), so that nodes that failed together do not try together.
        """
        if took < allowed / 2:
            return self._interval / 4
        left = self._time_left(now)
        pause = (
            self._interval if left <= 0 else min(self._interval, max(self._interval / 4, left / 2))
        )
        return pause * random.uniform(0.5, 1.0)

    def _time_left(self, now: float) -> float:
        """Seconds from ``now`` until the first of the kept keys' leases runs out (by
        this node's count from its last renewal); 0 with none."""
        with self._lock:
            leases = [held[0] for held in self._keys.values()]
        return min((lease.renewed + lease.ttl - now for lease in leases), default=0.0)

    def _beat_time(self, now: float) -> float:
        """How long the beat starting ``now`` may take: half an interval (or
        heartbeat_timeout), or, where longer, what the leases have left less
        :data:`_MARGIN`, up to one interval. A slow etcd must not make a beat outlast
        the lease it renews; a loaded one answers late, and a beat given up early is
        only sent again, to an etcd already behind; on v2 each one given up also
        closes its connection, so the next one connects again. Measured at 4,096
        nodes on v2, with half of what the leases had left: 7 new connections per
        node in 80 s, nearly all of them the heart's (its beats given up after
        2.25 s), and etcd's listeners falling behind on accepting them."""
        short = min(self._timeout, self._interval / 2)
        left = self._time_left(now)
        return max(short, min(left - _MARGIN, self._interval))

    def _beat_all(self) -> bool:
        """One beat; whether every lease was renewed."""
        renewed = True
        with self._lock:
            keys = list(self._keys.items())
            deletes = list(self._deletes)
        for key in deletes:
            try:
                self._kv.delete(key)
            except RendezvousConnectionError as exc:
                log.warning("deleting %s failed (trying again): %s", key, exc)
            else:
                with self._lock:
                    self._deletes.discard(key)
        leases = {id(held[0]): held[0] for _, held in keys}
        with self._lock:
            gone, self._regone = self._regone, set()
        for lease in leases.values():
            if self._stop.is_set():
                return renewed
            try:
                gone.update(self._kv.keep_alive(lease))
            except RendezvousConnectionError as exc:
                log.warning("heartbeat for %r failed: %s", lease, exc)
                renewed = False
        for key, (_, on_gone, required) in keys:
            if key in gone and not self._stop.is_set():
                try:
                    self._gone(key, on_gone, required)
                except RendezvousConnectionError as exc:
                    log.warning("writing %s again failed (trying again): %s", key, exc)
                    with self._lock:
                        self._regone.add(key)
        on_beat = self._on_beat()
        if on_beat is not None:
            try:
                on_beat()
            except RendezvousConnectionError as exc:
                log.warning("refreshing the round's keys failed: %s", exc)
        return renewed

    def stop(self) -> None:
        """Stop beating (at once; a beat under way ends with its current request)."""
        self._stop.set()
        self._wake.set()
