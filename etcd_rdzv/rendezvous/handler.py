"""Our own rendezvous handler, with torch's ``RendezvousHandler`` interface.

How a round forms (keys in :mod:`etcd_rdzv._keys`):

* each node writes its **own** join key ``rdzv/r<N>/nodes/<node>`` with a TTL and keeps
  it alive with heartbeats: no key that every node must win a compare-and-set on;
* one node per round, the **coordinator**, holds ``rdzv/r<N>/coord`` (create-if-absent,
  with the TTL of a join key). Only it follows the membership: it lists the ``rdzv``
  directory once, then applies etcd's watch events to that picture and re-decides
  after each (:func:`.decisions.decide`, a pure function);
* every other node, a **follower**, watches nothing but the coordinator key. When the
  round is complete (``max_nodes`` joined, or ``min_nodes`` plus the last call) the
  coordinator creates ``rdzv/r<N>/result`` (create-if-absent: exactly one write wins),
  listing the members in rank order, then *announces* it by writing the result into
  its coordinator key and deleting that key; every follower adopts it from the event
  (:func:`.decisions.follow`). Closing is announced the same way;
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

import dataclasses
import functools
import logging
import random
import shlex
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from .. import _keys
from .._kv import KV, Event, Record, WatchCompacted, Watcher
from ..errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)
from ..params import DEFAULT_API, DEFAULT_KEY_PREFIX, STATIC_HANDLER_NAME, HandlerSettings
from ..store import EtcdStore
from . import decisions as D
from . import records
from .heart import Heart
from .records import Outcome
from .status import close_run
from .watch import MemberWatch, RoundView

__all__ = [
    "HANDLER_NAME",
    "LOGGED_AND_RAISED",
    "STATIC_HANDLER_NAME",
    "EtcdRendezvousHandler",
    "RendezvousResult",
]

log = logging.getLogger(__name__)

HANDLER_NAME = "etcd-rdzv"
_META_REFRESH = 600.0  # seconds between refreshes of the current result by rank 0
_CATCH_UP = 4  # changes waiting behind a watch event above which the coordinator re-lists
_OUTAGE_BACKOFF = 0.5  # seconds before a join retries after an etcd request failed ...
_OUTAGE_BACKOFF_MAX = 4.0  # ... doubling up to this (with jitter), until join_timeout
_LEAVE_GRACE = 2.0  # seconds past join_timeout for deleting this node's keys on the way out
_WATCH_SPREAD = 1.0  # seconds over which the members' watchers of a new round start
_PROGRESS_PERIOD = 5.0  # seconds between reports of what a waiting join waits for ...
_PROGRESS_GAP = 1.0  # ... and at least this between two when the picture changes

#: The attribute set (true) on a log record whose message the handler raises right
#: after: a front end that reports the exception itself (the CLI) may drop the record.
LOGGED_AND_RAISED = "etcd_rdzv_raised"


@dataclass(frozen=True)
class RendezvousResult:
    """What :meth:`EtcdRendezvousHandler.next_rendezvous` returns without torch."""

    rank: int
    world_size: int
    store: EtcdStore
    round: int
    members: tuple[str, ...]  # node ids in rank order
    addrs: tuple[str, ...]  # their addresses, in rank order


class _Progress:
    """Reports what a join waits for: when the picture changes (at most once per
    ``_PROGRESS_GAP`` seconds, and not in the join's first such gap, so a round that
    completes at once says nothing) and every ``_PROGRESS_PERIOD`` seconds.

    The join's loops tell it the latest picture (:meth:`waiting`, no I/O); its own
    daemon thread reports, so a slow ``report`` never holds up the join, and a report
    costs no etcd request. It holds neither the handler nor the join.
    """

    def __init__(self, report: Callable[[str], None], name: str) -> None:
        self._report = report
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._what: tuple[tuple[object, ...], Callable[[float], str]] | None = None
        self._shown: tuple[object, ...] | None = None
        self._shown_at = time.monotonic()
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-rdzv-progress:{name}", daemon=True
        )
        self._thread.start()

    def waiting(self, counts: tuple[object, ...], describe: Callable[[float], str]) -> None:
        """The join waits: ``describe(now)`` says for what; ``counts`` change when
        the picture does."""
        with self._lock:
            self._what = (counts, describe)

    def busy(self) -> None:
        """The join does not wait (it reads or writes etcd): nothing to report."""
        with self._lock:
            self._what = None

    def _tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self._what is None:
                return
            counts, describe = self._what
            since = now - self._shown_at
            if since < _PROGRESS_PERIOD and (counts == self._shown or since < _PROGRESS_GAP):
                return
            self._shown, self._shown_at = counts, now
        try:
            self._report(describe(now))
        except Exception:  # never end the thread: the next tick tries again
            log.warning("reporting the progress of a join failed", exc_info=True)

    def _run(self) -> None:
        while not self._stop.wait(_PROGRESS_GAP):
            self._tick()

    def stop(self) -> None:
        self._stop.set()


def _report_progress(
    run_id: str, node_id: str, callback: Callable[[str], None] | None, text: str
) -> None:
    log.info("run %s: node %s: %s", run_id, node_id, text)
    if callback is not None:
        callback(text)


def closed_message(run_id: str, key_prefix: str, api: str) -> str:
    """The error of a join into a closed run, with what to do about it."""
    command = f"etcd-rdzv delete --run-id {shlex.quote(run_id)}"
    if key_prefix != DEFAULT_KEY_PREFIX:
        command += f" --key-prefix {shlex.quote(key_prefix)}"
    if api != DEFAULT_API:
        command += f" --api {api}"
    return (
        f"The rendezvous of run {run_id!r} is closed. To start the job again, use a new "
        f"run id (torchrun: --rdzv-id), or delete the closed run first: {command} (with "
        "the job's etcd options)."
    )


def _watch_from(as_of: int | None, announced_at: int | None) -> int | None:
    """Where a member's watcher starts: the revision the round was decided at, or the
    announcement's when the only two writes since the decision were the round's
    result and its announcement. Then no member's key changed in between, and the
    watcher need not fetch those two records (the largest of the round: every member
    and address) back."""
    if as_of is not None and announced_at is not None and announced_at == as_of + 2:
        return announced_at
    return as_of


def _after_round(
    kv: KV,
    s: HandlerSettings,
    node_id: str,
    round_no: int,
    completed: int | None,
    coord: str | None,
) -> None:
    """After an announcement: delete the coordinator key (``coord``) and, for the node
    that wrote the round's result of ``completed`` members, advance the round hint and
    drop round N-2's keys. Housekeeping, bounded by ``close_timeout``: what fails here
    expires by itself (the hint is only a hint: a node that reads an old one finds the
    round complete and moves on)."""
    try:
        with kv.bounded(time.monotonic() + s.close_timeout):
            if coord is not None:
                kv.delete(coord)
            if completed is None:
                return
            log.info(
                "run %s: node %s completed round %d with %d member(s)",
                s.run_id,
                node_id,
                round_no,
                completed,
            )
            kv.put(_keys.hint_key(s.key_prefix, s.run_id), str(round_no + 1), records.META_TTL)
            if round_no > 2:
                kv.delete_prefix(_keys.round_dir(s.key_prefix, s.run_id, round_no - 2))
                kv.delete_prefix(f"{_keys.store_dir(s.key_prefix, s.run_id)}/r{round_no - 2}")
    except RendezvousConnectionError as exc:  # housekeeping only
        log.warning("run %s: housekeeping after round %d failed: %s", s.run_id, round_no, exc)
    except Exception:  # a thread never ends silently
        log.warning("run %s: housekeeping after round %d failed", s.run_id, round_no, exc_info=True)


@dataclass(frozen=True)
class _HintSays:
    """A guarded join key was not written: the round hint names round ``hint``."""

    hint: int


class _Held:
    """What a handler holds: its keys in etcd and its threads.

    Kept apart from the handler (which it does not reference), so the handler's
    finalizer can release it: a handler dropped without ``shutdown()``, or still alive
    when the interpreter exits, stops its threads and deletes its keys, and the others
    see the node gone at once rather than when its key expires.
    """

    def __init__(self, kv: KV, timeout: float) -> None:
        self.kv, self.timeout = kv, timeout
        self.key: str | None = None  # this node's join key
        self.coord: str | None = None  # the coordinator key, while this node holds it
        self.heart: Heart | None = None
        self.watch: MemberWatch | None = None
        self.ready: Watcher | None = None  # the watch of the next join, started early
        self.spare_heart: Heart | None = None  # the heart of the next join, started early
        self.old: list[str] = []  # join keys of rounds this node moves on from
        self.released = False  # by release() (shutdown, a finalizer) since the join began

    def stop_heart(self) -> None:
        heart, self.heart = self.heart, None
        if heart is not None:
            heart.stop()

    def stop_threads(self) -> None:
        self.stop_heart()
        watch, self.watch = self.watch, None
        if watch is not None:
            watch.stop()

    def move_on(self) -> None:
        """Leave the current round for the next: stop the threads, but keep the join
        key until the key of the next round is written (:meth:`drop_old`). So a member
        that re-joins is never absent from both rounds, and the next round's
        coordinator, which waits until the previous round's keys are gone, always sees
        it before it decides: a restart never swaps a member for a spare."""
        self.stop_threads()
        self._delete([self.coord])
        self.coord = None
        if self.key is not None:
            self.old.append(self.key)
            self.key = None

    def drop_old(self) -> bool:
        """Delete the join keys of the rounds this node moved on from."""
        old, self.old = self.old, []
        return self._delete(old)

    def release(self) -> bool:
        """Stop the threads and delete the keys (within ``timeout`` seconds; a key
        that cannot be deleted expires by itself). Returns whether all went."""
        self.released = True
        self.stop_threads()
        self.take_ready(None)
        spare, self.spare_heart = self.spare_heart, None
        if spare is not None:
            spare.stop()
        keys = [self.coord, self.key, *self.old]
        self.coord = self.key = None
        self.old = []
        return self._delete(keys)

    def take_ready(self, key: str | None) -> Watcher | None:
        """The watcher started ahead of a join if it watches ``key``; closed if not."""
        ready, self.ready = self.ready, None
        if ready is not None and ready.key != key:
            ready.close()
            return None
        return ready

    def _delete(self, keys: Sequence[str | None]) -> bool:
        ok = True
        deadline = time.monotonic() + self.timeout
        for key in keys:
            if key is None:
                continue
            try:
                with self.kv.bounded(deadline):
                    self.kv.delete(key)
            except RendezvousConnectionError as exc:  # it expires by itself
                log.warning("could not delete %s: %s", key, exc)
                ok = False
            except Exception:  # a finalizer at exit, say, after the client was closed
                log.warning("could not delete %s", key, exc_info=True)
                ok = False
        return ok


class EtcdRendezvousHandler:
    """The native etcd rendezvous handler (backend name ``etcd-rdzv``).

    Build it with :func:`etcd_rdzv.create_handler`. Thread-safe for the agent's use:
    one thread calls :meth:`next_rendezvous`, others may call the rest.

    While a join waits, what it waits for (nodes joined of min/max, the last call's
    count-down, spares, static ranks missing; a follower: its coordinator) is logged at
    INFO every few seconds and when it changes, and given to :attr:`on_progress`.
    """

    #: Called with each progress line of a waiting join (from a thread of the handler;
    #: it must not block for long). ``None``: the log only.
    on_progress: Callable[[str], None] | None = None

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
        self._joined = False  # whether the round of our join key completed with this node
        self._value = ""  # what our join key holds
        self._since: int | None = None  # the revision of the current join's first key
        self._last_meta_refresh = 0.0
        self._outcome: Outcome | None = None
        self._announced_at: int | None = None  # the revision of the outcome's announcement
        self._told = False  # whether the current join was logged (and its event recorded)
        self._progress: _Progress | None = None  # while a join runs and someone listens
        # Our keys and threads. Held apart from the handler, so that a handler dropped
        # without shutdown() (or alive at interpreter exit) can still be cleaned up:
        # the finalizer stops the threads and deletes the keys, so the others see this
        # node gone at once instead of when its key expires.
        self._held = _Held(kv, settings.close_timeout)
        self._finalizer = weakref.finalize(self, self._held.release)

    # -- small accessors ----------------------------------------------------------------

    def get_backend(self) -> str:
        """``etcd-rdzv`` (``etcd-rdzv-static`` with a fixed rank): the name torchrun
        knows this handler by."""
        return HANDLER_NAME if self._s.rank is None else STATIC_HANDLER_NAME

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

    def prepare_join(self) -> None:
        """Do now what the next join does first, so that the join itself is one
        request: grant the lease of its join key (v3), start the watch of the round it
        tries first, and start the thread that will keep its key alive. The handler
        factories call it when they build a handler; a lease older than half the key's
        TTL, or a watch older than ``read_timeout``, is made again by the join. Not
        while a join runs.

        Raises:
            RendezvousConnectionError: etcd did not answer (the join then does it all).
        """
        s = self._s
        self._held.take_ready(None)
        watcher = self._kv.watcher(_keys.coord_key(s.key_prefix, s.run_id, self._round + 1))
        try:
            watcher.start()
            # The grant after the watch: the stream keeps the connection it was opened
            # on, and the grant leaves its own idle for the join's transaction (in the
            # other order the join opened a connection, on both sides, in its window).
            self._kv.prepare_owned(s.node_ttl)
        except BaseException:
            watcher.close()
            raise
        self._held.ready = watcher
        if self._held.spare_heart is None:
            # It beats nothing until the join gives it the join key.
            self._held.spare_heart = self._new_heart()

    def _new_heart(self) -> Heart:
        s = self._s
        return Heart(
            self._kv,
            s.run_id,
            s.node_ttl,
            s.keep_alive_interval,
            s.heartbeat_timeout,
            on_beat=self._refresh_meta,
        )

    # -- events -------------------------------------------------------------------------

    def _event(self, message: str, state: str = "RUNNING", rank: int | None = None) -> None:
        """A state change of this node's rendezvous, for event recorders.

        ``state`` is one of ``"RUNNING"``, ``"SUCCEEDED"``, ``"FAILED"`` (torch's
        ``NodeState`` names). The torch flavour records these as torch's rendezvous
        events; here they go to the debug log only. Must not raise."""
        log.debug("run %s node %s [%s]: %s", self._s.run_id, self._id, state, message)

    # -- closing ------------------------------------------------------------------------

    def is_closed(self) -> bool:
        """Whether :meth:`set_closed` was called for this run (by any node)."""
        record, _ = self._kv.get(_keys.closed_key(self._s.key_prefix, self._s.run_id))
        return record is not None

    def set_closed(self) -> None:
        """Close the run: every later join fails with RendezvousClosedError."""
        close_run(self._kv, self._s.key_prefix, self._s.run_id)
        log.info("run %s closed by node %s", self._s.run_id, self._id)
        self._event(f"The node {self._id!r} closed the rendezvous {self._s.run_id!r}.", "SUCCEEDED")

    # -- membership signals -------------------------------------------------------------

    def num_nodes_waiting(self) -> int:
        """Nodes that want in (waiting for the next round), plus members of the current
        round that died or left; non-zero means the agent should re-rendezvous.

        Nodes waiting that a new round could not take (the group has ``max_nodes``
        members, or they are short of a whole ``node_unit``) are *spares* and do not
        count; they count once a member is gone. This node's own key lost, or the
        watcher unable to read the run, counts too: the handler fails towards a
        re-rendezvous, never towards silence. No etcd request: a watcher thread keeps
        the counts."""
        watch, heart = self._held.watch, self._held.heart
        if watch is None:
            return 0
        lost = 1 if heart is not None and heart.lost.is_set() else 0
        broken = 1 if watch.broken else 0
        waiting = D.nodes_waiting(
            watch.world_size, self._s.max_nodes, watch.waiting, watch.missing, self._s.node_unit
        )
        return waiting + lost + broken

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
        self._joined = False
        self._held.release()

    def _join(self) -> RendezvousResult:
        s = self._s
        started = time.monotonic()
        deadline = started + s.join_timeout
        self._held.released = False
        if self.on_progress is not None or log.isEnabledFor(logging.INFO):
            # Not a method of the handler: the thread holds no reference to it.
            report = functools.partial(_report_progress, s.run_id, self._id, self.on_progress)
            self._progress = _Progress(report, s.run_id)
        try:
            # Every request of the join ends by the deadline (plus a moment to leave
            # cleanly), whatever etcd does: join_timeout is a bound, not a hint.
            with self._kv.bounded(deadline + _LEAVE_GRACE):
                return self._join_by(started, deadline)
        finally:
            progress, self._progress = self._progress, None
            if progress is not None:
                progress.stop()

    def _join_by(self, started: float, deadline: float) -> RendezvousResult:
        s = self._s
        self._joined = False
        self._held.move_on()
        self._since = None
        self._announced_at = None
        prev_rank = self._rank
        # First the round after this node's last, on the condition that the round hint
        # agrees (one request where the API allows); else the round the hint names.
        round_no = self._round + 1
        guarded = True
        self._told = False
        pause = _OUTAGE_BACKOFF
        try:
            while True:
                try:
                    action = self._join_round(round_no, prev_rank, deadline, guarded)
                    if isinstance(action, _HintSays):
                        round_no, guarded = max(action.hint, self._round + 1), False
                        continue
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
                    self._held.stop_heart()
                    time.sleep(wait)
                    pause = min(pause * 2, _OUTAGE_BACKOFF_MAX)
                    continue
                if isinstance(action, D.Joined):
                    outcome = action
                    break
                round_no, guarded = round_no + 1, False
        except BaseException as exc:
            # A node that gave up must not stay in the round: a coordinator would count
            # it, and the round could complete with a member that never takes its rank.
            self._leave_round()
            self._event(
                f"The node {self._id!r} failed to join the rendezvous {s.run_id!r}: "
                f"{type(exc).__name__}: {exc}",
                "SUCCEEDED" if isinstance(exc, RendezvousGracefulExitError) else "FAILED",
            )
            raise
        self._round, self._rank, self._joined = round_no, outcome.rank, True
        result = self._outcome
        assert result is not None
        store = self._store_factory(f"{_keys.store_dir(s.key_prefix, s.run_id)}/r{round_no}")
        self._held.watch = MemberWatch(
            self._kv,
            self._rdzv,
            s.run_id,
            round_no,
            outcome.members,
            _watch_from(result.as_of, self._announced_at),
            spread=min(_WATCH_SPREAD, s.keep_alive_interval / 2),
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
        self._event(
            f"The node {self._id!r} completed round {round_no} of the rendezvous {s.run_id!r}: "
            f"rank {outcome.rank} of {outcome.world_size}.",
            "SUCCEEDED",
            rank=outcome.rank,
        )
        return RendezvousResult(
            outcome.rank, outcome.world_size, store, round_no, outcome.members, result.addrs
        )

    def _tell_join(self, round_no: int) -> None:
        """Log the join (and record its event) once, when its first key is written."""
        if self._told:
            return
        self._told = True
        s = self._s
        log.info("run %s: node %s joins round %d", s.run_id, self._id, round_no)
        if s.rank is not None:
            log.info(
                "run %s: node %s claims static rank %d of %d (from %s)",
                s.run_id,
                self._id,
                s.rank,
                s.max_nodes,
                s.rank_source,
            )
        self._event(f"The node {self._id!r} joins round {round_no} of the rendezvous {s.run_id!r}.")

    def _join_round(
        self, round_no: int, prev_rank: int | None, deadline: float, guarded: bool = False
    ) -> D.Action | _HintSays:
        """Write this node's key in ``round_no``, coordinate or follow the round to its
        outcome: Joined or NextRound (others raise). ``guarded``: write only if the
        round hint names ``round_no`` (absent: round 1), else return what it names."""
        s = self._s
        key = _keys.node_key(s.key_prefix, s.run_id, round_no, self._id)
        coord = _keys.coord_key(s.key_prefix, s.run_id, round_no)
        value = self._value = records.node_record(
            self._id, self._addr, prev_rank, s.rank, s.node_group
        )
        participants: int | None = None  # as the coordinator last saw them
        # Most nodes find a coordinator already there: a read tells them so without the
        # consensus write a refused create would cost (on v3 the read goes with the
        # write of the join key, in one transaction). After a TakeOver, claim at once.
        # The watcher of the coordinator key starts with that read: a follower misses
        # nothing the coordinator writes after it.
        self._held.key, self._joined = key, False  # deleted when the node leaves, from here
        # A node moving on from a round swaps its old join key for the new one in the
        # same write where the API can (v3: one transaction, the new key on the old
        # key's lease: no lease grant).
        old = self._held.old[-1] if self._held.old and self._kv.replaces_in_one_request else None
        hint_key = _keys.hint_key(s.key_prefix, s.run_id)

        def write() -> tuple[tuple[tuple[Record, Record | None] | None, Record | None], int]:
            if not guarded:
                pair, revision = self._kv.put_owned_and_get(key, value, s.node_ttl, coord, old)
                return (pair, None), revision
            expected = None if round_no == 1 else str(round_no)
            return self._kv.put_owned_and_get_if(
                hint_key, expected, key, value, s.node_ttl, coord, old
            )

        with self._held.take_ready(coord) or self._kv.watcher(coord) as watcher:
            (pair, hint), _ = watcher.reread(write)
            if pair is None:  # the hint names another round: nothing was written
                self._held.key = None
                return _HintSays(records.hint_of(hint) or 1)
            mine, holder = pair
            self._tell_join(round_no)
            if old is not None:
                self._held.old.remove(old)
            if self._since is None:  # the first key of this join: it waits from here
                self._since = mine.revision
            self._held.drop_old()  # this node is in the new round now: leave the old
            heart, self._held.spare_heart = self._held.spare_heart, None
            if heart is None:
                heart = self._new_heart()
            self._held.heart = heart
            if self._held.released:
                heart.stop()
                self._shut_down_while_joining(round_no, key)
            heart.keep(key, on_gone=self._write_again, required=True)
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
            self._joined = False
            self._held.move_on()  # its key goes once the next round's key is written
            return action
        if isinstance(action, D.Failed):
            self._leave_round()
            raise RendezvousError(f"Run {s.run_id!r}, round {round_no}: {action.reason}")
        if isinstance(action, D.Closed):
            self._leave_round()
            if prev_rank is None and self._closed_since(self._since):
                # A spare (or a late node) that waited while the group ran: the job
                # ended without needing it. torch's agent exits cleanly on this.
                raise RendezvousGracefulExitError(
                    f"The rendezvous of run {s.run_id!r} was closed while node {self._id} "
                    "waited to join: the job ended without it."
                )
            message = closed_message(s.run_id, s.key_prefix, self._kv.api)
            # Logged as well as raised: under torchrun the agent's log shows this line,
            # where the error itself comes last, after torch's long traceback.
            log.error("%s", message, extra={LOGGED_AND_RAISED: True})
            raise RendezvousClosedError(message)
        assert isinstance(action, D.TimedOut), action
        if s.rank is not None:
            ranks = self._describe_ranks(round_no)
            self._leave_round()
            raise RendezvousTimeoutError(
                f"Run {s.run_id!r}: static round {round_no} did not complete within "
                f"join_timeout={s.join_timeout}s: {ranks}."
            )
        self._leave_round()
        joined = "" if participants is None else f" ({participants} node(s) joined)"
        raise RendezvousTimeoutError(
            f"Run {s.run_id!r}: round {round_no} did not complete within "
            f"join_timeout={s.join_timeout}s{joined}; min_nodes={s.min_nodes}."
        )

    def _describe_ranks(self, round_no: int) -> str:
        """For a static round that timed out: which ranks came, held by whom, and
        which did not (one listing, best effort)."""
        s = self._s
        nodes = _keys.round_dir(s.key_prefix, s.run_id, round_no) + "/nodes"
        try:
            with self._kv.bounded(time.monotonic() + _LEAVE_GRACE):
                found, _ = self._kv.list_prefix(nodes)
            return D.describe_ranks([records.parse_node(r) for r in found], s.max_nodes)
        except RendezvousError as exc:
            return f"the round's nodes could not be read ({exc})"

    def _closed_since(self, revision: int | None) -> bool:
        """Whether the run was closed after ``revision`` (not before this node came)."""
        if revision is None:
            return False
        try:
            record, _ = self._kv.get(_keys.closed_key(self._s.key_prefix, self._s.run_id))
        except RendezvousConnectionError:
            return False
        return record is not None and (record.created or record.revision) > revision

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
                coord, records.coordinator_record(self._id), s.node_ttl, beside=self._held.key
            )
        elif self._held.coord == coord and records.coordinator_of(holder) == self._id:
            mine = holder  # held before an etcd request failed: coordinate on
        if mine is None:
            return self._follow(round_no, watcher, deadline, holder), participants
        self._held.coord = coord
        heart = self._held.heart
        if heart is None or self._held.released:
            self._shut_down_while_joining(round_no, key, coord)
        heart.keep(coord)
        action, participants = self._coordinate(round_no, deadline, key, value)
        return action, participants

    def _shut_down_while_joining(self, round_no: int, *keys: str) -> NoReturn:
        """The handler was shut down (or finalized at exit) by another thread while
        this join ran: delete what the join wrote since, and end it."""
        self._held.coord = None
        for key in keys:
            try:
                self._kv.delete(key)
            except RendezvousConnectionError as exc:  # it expires by itself
                log.warning("could not delete %s: %s", key, exc)
        raise RendezvousError(
            f"Run {self._s.run_id!r}: node {self._id!r} was shut down while it joined "
            f"round {round_no}."
        )

    def _write_again(self, key: str) -> bool:
        """The heart found this node's join key gone. Before completion, write it again
        (the node rejoins the round as a new arrival); after it, report the loss."""
        if self._joined or self._held.key != key:
            return False
        log.warning("run %s: join key %s expired; writing it again", self._s.run_id, key)
        self._kv.put_owned(key, self._value, self._s.node_ttl)
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
        view = RoundView(self._rdzv, round_no)

        def relist() -> int:
            records, revision = watcher.reread(lambda: self._kv.list_tree(self._rdzv))
            view.load(records)
            return revision

        def write_result(text: str) -> bool:
            """Create the round's result (or fault) once; adopt another coordinator's
            if it was faster. Returns whether this node's write landed."""
            created = self._kv.create(result_key, text, records.META_TTL)
            if created is not None:
                view.apply(Event("put", created))
                return True
            current, _ = self._kv.get(result_key)
            if current is not None:
                view.apply(Event("put", current))
            return False

        revision = relist()
        min_reached: float | None = None
        conflict_since: float | None = None
        told_prev = False
        wrote_result = False
        log.info("run %s: node %s coordinates round %d", s.run_id, self._id, round_no)
        while True:
            if view.result is None and view.coordinator() != self._id:
                # Our key expired (this node was paused) or another node holds it now.
                log.warning("run %s: node %s lost the coordinator key", s.run_id, self._id)
                self._release_coord(delete=False)
                return D.TakeOver(), len(view.nodes)
            now = time.monotonic()
            # The last call starts once a whole world can form: min_nodes rounded up
            # to a multiple of node_unit.
            low = D.unit_bounds(s.min_nodes, s.max_nodes, s.node_unit)[0]
            min_reached = D.reached_at(min_reached, len(view.nodes), low, now)
            outcome = records.parse_result(view.result) if view.result is not None else None
            participants = tuple(view.nodes.values())
            prev = tuple(p for p in view.prev.values() if p is not None)
            static = s.rank is not None
            if static and D.rank_conflicts(participants, prev):
                conflict_since = now if conflict_since is None else conflict_since
            else:
                conflict_since = None
            join_view = D.JoinView(
                me=self._id,
                closed=view.closed,
                result=outcome.members if outcome is not None else None,
                participants=participants,
                prev_round_live=len(view.prev),
                min_nodes=s.min_nodes,
                max_nodes=s.max_nodes,
                now=now,
                min_reached=min_reached,
                last_call_timeout=s.last_call_timeout,
                deadline=deadline,
                failed=outcome.error if outcome is not None else None,
                static=static,
                prev=prev,
                conflict_since=conflict_since,
                node_ttl=s.node_ttl,
                node_unit=s.node_unit,
            )
            action = D.decide(join_view)
            if isinstance(action, D.Wait) and view.prev and not told_prev:
                told_prev = True
                log.info(
                    "run %s: round %d waits for %d member(s) of round %d to leave it; "
                    "a member that died leaves when its key expires (within %ds)",
                    s.run_id,
                    round_no,
                    len(view.prev),
                    round_no - 1,
                    s.node_ttl,
                )
            if isinstance(action, D.Wait) and conflict_since == now:
                log.warning(
                    "run %s: a static rank is claimed twice in round %d; if no key "
                    "expires within %ds (a dead node's), the round fails: %s",
                    s.run_id,
                    round_no,
                    s.node_ttl,
                    D.describe_ranks(participants, s.max_nodes),
                )
            if isinstance(action, D.Wait):
                self._waiting(round_no, join_view)
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
                text = records.result_record(
                    action.members,
                    tuple(addr_of.get(m, "") for m in action.members),
                    revision,
                    s.max_nodes,
                    s.node_unit,
                )
                wrote_result = write_result(text) or wrote_result
            elif isinstance(action, D.Fail):
                log.error("run %s: round %d fails: %s", s.run_id, round_no, action.reason)
                text = records.fault_record(action.reason, action.nodes)
                wrote_result = write_result(text) or wrote_result
            elif isinstance(action, (D.Joined, D.NextRound, D.Failed)):
                assert outcome is not None and view.result is not None
                self._outcome = outcome
                self._announced_at = self._announce(
                    round_no,
                    records.announcement(self._id, result=view.result.value),
                    len(outcome.members) if wrote_result else None,
                )
                return action, len(view.nodes)
            elif isinstance(action, D.Rejoin):
                record = self._kv.put_owned(key, value, s.node_ttl)
                view.apply(Event("put", record))
            elif isinstance(action, D.Closed):
                self._announce(round_no, records.announcement(self._id, closed=True))
                return action, len(view.nodes)
            else:  # TimedOut: let another node (with a later deadline) take over
                self._release_coord(delete=True)
                return action, len(view.nodes)

    def _waiting(
        self,
        round_no: int,
        view: D.JoinView | None,
        leader: str | None = None,
        deadline: float = 0.0,
    ) -> None:
        """Tell the progress reporter what this node waits for: as the coordinator
        (``view``), or as a follower of ``leader``."""
        progress = self._progress
        if progress is None:
            return
        describe: Callable[[float], str]
        if view is not None:
            counts = D.progress(view).counts

            def describe(now: float) -> str:
                return f"round {round_no}: {D.progress(dataclasses.replace(view, now=now)).text}"

        else:
            counts = D.follower_progress(leader, 0.0, deadline).counts

            def describe(now: float) -> str:
                return f"round {round_no}: {D.follower_progress(leader, now, deadline).text}"

        progress.waiting((round_no, *counts), describe)

    def _announce(self, round_no: int, message: str, completed: int | None = None) -> int | None:
        """Tell the followers the outcome: write it into the coordinator key; then,
        in a thread of their own so that this node's join returns at once, delete the
        key and (``completed``: this node wrote the round's result, of that many
        members) do the result writer's chores. Only final facts are announced (a
        result, which is create-if-absent, or the closed run), so this may overwrite a
        key another coordinator just took (or delete it: the next coordinator then
        finds the result). If it fails, the heartbeat deletes the key once etcd answers
        again, and followers read the result themselves. Returns the announcement's
        revision (``None``: it failed)."""
        s = self._s
        coord = self._held.coord or _keys.coord_key(s.key_prefix, s.run_id, round_no)
        self._release_coord(delete=False)
        try:
            record = self._kv.put(coord, message, s.node_ttl)
        except RendezvousConnectionError as exc:
            log.warning("run %s: announcing round %d failed: %s", s.run_id, round_no, exc)
            # Followers then read the result once the key is gone: it may share the
            # join key's lifetime (see claim), so delete it rather than wait for that.
            if self._held.heart is not None:
                self._held.heart.delete_later(coord)
            if completed is not None:
                _after_round(self._kv, s, self._id, round_no, completed, None)
            return None
        # Not a method of the handler: the thread holds no reference to it.
        threading.Thread(
            target=_after_round,
            args=(self._kv, s, self._id, round_no, completed, coord),
            name=f"etcd-rdzv-chores:{s.run_id}:{round_no}",
            daemon=True,
        ).start()
        return record.revision

    def _release_coord(self, delete: bool) -> None:
        coord, self._held.coord = self._held.coord, None
        if coord is None:
            return
        if self._held.heart is not None:
            self._held.heart.drop(coord)
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
        closed, outcome = (
            records.parse_announcement(holder) if holder is not None else (False, None)
        )
        announced_at = holder.revision if outcome is not None and holder is not None else None
        leader = records.coordinator_of(holder) if holder is not None else None
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
                    failed=outcome.error if outcome is not None else None,
                )
            )
            if not isinstance(action, D.Wait):
                if isinstance(action, (D.Joined, D.NextRound, D.Failed)):
                    self._outcome = outcome
                    self._announced_at = announced_at
                return action
            self._waiting(round_no, None, leader, deadline)
            try:
                events = watcher.next(max(action.until - now, 0.0))
            except WatchCompacted:
                record, _ = watcher.reread(lambda: self._kv.get(coord))
                events = [] if record is None else [Event("put", record)]
                coordinated = record is not None
            for event in events:
                coordinated = event.kind == "put"
                if coordinated:
                    closed, announced = records.parse_announcement(event.record)
                    if outcome is None and announced is not None:
                        outcome, announced_at = announced, event.record.revision
                    leader = records.coordinator_of(event.record)
            if not coordinated and outcome is None and not closed:
                # The coordinator left or died: maybe after completing the round.
                record, _ = self._kv.get(_keys.result_key(s.key_prefix, s.run_id, round_no))
                if record is not None:
                    outcome = records.parse_result(record)

    # -- the result writer's chores ----------------------------------------------------

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
        self._kv.refresh(_keys.result_key(s.key_prefix, s.run_id, self._round), records.META_TTL)
        self._kv.refresh(_keys.hint_key(s.key_prefix, s.run_id), records.META_TTL)

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
                with self._kv.bounded(time.monotonic() + self._s.close_timeout):
                    self.set_closed()
            except RendezvousConnectionError as exc:
                log.warning("run %s: node %s could not close it: %s", self._s.run_id, self._id, exc)
                ok = False
        self._joined = False
        if not self._held.release():
            log.warning("run %s: shutdown of node %s incomplete", self._s.run_id, self._id)
            return False
        self._event(f"The node {self._id!r} left the rendezvous {self._s.run_id!r}.", "SUCCEEDED")
        return ok
