"""Hosts kept out of a run: the exclusion list in etcd.

An exclusion names a host (its ``host_id``, see :func:`etcd_rdzv.config.params.host_id`) and
lives at ``<rdzv>/hosts/excluded/<base64(host)>`` (:func:`etcd_rdzv._keys.excluded_key`)
as ``{"host", "reason", "by", "at", "for"}``: why, who (``operator`` or
``quarantine``), when as the writer's clock saw it, and for how many seconds (``null``:
until included again). An exclusion for a time is an etcd key with that TTL, so etcd
ends it, not a clock.

While a host is excluded, a join from it writes nothing (its transaction compares the
exclusion key: absent) and fails with :class:`HostExcluded`; the coordinator leaves
such a host's nodes out of the round it forms, and members count a member on such a
host as gone, so the others re-form without it.

Records are untrusted input: :func:`parse_exclusion` is strict and raises
:class:`~etcd_rdzv.errors.RendezvousStateError` naming the key.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

from .. import _keys
from .._kv import KV, Record
from ..config.params import host_id_error
from ..errors import RendezvousGracefulExitError, RendezvousStateError

__all__ = [
    "BY",
    "MAX_REASON",
    "Exclusion",
    "HostExcluded",
    "exclude",
    "exclusion_record",
    "host_of_key",
    "include",
    "parse_exclusion",
    "refusal_text",
]

#: Who may exclude a host.
BY = ("operator", "quarantine")
#: Characters of a reason kept.
MAX_REASON = 512


@dataclass(frozen=True)
class Exclusion:
    """A host kept out of the run's rounds."""

    host: str
    reason: str
    by: str
    at: str  # ISO 8601, the writer's clock (shown, never compared)
    seconds: int | None  # for how long it was excluded; None: until included
    #: Seconds until etcd ends it (its key's TTL when read: shown by status, never
    #: compared with a clock); ``None``: not read, or until included.
    left: int | None = None


class HostExcluded(RendezvousGracefulExitError):
    """This node's host is excluded from the run: it does not join (and under
    torchrun its agent exits 0, as a spare does when a job ends)."""


def duration_text(seconds: int) -> str:
    """A duration as ``etcd-rdzv exclude --for`` takes it, in the largest unit it is a
    whole number of: ``43200`` -> ``12h``, ``90`` -> ``90s`` (what was typed, for the
    usual forms)."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def refusal_text(run_id: str, host: str, node_id: str, said: str, include: str) -> str:
    """What a node on an excluded host ends with: the host, the run, ``said`` (who
    excluded it, for how long, why) and ``include``, the command that lets it back."""
    return (
        f"Host {host!r} is excluded from run {run_id!r} {said}. Node {node_id!r} does "
        f"not join. To let the host back in: {include}"
    )


def host_of_key(excluded_dir: str, key: str) -> str | None:
    """The host an exclusion key names (``None``: not such a key)."""
    if not key.startswith(excluded_dir + "/"):
        return None
    host = _keys.b64_text(key[len(excluded_dir) + 1 :])
    return None if host is None or host_id_error(host) is not None else host


def exclusion_record(host: str, reason: str, by: str, seconds: int | None) -> str:
    """The value of an exclusion key."""
    at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    data = {"host": host, "reason": reason[:MAX_REASON], "by": by, "at": at, "for": seconds}
    return json.dumps(data)


def parse_exclusion(record: Record, excluded_dir: str) -> Exclusion:
    """An exclusion key's record; RendezvousStateError naming the key if it is not one
    this package wrote for that host."""
    try:
        data: Any = json.loads(record.value)
        host, reason, by = data["host"], data.get("reason", ""), data.get("by", "operator")
        at, seconds = data.get("at", ""), data.get("for")
        if host_id_error(host) is not None:
            raise TypeError("host is not a host id")
        if not isinstance(reason, str) or len(reason) > MAX_REASON:
            raise TypeError("reason is not a short text")
        if by not in BY:
            raise TypeError(f"by is not one of {', '.join(BY)}")
        if not isinstance(at, str) or len(at) > 64:
            raise TypeError("at is not a time")
        if seconds is not None and (
            isinstance(seconds, bool) or not isinstance(seconds, int) or seconds < 1
        ):
            raise TypeError("for is not a number of seconds")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RendezvousStateError(
            f"The exclusion key {record.key!r} does not hold an exclusion record: corrupt "
            f"or foreign state ({exc})."
        ) from exc
    if host_of_key(excluded_dir, record.key) != host:
        raise RendezvousStateError(
            f"The exclusion key {record.key!r} holds the record of another host ({host!r})."
        )
    return Exclusion(host, reason, by, at, seconds)


def _check(host: str, reason: str, seconds: int | None) -> None:
    problem = host_id_error(host)
    if problem is not None:
        raise ValueError(f"The host must be {problem}, got {host[:80]!r}.")
    if len(reason) > MAX_REASON:
        raise ValueError(f"The reason must be at most {MAX_REASON} characters.")
    if seconds is not None and seconds < 1:
        raise ValueError(f"An exclusion lasts at least 1 second, got {seconds!r}.")


def exclude(
    kv: KV,
    key_prefix: str,
    run_id: str,
    host: str,
    reason: str = "",
    *,
    by: str = "operator",
    seconds: int | None = None,
) -> None:
    """Keep ``host`` out of the run's rounds (``seconds``: for that long; ``None``:
    until :func:`include`). Raises ValueError for a bad host, reason or duration
    before any request."""
    _check(host, reason, seconds)
    key = _keys.excluded_key(key_prefix, run_id, host)
    kv.put(key, exclusion_record(host, reason, by, seconds), seconds)


def include(kv: KV, key_prefix: str, run_id: str, host: str) -> bool:
    """Let ``host`` join the run's rounds again; whether it was excluded."""
    _check(host, "", None)
    return kv.delete(_keys.excluded_key(key_prefix, run_id, host))
