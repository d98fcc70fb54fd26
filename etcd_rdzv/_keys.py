"""The key layout in etcd, in one place.

::

    <key_prefix>/<run>/state          rendezvous state (backend), TTL 2 h, refreshed on write
    <key_prefix>/<run>/store/<key>    store keys, each with a TTL refreshed on write
    <key_prefix>/<run>/store/r<N>/<key>  the store of round N of the native handler
    <key_prefix>/<run>/store/nvrx/<job>/wrapper/<key>  NVIDIA's in-process Wrapper: its
                                         store for one job of the run
    <key_prefix>/<run>/store/nvrx/<job>/pg<I>/<key>  that job's process group's store in
                                         the Wrapper's restart iteration I
    <key_prefix>/<run>/rdzv/closed    native handler: the run is closed
    <key_prefix>/<run>/rdzv/round     native handler: hint, the round being formed
    <key_prefix>/<run>/rdzv/incarnation  native handler: the job that uses the run id now
    <key_prefix>/<run>/rdzv/r<N>/nodes/<node>  a node's join key (TTL = its liveness)
    <key_prefix>/<run>/rdzv/r<N>/result        the members of round N, in rank order
    <key_prefix>/<run>/rdzv/r<N>/coord         the coordinator of round N while it forms
    <key_prefix>/<run>/rdzv/hosts/excluded/<host>  a host kept out of the run's rounds
    <key_prefix>/<run>/rdzv/hosts/health/<host>    a host's latest failed health check
    <key_prefix>/<run>/rdzv/hosts/deaths/<host>/<node>  a death of the host's agent
    <key_prefix>/<run>/lives/<host>/<node>     quarantine: an agent that has not left
    <key_prefix>/<run>/roster/r<N>/<coord>/members  a large round's members (and .../<b>:
                                               bucket b of its ranks)

``<run>`` (and ``<job>``) is the run id itself when it is made of ``[A-Za-z0-9._-]`` only,
otherwise ``~`` followed by its URL-safe base64 (no padding), so that ``/``, spaces and
non-ASCII characters never create extra directories or collide with a plain id. Store keys are
always URL-safe base64.
"""

from __future__ import annotations

import base64
import binascii
import re

__all__ = [
    "b64_key",
    "b64_text",
    "closed_key",
    "coord_key",
    "deaths_dir",
    "excluded_dir",
    "excluded_key",
    "health_key",
    "hint_key",
    "hosts_dir",
    "incarnation_key",
    "lives_dir",
    "node_key",
    "nvrx_dir",
    "parse_round",
    "rdzv_dir",
    "result_key",
    "roster_dir",
    "rosters_dir",
    "round_dir",
    "round_of",
    "run_dir",
    "state_key",
    "store_dir",
]

_PLAIN = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_ROUND = re.compile(r"^[1-9][0-9]{0,11}\Z")  # a round number: ASCII, no leading zero


def b64_key(raw: str | bytes) -> str:
    """URL-safe base64 without padding: safe as one etcd path segment."""
    data = raw.encode("utf-8") if isinstance(raw, str) else raw
    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


def b64_text(name: str) -> str | None:
    """The text a key segment made by :func:`b64_key` encodes; ``None`` when the
    segment is not such an encoding (not base64, not UTF-8, or not canonical)."""
    try:
        text = base64.urlsafe_b64decode(name + "=" * (-len(name) % 4)).decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    return text if b64_key(text) == name else None


def run_dir(key_prefix: str, run_id: str) -> str:
    """The directory of one run.

    Raises:
        ValueError: ``run_id`` is empty or not a string.
    """
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"The run id must be a non-empty string, got {run_id!r}.")
    return f"{key_prefix.rstrip('/')}/{_segment(run_id)}"


def _segment(name: str) -> str:
    """``name`` as one path segment: itself if plain, else ``~`` and its base64."""
    if _PLAIN.match(name) and name not in (".", ".."):
        return name
    return "~" + b64_key(name)


def nvrx_dir(key_prefix: str, run_id: str, job: str) -> str:
    """The stores of NVIDIA's in-process ``Wrapper`` for one job of the run (see
    :mod:`etcd_rdzv.inprocess.nvrx`): ``wrapper`` and ``pg<I>`` below it.

    Raises:
        ValueError: ``run_id`` or ``job`` is empty or not a string.
    """
    if not isinstance(job, str) or not job:
        raise ValueError(f"The job id must be a non-empty string, got {job!r}.")
    return f"{store_dir(key_prefix, run_id)}/nvrx/{_segment(job)}"


def state_key(key_prefix: str, run_id: str) -> str:
    return run_dir(key_prefix, run_id) + "/state"


def store_dir(key_prefix: str, run_id: str) -> str:
    return run_dir(key_prefix, run_id) + "/store"


def rdzv_dir(key_prefix: str, run_id: str) -> str:
    return run_dir(key_prefix, run_id) + "/rdzv"


def closed_key(key_prefix: str, run_id: str) -> str:
    return rdzv_dir(key_prefix, run_id) + "/closed"


def ended_key(key_prefix: str, run_id: str) -> str:
    """A run closed moments ago: written with the closed marker on a lease of its own
    (:data:`etcd_rdzv.rendezvous.records.ENDED_TTL`), so etcd says how recent it is."""
    return rdzv_dir(key_prefix, run_id) + "/ended"


def hint_key(key_prefix: str, run_id: str) -> str:
    return rdzv_dir(key_prefix, run_id) + "/round"


def incarnation_key(key_prefix: str, run_id: str) -> str:
    """The run's incarnation: a random id of the job that uses the run id now (see
    :mod:`etcd_rdzv.rendezvous.incarnation`)."""
    return rdzv_dir(key_prefix, run_id) + "/incarnation"


def hosts_dir(key_prefix: str, run_id: str) -> str:
    """What the run knows of hosts (``host_id``): exclusions, health-check failures."""
    return rdzv_dir(key_prefix, run_id) + "/hosts"


def excluded_dir(key_prefix: str, run_id: str) -> str:
    """The hosts kept out of the run's rounds (by an operator, or quarantined)."""
    return hosts_dir(key_prefix, run_id) + "/excluded"


def excluded_key(key_prefix: str, run_id: str, host: str) -> str:
    """A host kept out of the run's rounds."""
    return f"{excluded_dir(key_prefix, run_id)}/{b64_key(host)}"


def health_key(key_prefix: str, run_id: str, host: str) -> str:
    """A host's latest failed health check."""
    return f"{hosts_dir(key_prefix, run_id)}/health/{b64_key(host)}"


def deaths_dir(key_prefix: str, run_id: str, host: str | None = None) -> str:
    """Quarantine: the deaths of the run's agents (``host``: of that host's)."""
    directory = hosts_dir(key_prefix, run_id) + "/deaths"
    return directory if host is None else f"{directory}/{b64_key(host)}"


def lives_dir(key_prefix: str, run_id: str, host: str) -> str:
    """Quarantine: the agents of ``host`` that have not left (outside ``rdzv``, which
    every member watches: one per agent start would wake them all)."""
    return f"{run_dir(key_prefix, run_id)}/lives/{b64_key(host)}"


def round_dir(key_prefix: str, run_id: str, round_no: int) -> str:
    return f"{rdzv_dir(key_prefix, run_id)}/r{round_no}"


def node_key(key_prefix: str, run_id: str, round_no: int, node_id: str) -> str:
    return f"{round_dir(key_prefix, run_id, round_no)}/nodes/{b64_key(node_id)}"


def result_key(key_prefix: str, run_id: str, round_no: int) -> str:
    return round_dir(key_prefix, run_id, round_no) + "/result"


def gone_dir(key_prefix: str, run_id: str, round_no: int) -> str:
    """Where the nodes that gave up on a round mark that they left it (see
    :func:`etcd_rdzv.rendezvous.completion.withdraw`)."""
    return round_dir(key_prefix, run_id, round_no) + "/gone"


def gone_key(key_prefix: str, run_id: str, round_no: int, node_id: str) -> str:
    return f"{gone_dir(key_prefix, run_id, round_no)}/{b64_key(node_id)}"


def coord_key(key_prefix: str, run_id: str, round_no: int) -> str:
    return round_dir(key_prefix, run_id, round_no) + "/coord"


def roster_dir(key_prefix: str, run_id: str, round_no: int, coordinator: str) -> str:
    """Where the coordinator of a large round puts its member list and rank buckets
    (see :mod:`etcd_rdzv.rendezvous.roster`): outside ``rdzv``, which every member
    watches, so that no member receives them unasked."""
    return f"{rosters_dir(key_prefix, run_id)}/r{round_no}/{b64_key(coordinator)}"


def rosters_dir(key_prefix: str, run_id: str) -> str:
    """The rosters of every round (see :func:`roster_dir`)."""
    return run_dir(key_prefix, run_id) + "/roster"


def round_of(rdzv: str, key: str) -> tuple[int, str] | None:
    """For a key under ``rdzv``: ``(round, rest)``, e.g. ``(3, "nodes/<id>")``."""
    if not key.startswith(rdzv + "/r"):
        return None
    head, _, rest = key[len(rdzv) + 2 :].partition("/")
    number = parse_round(head)
    return None if number is None else (number, rest)


def parse_round(text: str) -> int | None:
    """A round number as this package writes it (ASCII digits, no leading zero, at
    most 12), or ``None``. Untrusted text: str.isdigit() would take "²", which int()
    refuses, and unbounded digits."""
    return int(text) if _ROUND.match(text) else None
