"""What a node knows of its run from etcd's watch events.

* :class:`RoundView`: the coordinator's picture of the round it forms (one listing,
  then events); no I/O.
* :class:`MemberWatch`: after a round completed, a member's thread that follows the
  run and keeps the counts ``num_nodes_waiting()`` needs.

Records are parsed by :mod:`.records`; neither holds the handler.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Iterable, Mapping

from .. import _keys
from .._kv import KV, Event, Record, WatchCompacted, Watcher
from ..admission.hosts import host_of_key
from ..errors import RendezvousConnectionError, RendezvousStateError
from . import decisions as D
from .listener import events
from .records import Outcome, coordinator_of, parse_node, parse_result
from .roster import Membership

__all__ = ["MemberWatch", "RoundView"]

log = logging.getLogger(__name__)

IDLE_WATCH = 30.0  # seconds one idle wait of the member watcher lasts (v2: a request)


def _under(key: str, gone: str) -> bool:
    """Whether deleting ``gone`` (a key or a directory) removed ``key``."""
    return key == gone or key.startswith(gone + "/")


class RoundView:
    """The coordinator's picture of its round: one listing, then watch events.

    Holds the round's live join keys (parsed), the previous round's live join keys,
    the round's result and coordinator keys and the closed marker. No I/O.
    """

    def __init__(self, rdzv: str, round_no: int) -> None:
        self._rdzv = rdzv
        self._round = round_no
        self.nodes: dict[str, D.Participant] = {}
        # The previous round's live join keys: parsed (None: not a node record).
        self.prev: dict[str, D.Participant | None] = {}
        self.closed = False
        self.result: Record | None = None
        self.coord: Record | None = None
        # The members of the previous round, once its result was seen; a slim result
        # (see .roster) waits in prev_slim until the coordinator read its list.
        self.prev_members: frozenset[str] = frozenset()
        self.prev_slim: Outcome | None = None
        self._excluded_dir = rdzv + "/hosts/excluded"
        self.excluded: set[str] = set()  # hosts kept out (see .hosts)
        # The join keys of nodes that gave up on the round, with their gone marker's
        # revision: out, even while the key itself is still there (v2 deletes it
        # after the marker), until the node writes its key again (it joins anew).
        self.gone: dict[str, int] = {}
        self._written: dict[str, int] = {}  # the revision of each join key's last write

    def admitted(self) -> tuple[D.Participant, ...]:
        """The round's participants whose host is not excluded and who did not give up."""
        return tuple(
            p
            for key, p in self.nodes.items()
            if p.host not in self.excluded and key not in self.gone
        )

    def live_prev(self) -> dict[str, D.Participant | None]:
        """The previous round's live join keys, but those of excluded hosts: the
        round does not wait for them to leave."""
        if not self.excluded:
            return self.prev
        return {k: p for k, p in self.prev.items() if p is None or p.host not in self.excluded}

    def load(self, records: Iterable[Record]) -> None:
        self.nodes, self.prev, self.closed = {}, {}, False
        self.result = self.coord = None
        self.prev_members = frozenset()
        self.prev_slim = None
        self.excluded = set()
        self.gone, self._written = {}, {}
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
        host = host_of_key(self._excluded_dir, record.key)
        if host is not None:  # its presence excludes; its content is for people
            self.excluded.add(host)
            return
        where = _keys.round_of(self._rdzv, record.key)
        if where is None:
            return
        rnd, rest = where
        if rnd == self._round:
            if rest.startswith("nodes/"):
                self.nodes[record.key] = parse_node(record)
                # When the key was created counts: a TTL refresh (v2's heart) that lands
                # after the node's gone marker is no new arrival.
                written = record.created or record.revision
                self._written[record.key] = written
                if self.gone.get(record.key, written) < written:
                    del self.gone[record.key]
            elif rest == "result":
                self.result = record
            elif rest.startswith("gone/"):
                node_key = record.key[: -len(rest)] + "nodes/" + rest[len("gone/") :]
                if self._written.get(node_key, 0) < record.revision:  # any listing order
                    self.gone[node_key] = record.revision
            elif rest == "coord":
                self.coord = record
        elif rnd == self._round - 1 and rest == "result":
            try:
                outcome = parse_result(record)
            except RendezvousStateError:
                self.prev_members = frozenset()  # nobody counts as re-joined
                return
            # A slim result names no members: the coordinator reads its list.
            self.prev_members = frozenset(outcome.members)
            self.prev_slim = outcome if outcome.buckets else None
        elif rnd == self._round - 1 and rest.startswith("nodes/"):
            try:
                self.prev[record.key] = parse_node(record)
            except RendezvousStateError:
                # Counts as a live node of that round all the same: this round waits.
                self.prev[record.key] = None

    def _delete(self, gone: str) -> None:
        if self.nodes.pop(gone, None) is not None:
            return
        if gone in self.prev:
            del self.prev[gone]
            return
        # Anything else: a key we do not track, or a directory with all under it.
        self.nodes = {k: p for k, p in self.nodes.items() if not _under(k, gone)}
        self.prev = {k: p for k, p in self.prev.items() if not _under(k, gone)}
        if _under(self._rdzv + "/closed", gone):
            self.closed = False
        host = host_of_key(self._excluded_dir, gone)
        if host is not None:
            self.excluded.discard(host)
        elif _under(self._excluded_dir, gone):
            self.excluded = set()
        if self.result is not None and _under(self.result.key, gone):
            self.result = None
        if self.coord is not None and _under(self.coord.key, gone):
            self.coord = None

    def coordinator(self) -> str | None:
        """The node id the coordinator key names, if it exists."""
        return None if self.coord is None else coordinator_of(self.coord)


class MemberWatch:
    """After completion: watches the run and keeps the counts ``num_nodes_waiting`` needs.

    Counts nodes waiting in later rounds and members of this round whose key is gone
    (dead). It starts from the revision the round was decided at, so no death after
    the decision is missed, and keeps its counts from watch events alone (it lists
    the directory only if etcd's history no longer reaches back that far; on v2, whose
    history is its last 1,000 events, an idle watch request that ran out of it goes
    on from etcd's index instead). It waits on one watcher: on v3 one stream, which
    idle costs a new watch request only each ``read_timeout`` of silence; on v2 one
    request per change or ``IDLE_WATCH`` seconds.

    Each member it finds gone (or out: its host excluded) is named once on the events
    logger, with its host and address (``hosts``, ``addrs``: node id -> host id or
    address, when the round's list is known here; a host also when read); not a
    member that re-joins (its key moved to a later round), nor any after the run was
    closed (the job ended).

    A member whose key goes once the run is closed finished its job (a handler that
    closes the run on shutdown writes the closed key before it deletes its own, and
    events come in revision order): it is not gone, and :attr:`closed` tells the
    session that nothing can make this round restart (a new join would be refused).
    """

    def __init__(
        self,
        kv: KV,
        rdzv: str,
        run_id: str,
        round_no: int,
        membership: Membership,
        as_of: int | None,
        spread: float,
        addrs: Mapping[str, str] | None = None,
        hosts: Mapping[str, str] | None = None,
    ):
        self._kv, self._rdzv, self._run_id = kv, rdzv, run_id
        self._round = round_no
        self._membership = membership
        self.world_size = membership.world
        self._nodes_dir = f"{rdzv}/r{round_no}/nodes"
        self._as_of = as_of
        self._spread = spread
        self._gone: set[str] = set()  # members whose key is gone
        self._done: set[str] = set()  # members whose key went after the run closed
        self._later: set[str] = set()  # join keys in later rounds
        self._excluded_dir = rdzv + "/hosts/excluded"
        self._excluded: set[str] = set()  # hosts kept out of the run
        self._hosts: dict[str, str | None] | None = None  # member key name -> host
        self._out: set[str] = set()  # members on excluded hosts: as good as gone
        self._addrs = addrs or {}
        self._result_hosts = {n: h for n, h in (hosts or {}).items() if h}  # node id -> host
        self._told: set[str] = set()  # members whose going was logged
        self._stop = threading.Event()
        self.waiting = 0
        self.missing = 0
        self.closed = False
        self.broken = False  # the last attempt to follow the run failed unexpectedly
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-rdzv-watch:{run_id}:{round_no}", daemon=True
        )
        self._thread.start()

    def _member(self, name: str) -> bool:
        """Whether the round's join key ``name`` is a member's (asked by the watcher
        thread only, at the first change in the round's directory: at N=1024, making
        the members' key names as each member took its rank cost every member 0.5 ms
        while the last ones waited). May read etcd (see :class:`~.roster.Membership`)."""
        return self._membership.contains(name)

    def _all_gone(self, alive: int = 0) -> set[str]:
        """Stand-ins for the members that are gone when only their count is known
        (``alive`` of them are there): no name they stand for is a key name."""
        return {f"/{i}" for i in range(max(self.world_size - alive, 0))}

    def _node(self, key: str) -> tuple[int, str] | None:
        where = _keys.round_of(self._rdzv, key)
        if where is None or not where[1].startswith("nodes/"):
            return None
        node = where[1][len("nodes/") :]
        return None if not node or "/" in node else (where[0], node)

    def _load(self, records: list[Record]) -> None:
        alive: set[str] = set()
        later: set[str] = set()
        closed = False
        self._excluded = set()
        for r in records:
            if r.key == self._rdzv + "/closed":
                closed = True
            host = host_of_key(self._excluded_dir, r.key)
            if host is not None:
                self._excluded.add(host)
            where = self._node(r.key)
            if where is None:
                continue
            if where[0] == self._round:
                alive.add(where[1])
            elif where[0] > self._round:
                later.add(r.key)
        names = self._membership.names
        if closed:  # who left since cannot be told apart: none counts as gone
            gone: set[str] = set()
        elif names is not None:
            gone = set(names - alive - self._done)
        else:  # a large round: the members are known by their count
            gone = self._all_gone(sum(1 for name in alive if self._member(name)))
        self._gone, self._later, self.closed = gone, later, closed

    def _apply(self, event: Event) -> None:
        key, put = event.record.key, event.kind == "put"
        if key == self._rdzv + "/closed":
            self.closed = put
            return
        host = host_of_key(self._excluded_dir, key)
        if host is not None:
            if put:
                self._excluded.add(host)
            else:
                self._excluded.discard(host)
            return
        if not put and _under(self._excluded_dir, key):
            self._excluded = set()
        where = self._node(key)
        if where is not None:
            if where[0] == self._round and put:
                # A key written in the round (a member's heart writes its key again
                # when its lease ran out): whoever holds it is not gone. No need to
                # know whether it is a member's, which may cost a roster read (under
                # an overloaded etcd at N=4096, leases ran out and every member read
                # the bucket of each key written again: 3-5 reads per node).
                self._gone.discard(where[1])
                self._done.discard(where[1])
            elif where[0] == self._round and self._member(where[1]):
                if self.closed:  # its job is done, not a member lost
                    self._done.add(where[1])
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
                names = self._membership.names
                self._gone = set(names) if names is not None else self._all_gone()

    def _hosts_out(self) -> None:
        """Which members are on excluded hosts (their hosts read once, when a host
        is first excluded: one listing of the round's join keys)."""
        if not self._excluded:
            self._out = set()
            return
        if self._hosts is None:
            records, _ = self._kv.list_prefix(self._nodes_dir)
            hosts: dict[str, str | None] = {}
            for record in records:
                try:
                    hosts[record.key.rsplit("/", 1)[1]] = parse_node(record).host
                except RendezvousStateError:
                    continue
            self._hosts = hosts
        self._out = {
            name
            for name, host in self._hosts.items()
            if host in self._excluded and self._member(name)
        }

    def _tell_gone(self) -> None:
        """Name each member newly gone or out on the events logger (once each)."""
        if self.closed or self._stop.is_set():
            return  # a stopped watcher's round is over for this node: it names no one
        later = {w[1] for w in map(self._node, self._later) if w is not None}
        unnamed = 0
        for name in sorted((self._gone | self._out) - self._told):
            if name in later:
                continue  # it re-joins: its agent restarts the group anyway
            self._told.add(name)
            node = None if name.startswith("/") else _keys.b64_text(name)
            if node is None:  # a stand-in: a large round knows only how many
                unnamed += 1
                continue
            host = None if self._hosts is None else self._hosts.get(name)
            host = host or self._result_hosts.get(node)
            where = [f"host {host!r}"] if host else []
            if node in self._addrs:
                where.append(f"address {self._addrs[node]!r}")
            about = f" ({', '.join(where)})" if where else ""
            if name in self._out and name not in self._gone:
                why = "is out: its host is excluded"
            else:
                why = "is gone: it left, or its key expired (dead, frozen or cut off)"
            events.info(
                "run %s round %d: member %r%s %s; the others re-form the group",
                self._run_id,
                self._round,
                node,
                about,
                why,
            )
        if unnamed:
            events.info(
                "run %s round %d: %d member(s) gone; the others re-form the group",
                self._run_id,
                self._round,
                unnamed,
            )

    def _publish(self) -> None:
        self._hosts_out()
        self._tell_gone()
        waiting, missing = len(self._later), len(self._gone | self._out)
        if (waiting, missing) != (self.waiting, self.missing) and (waiting or missing):
            log.info(
                "run %s round %d: %d node(s) waiting, %d member(s) gone",
                self._run_id,
                self._round,
                waiting,
                missing,
            )
        self.waiting, self.missing = waiting, missing
        self.broken = False

    def _run(self) -> None:
        # Every member starts its watcher as it gets its rank, and each first catches
        # up with the few changes since the decision (on v2 one request per change):
        # wait at least ``spread`` and spread them over as much again, so that they
        # land after the round's announcements, not among them (at N=1024 they were a
        # third of the CPU the stragglers waited for). Nothing is missed meanwhile: the
        # watch starts from the decision's revision.
        if self._stop.wait(self._spread * (1.0 + random.random())):
            return
        # One watcher for the round's whole membership: on v3 one stream, opened once
        # and again only after read_timeout of silence (or a failure), so a change
        # that every member sees (a key gone, the coordinator key deleted) is one
        # message to each, not one new watch request each (at N=4096, members that
        # had their ranks early opened 1.3-1.9 watch requests each before the last
        # rank); v2 long-polls, one request per call.
        with self._kv.watcher(self._rdzv, prefix=True) as watcher:
            if self._as_of is not None:
                watcher.after = self._as_of
            self._follow(watcher, listed=self._as_of is not None)

    def _follow(self, watcher: Watcher, listed: bool) -> None:
        """Apply the run's changes as ``watcher`` brings them until stopped
        (``listed``: the watcher is positioned; else list the run first)."""
        kv, rdzv = self._kv, self._rdzv
        idle = False  # the last wait was live to its end and found nothing
        while not self._stop.is_set():
            was_idle, idle = idle, False
            try:
                if not listed:
                    records, _ = watcher.reread(lambda: kv.list_tree(rdzv))
                    listed = True
                    self._load(records)
                    self._publish()
                events = watcher.next(IDLE_WATCH)
                for event in events:
                    self._apply(event)
                idle = not events
                if self._stop.is_set():
                    return  # what the last wait brought is for a round this node left
                self._publish()
            except WatchCompacted as exc:
                if was_idle and exc.current is not None:
                    # v2 keeps its last 1,000 events, and each heartbeat of each node
                    # is one of them: at 4,096 nodes beating every 3 s, under a second
                    # of history, so an idle watch request always ends out of it. That
                    # request watched until it ended and found nothing: go on from
                    # where etcd is now, not from a listing of every member's key
                    # (4,096 nodes each listing 4,096 keys every IDLE_WATCH drowned
                    # etcd). Only a change in the moment between that request's end
                    # and this answer is not seen.
                    watcher.after = max(watcher.after, exc.current)
                else:
                    listed = False
            except (RendezvousConnectionError, RendezvousStateError) as exc:
                if self._stop.is_set():
                    return
                log.warning("run %s: watching members failed: %s", self._run_id, exc)
                if self._stop.wait(1.0):
                    return
            except Exception:
                # Never end silently: log it, start over from a fresh listing.
                if self._stop.is_set():
                    return
                log.warning("run %s: the member watcher failed", self._run_id, exc_info=True)
                self.broken = True
                listed = False
                if self._stop.wait(1.0):
                    return

    def stop(self) -> None:
        """Stop watching (the thread ends with its current wait, at most
        ``IDLE_WATCH``)."""
        self._stop.set()
