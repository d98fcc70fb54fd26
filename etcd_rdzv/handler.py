"""Our own rendezvous handler, with torch's ``RendezvousHandler`` interface.

How a round forms (keys in :mod:`etcd_rdzv._keys`):

* each node writes its **own** join key ``rdzv/r<N>/nodes/<node>`` with a TTL and keeps
  it alive with heartbeats: no key that every node must win a compare-and-set on;
* every node watches the ``rdzv`` directory and re-decides on each change
  (:func:`etcd_rdzv._decisions.decide`, a pure function);
* when the round is complete (``max_nodes`` joined, or ``min_nodes`` plus the last
  call), one node creates ``rdzv/r<N>/result`` (create-if-absent: exactly one wins),
  listing the members in rank order; everyone adopts that list;
* a node that is not in the result joins round ``N+1`` and *waits*: members see it
  through :meth:`EtcdRendezvousHandler.num_nodes_waiting`. Round ``N+1`` forms only
  after every member of round ``N`` left it (re-joined or died), so two groups never
  run side by side;
* after completion members keep heartbeating; a member whose key expires (it died)
  makes ``num_nodes_waiting()`` positive on the others, so their agent re-rendezvouses.

State is JSON. Liveness is etcd's TTL, never a wall clock compared across hosts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from . import _decisions as D
from . import _keys
from ._kv import KV, Record, WatchCompacted
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


class _Heart:
    """Keeps one join key alive: refreshes its TTL every ``interval`` seconds.

    Runs in a named daemon thread that waits on an Event, so :meth:`stop` is
    immediate. If the key is found gone (this node missed its beats, e.g. it was
    paused), :attr:`lost` is set.
    """

    def __init__(self, kv: KV, key: str, ttl: int, interval: float, on_beat: Callable[[], None]):
        self._kv, self._key, self._ttl, self._interval = kv, key, ttl, interval
        self._on_beat = on_beat
        self._stop = threading.Event()
        self.lost = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-rdzv-heart:{key}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            started = time.monotonic()
            try:
                if not self._kv.refresh(self._key, self._ttl):
                    log.warning("join key %s expired: this node missed its heartbeats", self._key)
                    self.lost.set()
                    return
                self._on_beat()
            except RendezvousConnectionError as exc:
                log.warning("heartbeat for %s failed: %s", self._key, exc)
            took = time.monotonic() - started
            if took > self._interval:
                log.warning(
                    "heartbeat for %s took %.1fs, longer than its interval", self._key, took
                )

    def stop(self) -> None:
        self._stop.set()


class _MemberWatch:
    """After completion: watches the run and keeps the counts ``num_nodes_waiting`` needs.

    Counts nodes waiting in the next round and members of this round whose key is
    gone (dead). Idle, it costs one watch request per ``_IDLE_WATCH`` seconds.
    """

    def __init__(self, handler: EtcdRendezvousHandler, round_no: int, members: tuple[str, ...]):
        self._h = handler
        self._round = round_no
        self._members = {_keys.b64_key(m) for m in members}
        self._stop = threading.Event()
        self.waiting = 0
        self.missing = 0
        self.closed = False
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-rdzv-watch:{handler.get_run_id()}:{round_no}", daemon=True
        )
        self._thread.start()

    def _update(self, records: list[Record]) -> None:
        rdzv = self._h._rdzv
        alive: set[str] = set()
        waiting = 0
        closed = False
        for r in records:
            if r.key == rdzv + "/closed":
                closed = True
            where = _keys.round_of(rdzv, r.key)
            if where is None or not where[1].startswith("nodes/"):
                continue
            node = where[1][len("nodes/") :]
            if where[0] == self._round:
                alive.add(node)
            elif where[0] > self._round:
                waiting += 1
        self.waiting, self.closed = waiting, closed
        self.missing = len(self._members - alive)

    def _run(self) -> None:
        kv, rdzv = self._h._kv, self._h._rdzv
        revision: int | None = None
        while not self._stop.is_set():
            try:
                if revision is None:
                    records, revision = kv.list_tree(rdzv)
                    self._update(records)
                    if self.waiting or self.missing:
                        log.info(
                            "run %s round %d: %d node(s) waiting, %d member(s) gone",
                            self._h.get_run_id(),
                            self._round,
                            self.waiting,
                            self.missing,
                        )
                event = kv.watch(rdzv, revision + 1, _IDLE_WATCH, prefix=True)
                if event is not None:
                    revision = None  # re-read: simple, and events are rare here
            except WatchCompacted:
                revision = None
            except RendezvousConnectionError as exc:
                if self._stop.is_set():
                    return
                log.warning("run %s: watching members failed: %s", self._h.get_run_id(), exc)
                if self._stop.wait(1.0):
                    return
                revision = None

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
        self._key: str | None = None
        self._heart: _Heart | None = None
        self._watch: _MemberWatch | None = None
        self._last_meta_refresh = 0.0
        self._result_addrs: tuple[str, ...] = ()
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
        if self._key is not None:
            try:
                self._kv.delete(self._key)
            except RendezvousConnectionError as exc:  # it expires by itself
                log.warning("could not delete join key %s: %s", self._key, exc)
            self._key = None

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
        hint_record, _ = self._kv.get(_keys.hint_key(s.key_prefix, s.run_id))
        hint = _int_or(hint_record.value if hint_record else None, 1)
        round_no = max(hint, self._round + 1)
        prev_rank = self._rank
        log.info("run %s: node %s joins round %d", s.run_id, self._id, round_no)
        while True:
            outcome = self._join_round(round_no, prev_rank, deadline)
            if isinstance(outcome, D.NextRound):
                round_no += 1
                continue
            if isinstance(outcome, D.Rejoin):
                continue
            assert isinstance(outcome, D.Joined)
            self._round, self._rank = round_no, outcome.rank
            break
        addrs = self._result_addrs
        store = self._store_factory(f"{_keys.store_dir(s.key_prefix, s.run_id)}/r{round_no}")
        self._watch = _MemberWatch(self, round_no, outcome.members)
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
            outcome.rank, outcome.world_size, store, round_no, outcome.members, addrs
        )

    def _join_round(self, round_no: int, prev_rank: int | None, deadline: float) -> D.Action:
        """Write this node's key in ``round_no`` and follow the round to an outcome:
        Joined, NextRound or Rejoin (others raise)."""
        s = self._s
        key = _keys.node_key(s.key_prefix, s.run_id, round_no, self._id)
        value = json.dumps({"id": self._id, "addr": self._addr, "prev_rank": prev_rank})
        self._kv.put_owned(key, value, s.node_ttl)
        self._key = key
        self._heart = _Heart(self._kv, key, s.node_ttl, s.keep_alive_interval, self._refresh_meta)
        result_key = _keys.result_key(s.key_prefix, s.run_id, round_no)
        min_reached: float | None = None
        max_reached: float | None = None
        while True:
            records, revision = self._kv.list_tree(self._rdzv)
            now = time.monotonic()
            view = self._view(records, round_no, now, min_reached, max_reached, deadline)
            min_reached = D.reached_at(min_reached, len(view.participants), s.min_nodes, now)
            max_reached = D.reached_at(max_reached, len(view.participants), s.max_nodes, now)
            view = replace(view, min_reached=min_reached, max_reached=max_reached)
            action = D.decide(view)
            log.debug("run %s round %d node %s: %s", s.run_id, round_no, self._id, action)
            if isinstance(action, D.Wait):
                with contextlib.suppress(WatchCompacted):
                    self._kv.watch(
                        self._rdzv, revision + 1, max(action.until - now, 0.0), prefix=True
                    )
            elif isinstance(action, D.Complete):
                addr_of = {p.node_id: p.addr for p in view.participants}
                result = json.dumps(
                    {
                        "members": list(action.members),
                        "addrs": [addr_of.get(m, "") for m in action.members],
                    }
                )
                if self._kv.create(result_key, result, _META_TTL) is not None:
                    self._completed(round_no, len(action.members))
            elif isinstance(action, D.Joined):
                return action
            elif isinstance(action, (D.NextRound, D.Rejoin)):
                self._leave_round()
                return action
            elif isinstance(action, D.Closed):
                self._leave_round()
                raise RendezvousClosedError(f"The rendezvous of run {s.run_id!r} is closed.")
            elif isinstance(action, D.TimedOut):
                self._leave_round()
                raise RendezvousTimeoutError(
                    f"Run {s.run_id!r}: round {round_no} did not complete within "
                    f"join_timeout={s.join_timeout}s ({len(view.participants)} node(s) "
                    f"joined, min_nodes={s.min_nodes})."
                )

    def _view(
        self,
        records: list[Record],
        round_no: int,
        now: float,
        min_reached: float | None,
        max_reached: float | None,
        deadline: float,
    ) -> D.JoinView:
        s = self._s
        participants: list[D.Participant] = []
        result: tuple[str, ...] | None = None
        closed = False
        prev_live = 0
        for r in records:
            if r.key == self._rdzv + "/closed":
                closed = True
                continue
            where = _keys.round_of(self._rdzv, r.key)
            if where is None:
                continue
            rnd, rest = where
            if rnd == round_no and rest == "result":
                result, self._result_addrs = _parse_result(r)
            elif rnd == round_no and rest.startswith("nodes/"):
                participants.append(_parse_node(r))
            elif rnd == round_no - 1 and rest.startswith("nodes/"):
                prev_live += 1
        return D.JoinView(
            me=self._id,
            closed=closed,
            result=result,
            participants=tuple(participants),
            prev_round_live=prev_live,
            min_nodes=s.min_nodes,
            max_nodes=s.max_nodes,
            now=now,
            min_reached=min_reached,
            max_reached=max_reached,
            last_call_timeout=s.last_call_timeout,
            deadline=deadline,
        )

    def _completed(self, round_no: int, size: int) -> None:
        """The result writer's chores: advance the hint, drop round N-2's keys."""
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
        if self._rank != 0 or time.monotonic() - self._last_meta_refresh < _META_REFRESH:
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


def _parse_result(record: Record) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(members, addrs)`` of a round result, both in rank order."""
    try:
        data = json.loads(record.value)
        members, addrs = data["members"], data.get("addrs") or [""] * len(data["members"])
        for name, seq in (("members", members), ("addrs", addrs)):
            if not isinstance(seq, list) or not all(isinstance(m, str) for m in seq):
                raise TypeError(f"{name} is not a list of strings")
        if len(addrs) != len(members):
            raise TypeError("addrs and members differ in length")
        return tuple(members), tuple(addrs)
    except (ValueError, KeyError, TypeError) as exc:
        raise RendezvousStateError(
            f"The round result {record.key!r} is corrupt or foreign: {exc}"
        ) from exc
