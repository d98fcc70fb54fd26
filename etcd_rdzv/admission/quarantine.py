"""Quarantine: a host whose agents keep dying is kept out of the run for a while.

A *death* is an agent that ended without leaving: killed, frozen, its host lost. Its
keys then expire (its TTL runs out), where an agent that shuts down, or whose process
exits, deletes them at once. etcd tells the two apart nowhere (on v3 both are a
delete), so each agent says it is alive in a key of its own that only a leave
deletes: its *life*, ``<run>/lives/<host>/<node>``, written when it first joins and
deleted by :meth:`~.session.Session.release` (``shutdown()``, or the handler's
finalizer when its process exits). A life still there when another agent of the same
host starts is a death.

So the host's next agent finds them, at its first join (:func:`check_in`, before the
health gate): it moves each into a *death* record, ``<rdzv>/hosts/deaths/<host>/<node>``
with a TTL of ``quarantine_window`` (so etcd forgets a death that old), and counts the
host's deaths. At ``quarantine_deaths`` it excludes the host for ``quarantine_time``
seconds (:func:`.hosts.exclude`, ``by: quarantine``, the reason naming the count),
clears its deaths (the count starts anew when the quarantine ends) and raises
:class:`~.hosts.HostExcluded`, as a join from an excluded host does: the run goes on
without it, no round waits for it, and under torchrun its agent exits 0 with the
reason in its log.

What this assumes: one agent per host id at a time (two agents of one host id would
count each other as deaths: give each its own ``host_id``), and a host that comes
back (one that does not is not in the run anyway). A death counts from when the next
agent finds it, seconds after it happened when a scheduler restarts agents.

Records are untrusted input: a life's presence is what counts (its content is only
shown); a death record is parsed strictly by :func:`parse_death`, for ``status``.
Costs, with the option set: one listing and one write per agent start, one more
write and delete per death found; nothing per round, nothing while members train.
Without it: nothing.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import _keys
from .._commands import include_command
from .._kv import KV, Record
from ..config.params import HandlerSettings, host_id_error
from ..errors import LOGGED_AND_RAISED, RendezvousStateError
from .hosts import HostExcluded, duration_text, exclude, refusal_text

__all__ = [
    "LIFE_TTL",
    "Death",
    "check_in",
    "death_record",
    "deaths_in",
    "life_record",
    "parse_death",
]

log = logging.getLogger(__name__)

#: Seconds a life outlives its agent if nobody finds it (a host that never came back,
#: a run never deleted): an agent that lived longer and then died is not counted.
LIFE_TTL = 7 * 24 * 3600
_MAX_NODE = 1024  # characters of a node id kept
_MAX_TIME = 64  # characters of a time


@dataclass(frozen=True)
class Death:
    """One death of a host's agent, as the run's record holds it."""

    host: str
    node: str
    started: str  # when the agent that died started (ISO 8601; its clock; "" unknown)
    found: str  # when the host's next agent found it (ISO 8601; its clock)

    def to_json(self) -> dict[str, Any]:
        """As ``etcd-rdzv status --json`` shows it."""
        return {"host": self.host, "node": self.node, "started": self.started, "found": self.found}


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def life_record(host: str, node_id: str) -> str:
    """The value of an agent's life key."""
    return json.dumps({"host": host, "node": node_id, "started": _now()})


def death_record(host: str, node_id: str, started: str) -> str:
    """The value of a death key."""
    return json.dumps({"host": host, "node": node_id, "started": started, "found": _now()})


def _node_of(directory: str, key: str) -> str:
    """The node id a life or death key names; a name this package did not write is
    shown as it is (its presence counts all the same)."""
    name = key[len(directory) + 1 :]
    node = _keys.b64_text(name)
    return (node if node is not None and node.isprintable() else name)[:_MAX_NODE]


def _started(record: Record) -> str:
    """When a life began, if its record says so in the form this package writes
    (shown only: any other content makes it unknown)."""
    try:
        started = json.loads(record.value).get("started")
    except (ValueError, AttributeError):
        return ""
    return started if isinstance(started, str) and len(started) <= _MAX_TIME else ""


def parse_death(record: Record, deaths_dir: str) -> Death:
    """A death record; RendezvousStateError naming the key if it is not one this
    package wrote under that directory."""
    try:
        data: Any = json.loads(record.value)
        host, node = data["host"], data["node"]
        started, found = data.get("started", ""), data.get("found", "")
        if host_id_error(host) is not None:
            raise TypeError("host is not a host id")
        if not isinstance(node, str) or not node or len(node) > _MAX_NODE:
            raise TypeError("node is not a node id")
        for name, when in (("started", started), ("found", found)):
            if not isinstance(when, str) or len(when) > _MAX_TIME:
                raise TypeError(f"{name} is not a time")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RendezvousStateError(
            f"The death key {record.key!r} does not hold a death record: corrupt or "
            f"foreign state ({exc})."
        ) from exc
    if not record.key.startswith(f"{deaths_dir}/{_keys.b64_key(host)}/"):
        raise RendezvousStateError(
            f"The death key {record.key!r} holds the record of another host ({host!r})."
        )
    return Death(host, node, started, found)


def deaths_in(
    found: Sequence[Record], key_prefix: str, run_id: str, problems: list[str]
) -> tuple[Death, ...]:
    """The death records among ``found`` (a listing of the run's ``rdzv`` directory),
    by host and time found; a record that does not parse is added to ``problems``."""
    directory = _keys.deaths_dir(key_prefix, run_id)
    deaths: list[Death] = []
    for record in found:
        if record.key.startswith(directory + "/"):
            try:
                deaths.append(parse_death(record, directory))
            except RendezvousStateError as exc:
                problems.append(str(exc))
    return tuple(sorted(deaths, key=lambda d: (d.host, d.found, d.node)))


def check_in(kv: KV, s: HandlerSettings, node_id: str) -> str | None:
    """At an agent's first join: turn the host's lives left behind into deaths,
    quarantine the host if they are ``quarantine_deaths``, else write this agent's
    life. Returns the life's key (``None``: quarantine is off).

    Raises:
        HostExcluded: the host is quarantined now (logged at ERROR).
        RendezvousConnectionError: etcd did not answer.
    """
    if s.quarantine_deaths is None:
        return None
    host = s.host_id
    lives = _keys.lives_dir(s.key_prefix, s.run_id, host)
    deaths = _keys.deaths_dir(s.key_prefix, s.run_id, host)
    mine = f"{lives}/{_keys.b64_key(node_id)}"
    found, _ = kv.list_tree(lives)
    for record in found:
        if record.key == mine or not record.key.startswith(lives + "/"):
            continue
        node = _node_of(lives, record.key)
        kv.put(
            f"{deaths}/{_keys.b64_key(node)}",
            death_record(host, node, _started(record)),
            s.quarantine_window,
        )
        kv.delete(record.key)
        log.warning(
            "run %s: host %s: agent %s ended without leaving (a death, counted for quarantine)",
            s.run_id,
            host,
            node,
        )
    recorded, _ = kv.list_tree(deaths)
    count = sum(1 for r in recorded if r.key.startswith(deaths + "/"))
    if count >= s.quarantine_deaths:
        raise _quarantine(kv, s, node_id, count)
    kv.put(mine, life_record(host, node_id), LIFE_TTL)
    return mine


def _quarantine(kv: KV, s: HandlerSettings, node_id: str, count: int) -> HostExcluded:
    """Exclude this host for ``quarantine_time``; the error its agent ends with."""
    host = s.host_id
    reason = (
        f"quarantined: {count} death(s) of its agents within {duration_text(s.quarantine_window)} "
        f"(quarantine_deaths={s.quarantine_deaths})"
    )
    exclude(kv, s.key_prefix, s.run_id, host, reason, by="quarantine", seconds=s.quarantine_time)
    # A fresh count once the quarantine ends (or an operator includes the host).
    kv.delete_prefix(_keys.deaths_dir(s.key_prefix, s.run_id, host))
    include = include_command(s.run_id, host, s.key_prefix, kv.api)
    said = f"for {duration_text(s.quarantine_time)}: {reason}"
    text = refusal_text(s.run_id, host, node_id, said, include)
    log.error("run %s: %s", s.run_id, text, extra={LOGGED_AND_RAISED: True})
    return HostExcluded(text)
