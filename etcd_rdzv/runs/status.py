"""A run as operators see it: its status, read once or each time it changes.

The library API of the ``etcd-rdzv`` command line: the CLI formats what
:func:`read_status` returns (:func:`watch_run`: each time the run changes). The
rendezvous records are parsed by :mod:`etcd_rdzv.rendezvous.records`, the one place
that reads them; the state of torch's dynamic handler (``etcd-rdzv-dynamic``) by
:mod:`.torch_state`, which never runs its pickle. Closing a run is the rendezvous
core's (:func:`etcd_rdzv.rendezvous.incarnation.close_run`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import _keys
from .._kv import KV, Record, WatchCompacted
from ..admission.health import HealthFailure, failures_in
from ..admission.hosts import Exclusion, parse_exclusion
from ..admission.quarantine import Death, deaths_in
from ..errors import RendezvousError, RendezvousStateError
from ..rendezvous import decisions, records
from ..rendezvous.roster import read_whole
from .torch_state import TorchState, parse_state_value

__all__ = [
    "Member",
    "RunStatus",
    "Waiting",
    "hosts_seen",
    "read_run",
    "read_status",
    "run_ids",
    "watch_run",
]


#: :attr:`RunStatus.handler` of a run of etcd_rdzv's own handler (torchrun
#: ``etcd-rdzv`` or ``etcd-rdzv-static``, ``etcd-rdzv join``).
NATIVE = "native"
#: :attr:`RunStatus.handler` of a run of torch's ``DynamicRendezvousHandler`` over our
#: backend (torchrun ``etcd-rdzv-dynamic``).
DYNAMIC = "dynamic"


@dataclass(frozen=True)
class Member:
    """A member of a completed round.

    Of a native run: a member whose join key is gone (it left or died) is not
    ``alive``; its address and host are still shown, from the round's result.
    Of a dynamic run: torch's node name (``<addr>_<pid>_<local_id>``), its address,
    always alive (torch drops a node whose heartbeats stopped the next time a node
    syncs), and its last heartbeat as its own clock wrote it.
    """

    rank: int
    node: str
    addr: str | None  # None: not known (a result of an older version, its key gone)
    last_heartbeat: dt.datetime | None = None  # dynamic runs only
    group: str | None = None  # its node_group (native runs; None: none, or key gone)
    host: str | None = None  # its host_id (native runs; None: not known)
    alive: bool = True  # False: its join key is gone (it left or died)


@dataclass(frozen=True)
class Waiting:
    """A node with a join key in a round that has not completed (of a dynamic run:
    a participant of the round that forms, or on torch's wait or redundancy list)."""

    round: int
    node: str
    addr: str
    #: A new round could not take this node (the group is at max_nodes, or the nodes
    #: waiting are short of a whole node_unit): no member restarts for it.
    spare: bool = False
    last_heartbeat: dt.datetime | None = None  # dynamic runs only
    group: str | None = None  # its node_group (native runs)
    host: str | None = None  # its host_id (native runs)


@dataclass(frozen=True)
class RunStatus:
    """What :func:`read_status` found under one run."""

    run_id: str
    closed: bool
    round: int  # the round being formed or run now (0: nothing yet)
    hint: int | None
    completed_round: int | None
    members: tuple[Member, ...]
    waiting: tuple[Waiting, ...]
    problems: tuple[str, ...] = ()
    #: The latest round that failed after the last completed one (a rank claimed
    #: twice, say): ``(round, why)``.
    failure: tuple[int, str] | None = None
    #: Whose keys the run has: :data:`NATIVE`, :data:`DYNAMIC`, or ``None`` (none).
    handler: str | None = None
    #: Dynamic runs: when the forming round completes with the nodes it has (the end
    #: of its last call), as the writer's clock saw it.
    deadline: dt.datetime | None = None
    #: Hosts whose latest health check failed (native runs), by host.
    health: tuple[HealthFailure, ...] = ()
    #: Hosts kept out of the run (``etcd-rdzv exclude``, quarantine).
    excluded: tuple[Exclusion, ...] = ()
    #: Deaths of agents within ``quarantine_window``, counted towards quarantine.
    deaths: tuple[Death, ...] = ()
    #: Whether the run has any key (under its ``rdzv`` directory, or torch's state) in
    #: this keyspace. A run with keys but no round yet (only an exclusion, say) exists.
    exists: bool = True
    #: Why the run is in trouble on two APIs (it has keys in the other API's
    #: keyspace), or ``None``; filled in by the caller that can check (the CLI).
    other_api: str | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict of one schema (``docs/cli.md``): every key is always
        present, ``null`` where there is nothing to say (a native node's
        ``last_heartbeat``, a dynamic node's ``host`` and ``group``). Times are ISO
        8601 strings."""
        problems = list(self.problems) + ([self.other_api] if self.other_api else [])
        return {
            "run_id": self.run_id,
            "exists": self.exists,
            "handler": self.handler,
            "closed": self.closed,
            "round": self.round,
            "hint": self.hint,
            "completed_round": self.completed_round,
            "deadline": _iso(self.deadline),
            "members": [
                {
                    "rank": m.rank,
                    "node": m.node,
                    "addr": m.addr,
                    "alive": m.alive,
                    "host": m.host,
                    "group": m.group,
                    "last_heartbeat": _iso(m.last_heartbeat),
                }
                for m in self.members
            ],
            "waiting": [
                {
                    "round": w.round,
                    "node": w.node,
                    "addr": w.addr,
                    "spare": w.spare,
                    "host": w.host,
                    "group": w.group,
                    "last_heartbeat": _iso(w.last_heartbeat),
                }
                for w in self.waiting
            ],
            "failure": None
            if self.failure is None
            else {"round": self.failure[0], "reason": self.failure[1]},
            "excluded": [
                {
                    "host": e.host,
                    "reason": e.reason,
                    "by": e.by,
                    "at": e.at or None,
                    "for": e.seconds,
                    "ends_in": e.left,
                }
                for e in self.excluded
            ],
            "health": [h.to_json() for h in self.health],
            "deaths": [d.to_json() for d in self.deaths],
            "other_api": self.other_api,
            "problems": problems,
        }


def _iso(when: dt.datetime | None) -> str | None:
    return None if when is None else when.isoformat()


def read_status(
    found: Sequence[Record],
    key_prefix: str,
    run_id: str,
    state: Record | None = None,
    wholes: Mapping[int, records.Outcome] | None = None,
) -> RunStatus:
    """The status of ``run_id`` from the records under its ``rdzv`` directory and
    its ``state`` key (torch's dynamic handler), if there is one.

    Pure: the records come from ``kv.list_tree(_keys.rdzv_dir(key_prefix, run_id))``
    and ``kv.get(_keys.state_key(key_prefix, run_id))`` (:func:`read_run` reads
    them). Records that do not parse are skipped and described in ``problems``, a
    state that does not decode too. A run with the native handler's keys is shown as
    such; its state key, if any, only as a problem (one run id used by both handlers).
    """
    rdzv = _keys.rdzv_dir(key_prefix, run_id)
    closed = False
    hint: int | None = None
    results: dict[int, records.Outcome] = {}
    faults: dict[int, str] = {}
    # round -> id -> (addr, group, host)
    nodes: dict[int, dict[str, tuple[str, str | None, str | None]]] = {}
    problems: list[str] = []
    health = failures_in(found, key_prefix, run_id, problems)
    deaths = deaths_in(found, key_prefix, run_id, problems)
    excluded: list[Exclusion] = []
    excluded_dir = _keys.excluded_dir(key_prefix, run_id)
    for record in found:
        if record.key == rdzv + "/closed":
            closed = True
            continue
        if record.key.startswith(excluded_dir + "/"):
            try:
                excluded.append(parse_exclusion(record, excluded_dir))
            except RendezvousStateError as exc:
                problems.append(str(exc))
            continue
        if record.key == rdzv + "/round":
            hint = records.hint_of(record)
            if hint is None:
                problems.append(f"{record.key}: not a round number: {record.value!r}")
            continue
        where = _keys.round_of(rdzv, record.key)
        if where is None:
            continue
        round_no, rest = where
        try:
            if rest == "result":
                outcome = records.parse_result(record)
                if outcome.buckets:  # a large round's: its lists were read apart
                    outcome = (wholes or {}).get(round_no, outcome)
                if outcome.error is not None:
                    faults[round_no] = outcome.error
                else:
                    results[round_no] = outcome
            elif rest.startswith("nodes/"):
                node = records.parse_node(record)
                nodes.setdefault(round_no, {})[node.node_id] = (
                    node.addr,
                    node.group,
                    node.host,
                )
        except RendezvousStateError as exc:
            problems.append(f"{record.key}: not a record of etcd_rdzv's handler ({exc})")
    completed = max(results) if results else None
    if completed is not None and results[completed].buckets:
        problems.append(f"round {completed}: its member list could not be read")
    present = max([*results, *faults, *nodes], default=0)
    current = max(present, hint or 0)
    members: tuple[Member, ...] = ()
    full = False
    later = [
        (round_no, node, addr, group, host)
        for round_no in sorted(nodes)
        if completed is None or round_no > completed
        for node, (addr, group, host) in sorted(nodes[round_no].items())
    ]
    if completed is not None:
        alive = nodes.get(completed, {})
        outcome = results[completed]
        members = tuple(
            Member(
                rank,
                node,
                alive[node][0] if node in alive else (outcome.addrs[rank] or None),
                group=alive[node][1] if node in alive else None,
                host=alive[node][2] if node in alive else _host_of(outcome, rank),
                alive=node in alive,
            )
            for rank, node in enumerate(outcome.members)
        )
        # The same rule as num_nodes_waiting(): later nodes are spares while the group
        # is whole and they could not enlarge it by a whole node_unit (up to max_nodes).
        full = (
            outcome.max_nodes is not None
            and all(m.alive for m in members)
            and not decisions.nodes_waiting(
                len(members), outcome.max_nodes, len(later), 0, outcome.node_unit
            )
        )
    waiting = tuple(
        Waiting(round_no, node, addr, spare=full, group=group, host=host)
        for round_no, node, addr, group, host in later
    )
    last_fault = max(faults, default=None)
    failure = (
        (last_fault, faults[last_fault])
        if last_fault is not None and (completed is None or last_fault > completed)
        else None
    )
    native = bool(nodes or results or faults or closed or hint is not None or health or deaths)
    torch_state: TorchState | None = None
    if state is not None:
        try:
            torch_state = parse_state_value(state.value, state.key)
        except RendezvousStateError as exc:
            problems.append(str(exc))
        if torch_state is not None and native:
            problems.append(
                f"{state.key}: torch's dynamic rendezvous state (round {torch_state.round}) "
                "beside the native handler's keys: the run id is used by both handlers; "
                "shown: the native handler's"
            )
    if torch_state is not None and not native:
        return _dynamic_status(run_id, torch_state, tuple(problems))
    exists = bool(found) or state is not None
    return RunStatus(
        run_id,
        closed,
        current,
        hint,
        completed,
        members,
        waiting,
        tuple(problems),
        failure,
        handler=NATIVE if native else None,
        health=health,
        deaths=deaths,
        excluded=tuple(sorted(excluded, key=lambda e: e.host)),
        exists=exists,
    )


def _host_of(outcome: records.Outcome, rank: int) -> str | None:
    """The host of rank ``rank`` as the round's result names it (``None``: not known)."""
    return outcome.hosts[rank] or None if rank < len(outcome.hosts) else None


def _dynamic_status(run_id: str, state: TorchState, problems: tuple[str, ...]) -> RunStatus:
    """torch's state as a status: a complete round's participants are its members
    (in rank order); while a round forms, its participants wait in it (rank 0 each:
    torch ranks them at completion). The wait list waits for the next round, the
    redundancy list (torch's spares) too, marked spare."""
    beats = dict(state.last_heartbeats)
    participants = tuple(
        (node.node_id, node.addr, rank, beats.get(node)) for node, rank in state.participants
    )
    members: tuple[Member, ...] = ()
    waiting: list[Waiting] = []
    if state.complete:
        members = tuple(Member(rank, nid, addr, at) for nid, addr, rank, at in participants)
    else:
        waiting += [Waiting(state.round, nid, addr, False, at) for nid, addr, _, at in participants]
    for nodes, spare in ((state.wait_list, False), (state.redundancy_list, True)):
        waiting += [Waiting(state.round + 1, n.node_id, n.addr, spare, beats.get(n)) for n in nodes]
    return RunStatus(
        run_id,
        state.closed,
        state.round,
        None,
        state.round if state.complete else None,
        members,
        tuple(waiting),
        problems,
        handler=DYNAMIC,
        deadline=state.deadline,
    )


def _read(kv: KV, key_prefix: str, run_id: str) -> tuple[RunStatus, int]:
    """The status of ``run_id`` and a revision it is at least as new as."""
    found, listed_at = kv.list_tree(_keys.rdzv_dir(key_prefix, run_id))
    state, read_at = kv.get(_keys.state_key(key_prefix, run_id))
    wholes = _wholes(kv, key_prefix, run_id, found)
    status = read_status(found, key_prefix, run_id, state, wholes)
    if any(e.seconds for e in status.excluded):
        status = dataclasses.replace(status, excluded=_ends(kv, key_prefix, run_id, status))
    # The earlier of the two reads: a watch from just after it misses no change to
    # either (a change seen twice only costs a read that finds nothing new).
    return status, min(listed_at, read_at)


def _ends(kv: KV, key_prefix: str, run_id: str, status: RunStatus) -> tuple[Exclusion, ...]:
    """The exclusions of ``status``, those for a time with the seconds etcd gives them
    still (their key's TTL now: no clock of another host is read)."""
    return tuple(
        dataclasses.replace(e, left=kv.time_left(_keys.excluded_key(key_prefix, run_id, e.host)))
        if e.seconds
        else e
        for e in status.excluded
    )


def _wholes(
    kv: KV, key_prefix: str, run_id: str, found: Sequence[Record]
) -> dict[int, records.Outcome]:
    """The member list of the latest round whose result is slim (a large round's:
    see :mod:`.roster`), read from its roster directory; none if it cannot be."""
    rdzv = _keys.rdzv_dir(key_prefix, run_id)
    slim: dict[int, records.Outcome] = {}
    for record in found:
        where = _keys.round_of(rdzv, record.key)
        if where is not None and where[1] == "result":
            try:
                outcome = records.parse_result(record)
            except RendezvousStateError:
                continue
            if outcome.buckets:
                slim[where[0]] = outcome
    if not slim:
        return {}
    latest = max(slim)
    try:
        return {latest: read_whole(kv, key_prefix, run_id, latest, slim[latest])}
    except RendezvousStateError:
        return {}


def _within(key: str, directory: str) -> bool:
    """Whether ``key`` is ``directory`` or below it (v2 reports a directory's
    deletion under the directory's own key)."""
    return key == directory or key.startswith(directory + "/")


def read_run(kv: KV, key_prefix: str, run_id: str) -> RunStatus:
    """Read the status of ``run_id`` from etcd: a listing of the native handler's
    keys and a read of torch's dynamic state, the only keys of the run it reads."""
    return _read(kv, key_prefix, run_id)[0]


def watch_run(kv: KV, key_prefix: str, run_id: str) -> Generator[RunStatus, None, None]:
    """The status of ``run_id`` now, then again each time it changes, forever.

    Driven by one etcd watch of the run's directory (no polling): a change of the
    native handler's keys or of torch's state makes one new read, and a status equal
    to the last one yielded is not yielded again. The round stores' keys
    (``<run>/store/``) are not read and wake nothing but the filter. Closing the
    generator (or an exception in it, Ctrl-C included) closes the watch.

    Raises:
        RendezvousConnectionError: etcd stopped answering.
    """
    store = _keys.store_dir(key_prefix, run_id)
    with kv.watcher(_keys.run_dir(key_prefix, run_id), prefix=True) as watcher:
        last, _ = watcher.reread(lambda: _read(kv, key_prefix, run_id))
        yield last
        while True:
            try:
                events = watcher.next(None)
            except WatchCompacted:  # the history went: read anew, watch from there
                status, _ = watcher.reread(lambda: _read(kv, key_prefix, run_id))
            else:
                if all(_within(e.record.key, store) for e in events):
                    continue
                status = read_run(kv, key_prefix, run_id)
            if status != last:
                last = status
                yield status


def run_ids(kv: KV, key_prefix: str) -> list[str] | None:
    """The ids of the runs that have keys under ``key_prefix`` in ``kv``'s keyspace,
    sorted; ``None`` when they cannot be listed (too many keys to read at once, say).
    One listing of the whole prefix: for telling a mistyped run id, not for a loop."""
    root = key_prefix.rstrip("/")
    try:
        found, _ = kv.list_tree(root)
    except RendezvousError:  # no permission there, too much to read: no list
        return None
    ids: set[str] = set()
    for record in found:
        segment = record.key[len(root) + 1 :].split("/", 1)[0]
        run_id = _keys.b64_text(segment[1:]) if segment.startswith("~") else segment
        if run_id:
            ids.add(run_id)
    return sorted(ids)


def hosts_seen(status: RunStatus) -> list[str]:
    """The hosts ``status`` names: of its members (the result's, for those gone),
    waiting nodes, exclusions, failed health checks and counted deaths; sorted."""
    named = [m.host for m in status.members] + [w.host for w in status.waiting]
    named += [e.host for e in status.excluded] + [h.host for h in status.health]
    named += [d.host for d in status.deaths]
    return sorted({host for host in named if host})
