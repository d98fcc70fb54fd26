"""Our own rendezvous handler, with torch's ``RendezvousHandler`` interface.

How a round forms (keys in :mod:`etcd_rdzv._keys`):

* each node writes its **own** join key ``rdzv/r<N>/nodes/<node>`` with a TTL and keeps
  it alive with heartbeats: no key that every node must win a compare-and-set on;
* one node per round, the **coordinator**, holds ``rdzv/r<N>/coord`` (create-if-absent,
  with the TTL of a join key). Only it follows the membership: it lists the ``rdzv``
  directory once, then applies etcd's watch events to that picture and re-decides
  after each (:func:`etcd_rdzv._decisions.decide`, a pure function);
* every other node, a **follower**, watches nothing but the coordinator key. When the
  round is complete (``max_nodes`` joined, or ``min_nodes`` plus the last call) the
  coordinator creates ``rdzv/r<N>/result`` (create-if-absent: exactly one write wins),
  listing the members in rank order, then *announces* it by writing the result into
  its coordinator key and deleting that key; every follower adopts it from the event
  (:func:`etcd_rdzv._decisions.follow`). Closing is announced the same way;
* a coordinator that dies lets its key expire; followers see the expiry, read the
  result (the coordinator may have finished), and otherwise one of them takes over;
* a node that is not in the result joins round ``N+1`` and *waits*: members see it
  through :meth:`EtcdRendezvousHandler.num_nodes_waiting`. Round ``N+1`` forms only
  after every member of round ``N`` left it (re-joined or died), so two groups never
  run side by side;
* after completion members keep heartbeating; a member whose key expires (it died)
  makes ``num_nodes_waiting()`` positive on the others, so their agent re-rendezvouses.

So a round of N nodes costs O(N) etcd requests in all: a follower makes a constant
number (read the round hint, write its key, try the coordinator key, one watch), the
coordinator one watch request per membership change.

State is JSON. Liveness is etcd's TTL, never a wall clock compared across hosts.
"""

from __future__ import annotations

import json
import logging
import random
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from . import _decisions as D
from . import _keys
from ._kv import KV, Event, Record, WatchCompacted, Watcher
from .errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from .params import ParamsLike, int_option
from .store import EtcdStore

__all__ = ["EtcdRendezvousHandler", "HandlerSettings", "RendezvousResult"]

log = logging.getLogger(__name__)

HANDLER_NAME = "etcd-rdzv"
_META_TTL = 7200  # seconds: result, hint and closed keys outlive a dead run by this much
_META_REFRESH = 600.0  # seconds between refreshes of the current result by rank 0
_IDLE_WATCH = 30.0  # seconds one idle watch request of the member watcher lasts
_CATCH_UP = 4  # changes waiting behind a watch event above which the coordinator re-lists
_OUTAGE_BACKOFF = 0.5  # seconds before a join retries after an etcd request failed ...
_OUTAGE_BACKOFF_MAX = 4.0  # ... doubling up to this (with jitter), until join_timeout
_WATCH_SPREAD = 1.0  # seconds over which the members' watchers of a new round start


@dataclass(frozen=True)
class HandlerSettings:
    """Validated handler options (seconds). Build with :meth:`from_params`."""

    run_id: str
    min_nodes: int
    max_nodes: int
    key_prefix: str
    join_timeout: int = 600
    last_call_timeout: int = 30
    close_timeout: int = 30
    heartbeat_timeout: int = 5
    keep_alive_interval: int = 5
    keep_alive_max_attempt: int = 3

    @property
    def node_ttl(self) -> int:
        """Seconds a node's key lives without a heartbeat: then it counts as dead."""
        return self.keep_alive_interval * self.keep_alive_max_attempt

    @classmethod
    def from_params(cls, params: ParamsLike, key_prefix: str) -> HandlerSettings:
        """Raises ValueError naming the option and value; no network I/O."""
        _keys.run_dir(key_prefix, params.run_id)  # validates the run id
        if params.min_nodes < 1 or params.max_nodes < params.min_nodes:
            raise ValueError(
                f"Need 1 <= min_nodes <= max_nodes, got min_nodes={params.min_nodes!r}, "
                f"max_nodes={params.max_nodes!r}."
            )
        return cls(
            run_id=params.run_id,
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            key_prefix=key_prefix,
            join_timeout=int_option(params, "join_timeout", 600, 1),
            last_call_timeout=int_option(params, "last_call_timeout", 30, 0),
            close_timeout=int_option(params, "close_timeout", 30, 1),
            heartbeat_timeout=int_option(params, "heartbeat_timeout", 5, 1),
            keep_alive_interval=int_option(params, "keep_alive_interval", 5, 1),
            keep_alive_max_attempt=int_option(params, "keep_alive_max_attempt", 3, 1),
        )


@dataclass(frozen=True)
class RendezvousResult:
    """What :meth:`EtcdRendezvousHandler.next_rendezvous` returns without torch."""

    rank: int
    world_size: int
    store: EtcdStore
    round: int
    members: tuple[str, ...]  # node ids in rank order
    addrs: tuple[str, ...]  # their addresses, in rank order


@dataclass(frozen=True)
class _Outcome:
    """A completed round as the result key holds it."""

    members: tuple[str, ...]  # node ids in rank order
    addrs: tuple[str, ...]  # their addresses, in rank order
    as_of: int | None  # the etcd revision the coordinator decided at


class _Heart:
    """Keeps this node's liveness keys alive: refreshes their TTL every ``interval`` s.

    Runs in a named daemon thread that waits on an Event, so :meth:`stop` is
    immediate. A key found gone (this node missed its beats, e.g. it was paused) is
    handed to its ``on_gone`` callback, which may write it again (and returns whether
    it did); otherwise the key is dropped, and for a ``required`` key :attr:`lost` is
    set.
    """

    def __init__(
        self, kv: KV, name: str, ttl: int, interval: float, on_beat: Callable[[], None]
    ) -> None:
        self._kv, self._ttl, self._interval = kv, ttl, interval
        self._on_beat = on_beat
        self._keys: dict[str, tuple[Callable[[], bool] | None, bool]] = {}
        self._deletes: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.lost = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-rdzv-heart:{name}", daemon=True
        )
        self._thread.start()

    def keep(
        self, key: str, on_gone: Callable[[], bool] | None = None, required: bool = False
    ) -> None:
        """Refresh ``key`` from the next beat on."""
        with self._lock:
            self._keys[key] = (on_gone, required)

    def drop(self, key: str) -> None:
        """Stop refreshing ``key`` (it expires ``ttl`` seconds after its last beat)."""
        with self._lock:
            self._keys.pop(key, None)

    def delete_later(self, key: str) -> None:
        """Stop refreshing ``key`` and delete it at the next beats until that works
        (for a key that must go now, not when it expires)."""
        with self._lock:
            self._keys.pop(key, None)
            self._deletes.add(key)

    def _beat(self, key: str, on_gone: Callable[[], bool] | None, required: bool) -> None:
        if self._kv.refresh(key, self._ttl):
            return
        with self._lock:
            if key not in self._keys:  # dropped meanwhile: nothing lost
                return
        if on_gone is not None and on_gone():
            return
        log.warning("key %s expired: this node missed its heartbeats", key)
        self.drop(key)
        if required:
            self.lost.set()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            started = time.monotonic()
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
            for key, (on_gone, required) in keys:
                if self._stop.is_set():
                    return
                try:
                    self._beat(key, on_gone, required)
                except RendezvousConnectionError as exc:
                    log.warning("heartbeat for %s failed: %s", key, exc)
            try:
                self._on_beat()
            except RendezvousConnectionError as exc:
                log.warning("refreshing the round's keys failed: %s", exc)
            took = time.monotonic() - started
            if took > self._interval:
                log.warning("heartbeat took %.1fs, longer than its interval", took)

    def stop(self) -> None:
        self._stop.set()


def _under(key: str, gone: str) -> bool:
    """Whether deleting ``gone`` (a key or a directory) removed ``key``."""
    return key == gone or key.startswith(gone + "/")


class _RoundView:
    """The coordinator's picture of its round: one listing, then watch events.

    Holds the round's live join keys (parsed), the previous round's live join keys,
    the round's result and coordinator keys and the closed marker. No I/O.
    """

    def __init__(self, rdzv: str, round_no: int) -> None:
        self._rdzv = rdzv
        self._round = round_no
        self.nodes: dict[str, D.Participant] = {}
        self.prev: set[str] = set()
        self.closed = False
        self.result: Record | None = None
        self.coord: Record | None = None

    def load(self, records: Iterable[Record]) -> None:
        self.nodes, self.prev, self.closed = {}, set(), False
        self.result = self.coord = None
        for record in records:
            self._put(record)

    def apply(self, event: Event) -> None:
        if event.kind == "put":
            self._put(event.record)
        else:
            self._delete(event.record.key)

    def _put(self, record: Record) -> None:
        if record.key == self._rdzv + "/closed":
            self.closed = True
            return
        where = _keys.round_of(self._rdzv, record.key)
        if where is None:
            return
        rnd, rest = where
        if rnd == self._round:
            if rest.startswith("nodes/"):
                self.nodes[record.key] = _parse_node(record)
            elif rest == "result":
                self.result = record
            elif rest == "coord":
                self.coord = record
        elif rnd == self._round - 1 and rest.startswith("nodes/"):
            self.prev.add(record.key)

    def _delete(self, gone: str) -> None:
        if self.nodes.pop(gone, None) is not None:
            return
        if gone in self.prev:
            self.prev.discard(gone)
            return
        # Anything else: a key we do not track, or a directory with all under it.
        self.nodes = {k: p for k, p in self.nodes.items() if not _under(k, gone)}
        self.prev = {k for k in self.prev if not _under(k, gone)}
        if _under(self._rdzv + "/closed", gone):
            self.closed = False
        if self.result is not None and _under(self.result.key, gone):
            self.result = None
        if self.coord is not None and _under(self.coord.key, gone):
            self.coord = None

    def coordinator(self) -> str | None:
        """The node id the coordinator key names, if it exists."""
        return None if self.coord is None else _coordinator_of(self.coord)


class _MemberWatch:
    """After completion: watches the run and keeps the counts ``num_nodes_waiting`` needs.

    Counts nodes waiting in later rounds and members of this round whose key is gone
    (dead). It starts from the revision the round was decided at, so no death after
    the decision is missed, and keeps its counts from watch events alone (it lists
    the directory only if etcd's history no longer reaches back that far). Idle, it
    costs one watch request per ``_IDLE_WATCH`` seconds.
    """

    def __init__(
        self,
        handler: EtcdRendezvousHandler,
        round_no: int,
        members: tuple[str, ...],
        as_of: int | None,
    ):
        self._h = handler
        self._round = round_no
        self._members = {_keys.b64_key(m) for m in members}
        self._nodes_dir = f"{handler._rdzv}/r{round_no}/nodes"
        self._as_of = as_of
        self._gone: set[str] = set()  # members whose key is gone
        self._later: set[str] = set()  # join keys in later rounds
        self._stop = threading.Event()
        self.waiting = 0
        self.missing = 0
        self.closed = False
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-rdzv-watch:{handler.get_run_id()}:{round_no}", daemon=True
        )
        self._thread.start()

    def _node(self, key: str) -> tuple[int, str] | None:
        where = _keys.round_of(self._h._rdzv, key)
        if where is None or not where[1].startswith("nodes/"):
            return None
        return where[0], where[1][len("nodes/") :]

    def _load(self, records: list[Record]) -> None:
        alive: set[str] = set()
        later: set[str] = set()
        closed = False
        for r in records:
            if r.key == self._h._rdzv + "/closed":
                closed = True
            where = self._node(r.key)
            if where is None:
                continue
            if where[0] == self._round:
                alive.add(where[1])
            elif where[0] > self._round:
                later.add(r.key)
        self._gone, self._later, self.closed = self._members - alive, later, closed

    def _apply(self, event: Event) -> None:
        key, put = event.record.key, event.kind == "put"
        if key == self._h._rdzv + "/closed":
            self.closed = put
            return
        where = self._node(key)
        if where is not None:
            if where[0] == self._round and where[1] in self._members:
                if put:
                    self._gone.discard(where[1])
                else:
                    self._gone.add(where[1])
            elif where[0] > self._round:
                if put:
                    self._later.add(key)
                else:
                    self._later.discard(key)
        elif not put:  # maybe a directory, with everything under it
            self._later = {k for k in self._later if not _under(k, key)}
            if _under(self._nodes_dir, key):
                self._gone = set(self._members)

    def _publish(self) -> None:
        waiting, missing = len(self._later), len(self._gone)
        if (waiting, missing) != (self.waiting, self.missing) and (waiting or missing):
            log.info(
                "run %s round %d: %d node(s) waiting, %d member(s) gone",
                self._h.get_run_id(),
                self._round,
                waiting,
                missing,
            )
        self.waiting, self.missing = waiting, missing

    def _run(self) -> None:
        kv, rdzv = self._h._kv, self._h._rdzv
        revision = self._as_of
        # Every member starts its watcher at the same moment, and each first catches up
        # with the few changes since the decision: spread them so that they do not
        # compete with the round's last announcements.
        spread = min(_WATCH_SPREAD, self._h.settings.keep_alive_interval / 2)
        if self._stop.wait(random.uniform(0.0, spread)):
            return
        while not self._stop.is_set():
            try:
                if revision is None:
                    records, revision = kv.list_tree(rdzv)
                    self._load(records)
                    self._publish()
                for event in kv.watch_events(rdzv, revision + 1, _IDLE_WATCH, prefix=True):
                    self._apply(event)
                    revision = max(revision, event.record.revision)
                self._publish()
            except WatchCompacted:
                revision = None
            except (RendezvousConnectionError, RendezvousStateError) as exc:
                if self._stop.is_set():
                    return
                log.warning("run %s: watching members failed: %s", self._h.get_run_id(), exc)
                if self._stop.wait(1.0):
                    return

    def stop(self) -> None:
        self._stop.set()


class EtcdRendezvousHandler:
    """The native etcd rendezvous handler (backend name ``etcd-rdzv``).

    Build it with :func:`etcd_rdzv.create_handler`. Thread-safe for the agent's use:
    one thread calls :meth:`next_rendezvous`, others may call the rest.
    """

    def __init__(
        self,
        kv: KV,
        settings: HandlerSettings,
        store_factory: Callable[[str], EtcdStore],
        local_addr: str | None = None,
        node_id: str | None = None,
        close_on_shutdown: bool = False,
    ) -> None:
        #: Whether :meth:`shutdown` also closes the run (torchrun's entry point sets it).
        self.close_on_shutdown = close_on_shutdown
        self._kv = kv
        self._s = settings
        self._store_factory = store_factory
        self._addr = local_addr or socket.getfqdn()
        self._id = node_id or f"{socket.gethostname()}_{uuid.uuid4().hex[:12]}"
        self._rdzv = _keys.rdzv_dir(settings.key_prefix, settings.run_id)
        self._lock = threading.Lock()
        self._round = 0  # the last round this node joined (0: none)
        self._rank: int | None = None
        self._key: str | None = None  # this node's join key
        self._coord: str | None = None  # the coordinator key, while this node holds it
        self._joined = False  # whether the round of self._key completed with this node
        self._heart: _Heart | None = None
        self._watch: _MemberWatch | None = None
        self._last_meta_refresh = 0.0
        self._outcome: _Outcome | None = None
        # Stops the heartbeat and watcher threads if the handler is dropped unclosed.
        self._finalizer: weakref.finalize[Any, Any] | None = None

    # -- small accessors ----------------------------------------------------------------

    def get_backend(self) -> str:
        """``etcd-rdzv``: the name torchrun knows this handler by."""
        return HANDLER_NAME

    def get_run_id(self) -> str:
        return self._s.run_id

    @property
    def node_id(self) -> str:
        return self._id

    @property
    def settings(self) -> HandlerSettings:
        return self._s

    @property
    def use_agent_store(self) -> bool:
        """False: workers bootstrap from ``MASTER_ADDR``/``MASTER_PORT`` set by rank 0."""
        return False

    # -- closing ------------------------------------------------------------------------

    def is_closed(self) -> bool:
        """Whether :meth:`set_closed` was called for this run (by any node)."""
        record, _ = self._kv.get(_keys.closed_key(self._s.key_prefix, self._s.run_id))
        return record is not None

    def set_closed(self) -> None:
        """Close the run: every later join fails with RendezvousClosedError."""
        self._kv.put(_keys.closed_key(self._s.key_prefix, self._s.run_id), "1", _META_TTL)
        log.info("run %s closed by node %s", self._s.run_id, self._id)

    # -- membership signals -------------------------------------------------------------

    def num_nodes_waiting(self) -> int:
        """Nodes that want in (waiting for the next round), plus members of the current
        round that died; non-zero means the agent should re-rendezvous. No etcd request:
        a watcher thread keeps the counts."""
        watch, heart = self._watch, self._heart
        if watch is None:
            return 0
        lost = 1 if heart is not None and heart.lost.is_set() else 0
        return watch.waiting + watch.missing + lost

    # -- the join ----------------------------------------------------------------------

    def next_rendezvous(self) -> Any:
        """Join the next round and block until it completes.

        Returns:
            :class:`RendezvousResult` (with torch: torch's ``RendezvousInfo``).

        Raises:
            RendezvousClosedError: the run is closed.
            RendezvousTimeoutError: the round did not complete within ``join_timeout``.
            RendezvousConnectionError: etcd could not be reached.
        """
        with self._lock:
            return self._join()

    def _leave_round(self) -> None:
        self._stop_threads([self._heart, self._watch])
        self._heart = self._watch = None
        self._joined = False
        for attr in ("_coord", "_key"):
            key = getattr(self, attr)
            if key is None:
                continue
            try:
                self._kv.delete(key)
            except RendezvousConnectionError as exc:  # it expires by itself
                log.warning("could not delete %s: %s", key, exc)
            setattr(self, attr, None)

    @staticmethod
    def _stop_threads(things: list[Any]) -> None:
        for thing in things:
            if thing is not None:
                thing.stop()

    def _join(self) -> RendezvousResult:
        s = self._s
        started = time.monotonic()
        deadline = started + s.join_timeout
        self._leave_round()
        prev_rank = self._rank
        round_no: int | None = None
        pause = _OUTAGE_BACKOFF
        try:
            while True:
                try:
                    if round_no is None:
                        hint_record, _ = self._kv.get(_keys.hint_key(s.key_prefix, s.run_id))
                        hint = _int_or(hint_record.value if hint_record else None, 1)
                        round_no = max(hint, self._round + 1)
                        log.info("run %s: node %s joins round %d", s.run_id, self._id, round_no)
                    action = self._join_round(round_no, prev_rank, deadline)
                except RendezvousConnectionError as exc:
                    # etcd failed a request (no endpoint answered, or no leader in
                    # time): ride the outage out within join_timeout, in the same
                    # round, keeping this node's keys (they are written again).
                    wait = pause * (1 + random.random())
                    if time.monotonic() + wait >= deadline:
                        raise
                    log.warning(
                        "run %s: node %s: etcd request failed while joining round %s; "
                        "trying again in %.1fs: %s",
                        s.run_id,
                        self._id,
                        round_no if round_no is not None else "?",
                        wait,
                        exc,
                    )
                    self._stop_threads([self._heart])
                    self._heart = None
                    time.sleep(wait)
                    pause = min(pause * 2, _OUTAGE_BACKOFF_MAX)
                    continue
                if isinstance(action, D.Joined):
                    outcome = action
                    break
                round_no += 1
        except BaseException:
            # A node that gave up must not stay in the round: a coordinator would count
            # it, and the round could complete with a member that never takes its rank.
            self._leave_round()
            raise
        self._round, self._rank, self._joined = round_no, outcome.rank, True
        result = self._outcome
        assert result is not None
        store = self._store_factory(f"{_keys.store_dir(s.key_prefix, s.run_id)}/r{round_no}")
        self._watch = _MemberWatch(self, round_no, outcome.members, result.as_of)
        if self._finalizer is not None:
            self._finalizer.detach()
        self._finalizer = weakref.finalize(
            self, EtcdRendezvousHandler._stop_threads, [self._heart, self._watch]
        )
        log.info(
            "run %s round %d complete: node %s is rank %d of %d (%.2fs)",
            s.run_id,
            round_no,
            self._id,
            outcome.rank,
            outcome.world_size,
            time.monotonic() - started,
        )
        return RendezvousResult(
            outcome.rank, outcome.world_size, store, round_no, outcome.members, result.addrs
        )

    def _join_round(self, round_no: int, prev_rank: int | None, deadline: float) -> D.Action:
        """Write this node's key in ``round_no``, coordinate or follow the round to its
        outcome: Joined or NextRound (others raise)."""
        s = self._s
        key = _keys.node_key(s.key_prefix, s.run_id, round_no, self._id)
        coord = _keys.coord_key(s.key_prefix, s.run_id, round_no)
        value = json.dumps({"id": self._id, "addr": self._addr, "prev_rank": prev_rank})
        participants: int | None = None  # as the coordinator last saw them
        # Most nodes find a coordinator already there: a read tells them so without the
        # consensus write a refused create would cost (on v3 the read goes with the
        # write of the join key, in one transaction). After a TakeOver, claim at once.
        # The watcher of the coordinator key starts with that read: a follower misses
        # nothing the coordinator writes after it.
        self._key, self._joined = key, False  # deleted when the node leaves, from here
        with self._kv.watcher(coord) as watcher:
            (_, holder), _ = watcher.reread(
                lambda: self._kv.put_owned_and_get(key, value, s.node_ttl, coord)
            )
            name = f"{s.run_id}:{round_no}"
            heart = _Heart(self._kv, name, s.node_ttl, s.keep_alive_interval, self._refresh_meta)
            self._heart = heart
            heart.keep(key, on_gone=lambda: self._write_again(key, value), required=True)
            while True:
                action, participants = self._play(
                    round_no, deadline, key, value, watcher, holder, participants
                )
                holder = None
                log.debug("run %s round %d node %s: %s", s.run_id, round_no, self._id, action)
                if not isinstance(action, D.TakeOver):
                    break
                # TakeOver: nobody coordinates (any more); try to.
        if isinstance(action, D.Joined):
            return action
        if isinstance(action, D.NextRound):
            self._leave_round()
            return action
        if isinstance(action, D.Closed):
            self._leave_round()
            raise RendezvousClosedError(f"The rendezvous of run {s.run_id!r} is closed.")
        assert isinstance(action, D.TimedOut), action
        self._leave_round()
        joined = "" if participants is None else f" ({participants} node(s) joined)"
        raise RendezvousTimeoutError(
            f"Run {s.run_id!r}: round {round_no} did not complete within "
            f"join_timeout={s.join_timeout}s{joined}; min_nodes={s.min_nodes}."
        )

    def _play(
        self,
        round_no: int,
        deadline: float,
        key: str,
        value: str,
        watcher: Watcher,
        holder: Record | None,
        participants: int | None,
    ) -> tuple[D.Action, int | None]:
        """Coordinate the round if this node gets (or still holds) the coordinator key,
        else follow it. Returns the action and the participants the coordinator saw."""
        s = self._s
        coord = watcher.key
        mine: Record | None = None
        if holder is None:
            # Beside the join key: both belong to this node's part in this round (on
            # v3 one lease, so the many refused claims of a burst grant nothing).
            mine, _ = self._kv.claim(
                coord, json.dumps({"id": self._id}), s.node_ttl, beside=self._key
            )
        elif self._coord == coord and _coordinator_of(holder) == self._id:
            mine = holder  # held before an etcd request failed: coordinate on
        if mine is None:
            return self._follow(round_no, watcher, deadline, holder), participants
        self._coord = coord
        assert self._heart is not None
        self._heart.keep(coord)
        action, participants = self._coordinate(round_no, deadline, key, value)
        return action, participants

    def _write_again(self, key: str, value: str) -> bool:
        """The heart found this node's join key gone. Before completion, write it again
        (the node rejoins the round as a new arrival); after it, report the loss."""
        if self._joined or self._key != key:
            return False
        log.warning("run %s: join key %s expired; writing it again", self._s.run_id, key)
        self._kv.put_owned(key, value, self._s.node_ttl)
        return True

    # -- the coordinator -------------------------------------------------------------

    def _coordinate(
        self, round_no: int, deadline: float, key: str, value: str
    ) -> tuple[D.Action, int]:
        """Follow the round's membership and complete it; then announce the outcome.

        Returns the action (Joined, NextRound, Closed, TimedOut, or TakeOver when this
        node lost the coordinator key) and the number of participants last seen.
        """
        with self._kv.watcher(self._rdzv, prefix=True) as watcher:
            return self._coordinate_with(round_no, deadline, key, value, watcher)

    def _coordinate_with(
        self, round_no: int, deadline: float, key: str, value: str, watcher: Watcher
    ) -> tuple[D.Action, int]:
        s = self._s
        result_key = _keys.result_key(s.key_prefix, s.run_id, round_no)
        view = _RoundView(self._rdzv, round_no)

        def relist() -> int:
            records, revision = watcher.reread(lambda: self._kv.list_tree(self._rdzv))
            view.load(records)
            return revision

        revision = relist()
        min_reached: float | None = None
        wrote_result = False
        log.info("run %s: node %s coordinates round %d", s.run_id, self._id, round_no)
        while True:
            if view.result is None and view.coordinator() != self._id:
                # Our key expired (this node was paused) or another node holds it now.
                log.warning("run %s: node %s lost the coordinator key", s.run_id, self._id)
                self._release_coord(delete=False)
                return D.TakeOver(), len(view.nodes)
            now = time.monotonic()
            min_reached = D.reached_at(min_reached, len(view.nodes), s.min_nodes, now)
            outcome = _parse_result(view.result) if view.result is not None else None
            action = D.decide(
                D.JoinView(
                    me=self._id,
                    closed=view.closed,
                    result=outcome.members if outcome is not None else None,
                    participants=tuple(view.nodes.values()),
                    prev_round_live=len(view.prev),
                    min_nodes=s.min_nodes,
                    max_nodes=s.max_nodes,
                    now=now,
                    min_reached=min_reached,
                    last_call_timeout=s.last_call_timeout,
                    deadline=deadline,
                )
            )
            if isinstance(action, D.Wait):
                try:
                    events = watcher.next(max(action.until - now, 0.0))
                except WatchCompacted:
                    revision = relist()
                    continue
                for event in events:
                    view.apply(event)
                    revision = max(revision, event.record.revision)
                latest = events[-1].current if events and watcher.polls else None
                if latest is not None and (latest == 0 or latest - revision > _CATCH_UP):
                    # Far behind (a burst of joins), or the API does not say how far:
                    # one listing beats fetching the changes one watch request at a
                    # time. (A watch stream delivers them all anyway.)
                    revision = relist()
            elif isinstance(action, D.Complete):
                addr_of = {p.node_id: p.addr for p in view.nodes.values()}
                text = json.dumps(
                    {
                        "members": list(action.members),
                        "addrs": [addr_of.get(m, "") for m in action.members],
                        "as_of": revision,
                    }
                )
                created = self._kv.create(result_key, text, _META_TTL)
                if created is not None:
                    wrote_result = True
                    view.apply(Event("put", created))
                else:  # another coordinator was faster: adopt its result
                    current, _ = self._kv.get(result_key)
                    if current is not None:
                        view.apply(Event("put", current))
            elif isinstance(action, (D.Joined, D.NextRound)):
                assert outcome is not None and view.result is not None
                self._outcome = outcome
                self._announce(round_no, {"result": json.loads(view.result.value)})
                if wrote_result:
                    self._completed(round_no, len(outcome.members))
                return action, len(view.nodes)
            elif isinstance(action, D.Rejoin):
                record = self._kv.put_owned(key, value, s.node_ttl)
                view.apply(Event("put", record))
            elif isinstance(action, D.Closed):
                self._announce(round_no, {"closed": True})
                return action, len(view.nodes)
            else:  # TimedOut: let another node (with a later deadline) take over
                self._release_coord(delete=True)
                return action, len(view.nodes)

    def _announce(self, round_no: int, message: dict[str, Any]) -> None:
        """Tell the followers the outcome: write it into the coordinator key, then
        delete the key. Only final facts are announced (a result, which is
        create-if-absent, or the closed run), so this may overwrite a key another
        coordinator just took (or delete it: the next coordinator then finds the
        result). If it fails, the heartbeat deletes the key once etcd answers again, and
        followers read the result themselves."""
        coord = self._coord or _keys.coord_key(self._s.key_prefix, self._s.run_id, round_no)
        self._release_coord(delete=False)
        try:
            self._kv.put(coord, json.dumps({"id": self._id, **message}), self._s.node_ttl)
            self._kv.delete(coord)
        except RendezvousConnectionError as exc:
            log.warning("run %s: announcing round %d failed: %s", self._s.run_id, round_no, exc)
            # Followers then read the result once the key is gone: it may share the
            # join key's lifetime (see claim), so delete it rather than wait for that.
            if self._heart is not None:
                self._heart.delete_later(coord)

    def _release_coord(self, delete: bool) -> None:
        coord, self._coord = self._coord, None
        if coord is None:
            return
        if self._heart is not None:
            self._heart.drop(coord)
        if delete:
            try:
                self._kv.delete(coord)
            except RendezvousConnectionError as exc:  # it expires by itself
                log.warning("could not delete %s: %s", coord, exc)

    # -- a follower ------------------------------------------------------------------

    def _follow(
        self, round_no: int, watcher: Watcher, deadline: float, holder: Record | None
    ) -> D.Action:
        """Wait for the coordinator's announcement, watching only its key (``holder``:
        the key as last read, if it was there). Returns the action (Joined, NextRound,
        Closed, TimedOut, or TakeOver when nobody coordinates)."""
        s = self._s
        coord = watcher.key
        coordinated = True  # the key exists (read, or our create of it was refused)
        closed, outcome = _parse_announcement(holder) if holder is not None else (False, None)
        while True:
            now = time.monotonic()
            action = D.follow(
                D.FollowView(
                    me=self._id,
                    closed=closed,
                    result=outcome.members if outcome is not None else None,
                    coordinated=coordinated,
                    now=now,
                    deadline=deadline,
                )
            )
            if not isinstance(action, D.Wait):
                if isinstance(action, (D.Joined, D.NextRound)):
                    self._outcome = outcome
                return action
            try:
                events = watcher.next(max(action.until - now, 0.0))
            except WatchCompacted:
                record, _ = watcher.reread(lambda: self._kv.get(coord))
                events = [] if record is None else [Event("put", record)]
                coordinated = record is not None
            for event in events:
                coordinated = event.kind == "put"
                if coordinated:
                    closed, announced = _parse_announcement(event.record)
                    outcome = outcome or announced
            if not coordinated and outcome is None and not closed:
                # The coordinator left or died: maybe after completing the round.
                record, _ = self._kv.get(_keys.result_key(s.key_prefix, s.run_id, round_no))
                if record is not None:
                    outcome = _parse_result(record)

    # -- the result writer's chores ----------------------------------------------------

    def _completed(self, round_no: int, size: int) -> None:
        """Advance the hint, drop round N-2's keys."""
        s = self._s
        log.info(
            "run %s: node %s completed round %d with %d member(s)",
            s.run_id,
            self._id,
            round_no,
            size,
        )
        try:
            self._kv.put(_keys.hint_key(s.key_prefix, s.run_id), str(round_no + 1), _META_TTL)
            if round_no > 2:
                self._kv.delete_prefix(_keys.round_dir(s.key_prefix, s.run_id, round_no - 2))
                self._kv.delete_prefix(f"{_keys.store_dir(s.key_prefix, s.run_id)}/r{round_no - 2}")
        except RendezvousConnectionError as exc:  # housekeeping only
            log.warning("run %s: housekeeping after round %d failed: %s", s.run_id, round_no, exc)

    def _refresh_meta(self) -> None:
        """Rank 0 keeps the round's result and the hint alive while the round runs."""
        if (
            not self._joined
            or self._rank != 0
            or time.monotonic() - self._last_meta_refresh < _META_REFRESH
        ):
            return
        s = self._s
        self._last_meta_refresh = time.monotonic()
        self._kv.refresh(_keys.result_key(s.key_prefix, s.run_id, self._round), _META_TTL)
        self._kv.refresh(_keys.hint_key(s.key_prefix, s.run_id), _META_TTL)

    # -- shutdown -----------------------------------------------------------------------

    def shutdown(self) -> bool:
        """Leave: stop heartbeats and watches and delete this node's key.

        With :attr:`close_on_shutdown` it first closes the run, as torch's own handlers
        do: torch's launcher calls ``shutdown()`` only when its agent is done (never
        when a signal killed it), and an agent that arrives later must then get
        RendezvousClosedError instead of starting the job again.
        """
        ok = True
        if self.close_on_shutdown:
            try:
                self.set_closed()
            except RendezvousConnectionError as exc:
                log.warning("run %s: node %s could not close it: %s", self._s.run_id, self._id, exc)
                ok = False
        try:
            self._leave_round()
        except RendezvousConnectionError as exc:
            log.warning("run %s: shutdown of node %s incomplete: %s", self._s.run_id, self._id, exc)
            return False
        return ok


def _coordinator_of(record: Record) -> str | None:
    """The node id a coordinator key names (None if it names none)."""
    try:
        data = json.loads(record.value)
        return str(data["id"]) if isinstance(data, dict) else None
    except (ValueError, KeyError):
        return None


def _int_or(text: str | None, default: int) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default


def _parse_node(record: Record) -> D.Participant:
    try:
        data = json.loads(record.value)
        prev = data.get("prev_rank")
        return D.Participant(
            node_id=str(data["id"]),
            addr=str(data.get("addr", "")),
            joined=record.created or record.revision,
            prev_rank=prev if isinstance(prev, int) else None,
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RendezvousStateError(
            f"The join key {record.key!r} does not hold a node record: corrupt or foreign state."
        ) from exc


def _result_of(data: Any) -> _Outcome:
    members, addrs = data["members"], data.get("addrs") or [""] * len(data["members"])
    for name, seq in (("members", members), ("addrs", addrs)):
        if not isinstance(seq, list) or not all(isinstance(m, str) for m in seq):
            raise TypeError(f"{name} is not a list of strings")
    if len(addrs) != len(members):
        raise TypeError("addrs and members differ in length")
    as_of = data.get("as_of")
    if as_of is not None and (isinstance(as_of, bool) or not isinstance(as_of, int)):
        raise TypeError("as_of is not a revision")
    return _Outcome(tuple(members), tuple(addrs), as_of)


def _parse_result(record: Record) -> _Outcome:
    """A round result: members and addresses in rank order, the decision's revision."""
    try:
        return _result_of(json.loads(record.value))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RendezvousStateError(
            f"The round result {record.key!r} is corrupt or foreign: {exc}"
        ) from exc


def _parse_announcement(record: Record) -> tuple[bool, _Outcome | None]:
    """``(closed, result)`` as a coordinator key holds them (neither while it works)."""
    try:
        data = json.loads(record.value)
        result = data.get("result")
        return data.get("closed") is True, None if result is None else _result_of(result)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RendezvousStateError(
            f"The coordinator key {record.key!r} is corrupt or foreign: {exc}"
        ) from exc
