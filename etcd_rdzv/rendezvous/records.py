"""The native handler's records in etcd: how each is written and how it is read back.

Everything the handler (and ``etcd-rdzv status``) reads from etcd is untrusted input:
another program, an older version or a person with ``etcdctl`` may have written it.
This module is the one place that parses those records; a record that does not fit
raises :class:`~etcd_rdzv.errors.RendezvousStateError` naming its key.

The records (keys in :mod:`etcd_rdzv._keys`):

* join key ``r<N>/nodes/<node>``: ``{"id", "addr", "prev_rank"}``, ``"host"`` (its
  ``host_id``), ``"rank"`` (the
  static handler: the rank the node was given) and ``"group"`` (its ``node_group``),
  each only when set;
* result ``r<N>/result``: ``{"members", "addrs", "as_of", "max_nodes", "node_unit",
  "hosts"}``: node ids, addresses (and host ids) in rank order, the etcd revision the
  coordinator decided at, and the run's bounds as it had them (``node_unit`` only when
  above 1, ``hosts`` only when known); or a
  fault, ``{"error", "members"}``: the round failed for those nodes (a rank claimed
  twice, say), and why;
* coordinator key ``r<N>/coord``: ``{"id"}`` while the round forms, then the
  announcement ``{"id", "packed": "..."}`` (the result as it landed, zlib-compressed,
  in base64) or ``{"id", "closed": true}``; ``{"id", "result": {...}}`` (the result
  uncompressed) is read as well;
* hint ``round``: the number of the round being formed, as decimal digits;
* ``closed``: present when the run is closed (its value is not read).
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .. import _keys
from .._kv import Record
from ..config.params import host_id_error, node_group_error
from ..errors import RendezvousStateError
from . import decisions as D

__all__ = [
    "ENDED_TTL",
    "META_TTL",
    "Outcome",
    "announcement",
    "coordinator_of",
    "coordinator_record",
    "fault_record",
    "hint_of",
    "join_keys",
    "named",
    "node_record",
    "parse_announcement",
    "parse_node",
    "parse_result",
    "result_record",
    "slim_record",
]

#: Seconds the result, hint and closed keys outlive a dead run.
META_TTL = 7200
#: Seconds after a close during which a new process does not start the closed run
#: again (``restart_closed_run``): a node of the job that ended, started before the
#: close but slow to reach etcd (a spare, say), must meet the closed run, not start
#: the job anew. A job started again sooner fails with RendezvousClosedError (its
#: scheduler's retry then starts it).
ENDED_TTL = 15

_MAX_ID = 1024  # characters in a node id or address
_MAX_ERROR = 4096  # characters in a fault's reason
_MAX_RANK = 10**9  # a rank this package writes is below this
_MAX_SHOWN = 80  # characters of a bad value quoted in an error
#: Bytes a packed result may unpack to: 10,000 members with ids and addresses of 1024
#: characters fit; a small record that would unpack to more is refused unread.
_MAX_UNPACKED = 32 * 2**20


@dataclass(frozen=True)
class Outcome:
    """A completed round as the result key holds it."""

    members: tuple[str, ...]  # node ids in rank order
    addrs: tuple[str, ...]  # their addresses, in rank order
    as_of: int | None  # the etcd revision the coordinator decided at
    max_nodes: int | None = None  # the run's max_nodes as the coordinator had it
    error: str | None = None  # a fault: the round failed for ``members``, and why
    node_unit: int = 1  # the run's node_unit as the coordinator had it
    # A slim announcement (see .roster): no lists, but the world size, rank 0's
    # address and the number of rank buckets (0: not slim).
    buckets: int = 0
    world: int = 0
    master: str = ""
    by: str = ""  # the coordinator whose roster directory holds the lists (slim)
    # The members' host ids in rank order ("": unknown), so that status can name the
    # host of a member whose join key is gone; () in results of older versions.
    hosts: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        """The world size."""
        return self.world if self.buckets else len(self.members)


# -- writing ------------------------------------------------------------------------------


def node_record(
    node_id: str,
    addr: str,
    prev_rank: int | None,
    rank: int | None = None,
    group: str | None = None,
    host: str | None = None,
) -> str:
    """The value of a node's join key (``rank``: the static handler's; ``group``: the
    node's ``node_group``; ``host``: its ``host_id``)."""
    data: dict[str, Any] = {"id": node_id, "addr": addr, "prev_rank": prev_rank}
    if host is not None:
        data["host"] = host
    if rank is not None:
        data["rank"] = rank
    if group is not None:
        data["group"] = group
    return json.dumps(data)


def coordinator_record(node_id: str) -> str:
    """The value of the coordinator key while ``node_id`` coordinates."""
    return json.dumps({"id": node_id})


def result_record(
    members: tuple[str, ...],
    addrs: tuple[str, ...],
    as_of: int,
    max_nodes: int,
    node_unit: int = 1,
    hosts: tuple[str, ...] = (),
) -> str:
    """The value of a round's result key (``hosts``: the members' host ids, if known)."""
    data: dict[str, Any] = {
        "members": list(members),
        "addrs": list(addrs),
        "as_of": as_of,
        "max_nodes": max_nodes,
    }
    if node_unit > 1:
        data["node_unit"] = node_unit
    if any(hosts):
        data["hosts"] = list(hosts)
    return json.dumps(data)


def fault_record(reason: str, nodes: tuple[str, ...]) -> str:
    """The value of a round's result key when the round failed for ``nodes``."""
    return json.dumps({"error": reason[:_MAX_ERROR], "members": list(nodes)})


def slim_record(whole: Outcome, buckets: int, by: str) -> str:
    """The result of a large round (see :mod:`.roster`): its size, decision's
    revision, bounds and rank 0's address; its lists are in ``by``'s roster
    directory, the ranks in ``buckets`` buckets."""
    slim: dict[str, Any] = {
        "world": len(whole.members),
        "as_of": whole.as_of,
        "max_nodes": whole.max_nodes,
        "master": whole.addrs[0] if whole.addrs else "",
        "buckets": buckets,
        "by": by,
    }
    if whole.node_unit > 1:
        slim["node_unit"] = whole.node_unit
    return json.dumps({"slim": slim})


def announcement(node_id: str, *, result: str | None = None, closed: bool = False) -> str:
    """What a coordinator writes into its key to announce the outcome: the round's
    result (the result key's value, as it landed) or that the run is closed.

    The result goes compressed: every waiting node's watch receives this value, and
    etcd's v3 gateway encodes it once per watch (base64 inside JSON). At N=1024 the
    result is 26 KB, packed 11 KB; node ids and addresses repeat their host names.
    """
    message: dict[str, Any] = {"id": node_id}
    if result is not None:
        message["packed"] = base64.b64encode(zlib.compress(result.encode("utf-8"))).decode()
    if closed:
        message["closed"] = True
    return json.dumps(message)


# -- reading ------------------------------------------------------------------------------


def coordinator_of(record: Record) -> str | None:
    """The node id a coordinator key names (None if it names none)."""
    try:
        data = json.loads(record.value)
        return str(data["id"]) if isinstance(data, dict) else None
    except (ValueError, KeyError):
        return None


def hint_of(record: Record | None) -> int | None:
    """The round number the hint key holds (``None`` if absent or unreadable)."""
    return None if record is None else _keys.parse_round(record.value.strip())


def join_keys(
    found: Sequence[Record], rdzv: str
) -> Iterator[tuple[int, D.Participant | None, str]]:
    """The join keys among ``found`` (a listing of the run's ``rdzv`` directory): for
    each, its round, its node (``None`` when its record does not parse) and its key."""
    for record in found:
        where = _keys.round_of(rdzv, record.key)
        if where is None or not where[1].startswith("nodes/"):
            continue
        try:
            yield where[0], parse_node(record), record.key
        except RendezvousStateError:
            yield where[0], None, record.key


def named(node: D.Participant | None, key: str) -> str:
    """A join key's node in words for people: its id and address, or the key itself
    when its record does not parse."""
    if node is None:
        return f"key {key!r}"
    return f"node {node.node_id!r}" + (f" at {node.addr!r}" if node.addr else "")


def parse_node(record: Record) -> D.Participant:
    """A join key's record as a participant of its round."""
    try:
        data = json.loads(record.value)
        node_id, addr, prev = data["id"], data.get("addr", ""), data.get("prev_rank")
        rank, group, host = data.get("rank"), data.get("group"), data.get("host")
        if not isinstance(node_id, str) or not node_id or len(node_id) > _MAX_ID:
            raise TypeError("id is not a node id")
        if not isinstance(addr, str) or len(addr) > _MAX_ID:
            raise TypeError("addr is not an address")
        if prev is not None and (isinstance(prev, bool) or not isinstance(prev, int)):
            raise TypeError("prev_rank is not a rank")
        if rank is not None and (
            isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < _MAX_RANK
        ):
            raise TypeError(f"rank {rank!r} is not a rank")
        if group is not None and node_group_error(group) is not None:
            raise TypeError(f"group {str(group)[:_MAX_SHOWN]!r} is not a node group")
        if host is not None and host_id_error(host) is not None:
            raise TypeError(f"host {str(host)[:_MAX_SHOWN]!r} is not a host id")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RendezvousStateError(
            f"The join key {record.key!r} does not hold a node record: corrupt or foreign "
            f"state ({exc})."
        ) from exc
    if not record.key.endswith("/" + _keys.b64_key(node_id)):
        # A record copied (or forged) under another node's key: it would count one
        # node twice, or a node that is not there.
        raise RendezvousStateError(
            f"The join key {record.key!r} holds the record of another node ({node_id!r})."
        )
    return D.Participant(
        node_id=node_id,
        addr=addr,
        joined=record.created or record.revision,
        prev_rank=prev if prev is not None and prev >= 0 else None,
        rank=rank,
        group=group,
        host=host,
    )


def _strings(seq: Any, name: str) -> set[str]:
    """The distinct strings of ``seq``, a list of strings of at most ``_MAX_ID``
    characters (else TypeError). Checked with builtins, not a loop per item: every
    member of a round parses its N ids and addresses while the last ones still wait."""
    if not isinstance(seq, list):
        raise TypeError(f"{name} is not a list of strings")
    try:
        "".join(seq)  # TypeError naming the first item that is not a string
    except TypeError as exc:
        raise TypeError(f"{name} is not a list of strings ({exc})") from None
    distinct = set(seq)
    if distinct and max(map(len, distinct)) > _MAX_ID:
        raise TypeError(f"{name} holds a string of over {_MAX_ID} characters")
    return distinct


def _slim_of(data: Any, written_at: int) -> Outcome:
    if not isinstance(data, dict):
        raise TypeError("slim is not a JSON object")
    world, buckets, master = data["world"], data["buckets"], data.get("master", "")
    for name, number in (("world", world), ("buckets", buckets)):
        if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number < _MAX_RANK:
            raise TypeError(f"{name} is not a count")
    if buckets > world:
        raise TypeError("more buckets than members")
    if not isinstance(master, str) or len(master) > _MAX_ID:
        raise TypeError("master is not an address")
    by = data["by"]
    if not isinstance(by, str) or not by or len(by) > _MAX_ID:
        raise TypeError("by is not a node id")
    # The bounds are read as a whole result's (one member stands in for the list).
    shape = {k: data[k] for k in ("as_of", "max_nodes", "node_unit") if k in data}
    bounds = _result_of({"members": ["-"], **shape}, written_at)
    unit = bounds.node_unit
    return Outcome((), (), bounds.as_of, bounds.max_nodes, None, unit, buckets, world, master, by)


def _result_of(data: Any, written_at: int) -> Outcome:
    if not isinstance(data, dict):
        raise TypeError("not a JSON object")
    if "slim" in data:
        return _slim_of(data["slim"], written_at)
    if "error" in data:
        error, nodes = data["error"], data["members"]
        if not isinstance(error, str) or not error or len(error) > _MAX_ERROR:
            raise TypeError("error is not a reason")
        if not isinstance(nodes, list) or not all(
            isinstance(m, str) and m and len(m) <= _MAX_ID for m in nodes
        ):
            raise TypeError("members is not a list of node ids")
        return Outcome(tuple(nodes), ("",) * len(nodes), None, None, error)
    members, addrs = data["members"], data.get("addrs") or [""] * len(data["members"])
    distinct = _strings(members, "members")
    _strings(addrs, "addrs")
    if not members or not all(members):
        raise TypeError("members is empty or names an empty node id")
    if len(distinct) != len(members):
        # ["a", "b", "a"] would make a world of 3 with a rank nobody takes.
        raise TypeError(f"members lists a node twice: {str(members)[:_MAX_SHOWN]}")
    if len(addrs) != len(members):
        raise TypeError("addrs and members differ in length")
    as_of = data.get("as_of")
    if as_of is not None and (isinstance(as_of, bool) or not isinstance(as_of, int)):
        raise TypeError("as_of is not a revision")
    if as_of is not None and (as_of < 0 or (written_at > 0 and as_of >= written_at)):
        # A round is decided before its result is written: a later revision would
        # make every member's watcher wait for a future that never comes.
        raise TypeError(f"as_of {as_of} is not before the record's revision {written_at}")
    max_nodes = data.get("max_nodes")
    if max_nodes is not None and (
        isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1
    ):
        raise TypeError("max_nodes is not a node count")
    unit = data.get("node_unit", 1)
    if isinstance(unit, bool) or not isinstance(unit, int) or not 1 <= unit < _MAX_RANK:
        raise TypeError("node_unit is not a node count")
    hosts = data.get("hosts", [])
    if not isinstance(hosts, list) or (hosts and len(hosts) != len(members)):
        raise TypeError("hosts is not a list as long as members")
    if not all(h == "" or host_id_error(h) is None for h in hosts):
        raise TypeError("hosts names something that is not a host id")
    return Outcome(
        tuple(members), tuple(addrs), as_of, max_nodes, node_unit=unit, hosts=tuple(hosts)
    )


def parse_result(record: Record) -> Outcome:
    """A round result: members and addresses in rank order, the decision's revision."""
    try:
        return _result_of(json.loads(record.value), record.revision)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RendezvousStateError(
            f"The round result {record.key!r} is corrupt or foreign: {exc}"
        ) from exc


def _unpack(packed: Any) -> Any:
    """The JSON value an announcement's ``packed`` holds (base64 of a zlib stream)."""
    if not isinstance(packed, str):
        raise TypeError("packed is not a string")
    try:
        raw = base64.b64decode(packed, validate=True)
    except binascii.Error as exc:
        raise TypeError(f"packed is not base64 ({exc})") from None
    inflate = zlib.decompressobj()
    text = inflate.decompress(raw, _MAX_UNPACKED)
    if inflate.unconsumed_tail:
        raise TypeError(f"packed unpacks to more than {_MAX_UNPACKED} bytes")
    if not inflate.eof or inflate.unused_data:
        raise TypeError("packed is not one whole zlib stream")
    return json.loads(text)


def parse_announcement(record: Record) -> tuple[bool, Outcome | None]:
    """``(closed, result)`` as a coordinator key holds them (neither while it works)."""
    try:
        data = json.loads(record.value)
        closed = data.get("closed") is True
        result = _unpack(data["packed"]) if "packed" in data else data.get("result")
        return closed, None if result is None else _result_of(result, record.revision)
    except (ValueError, KeyError, TypeError, AttributeError, zlib.error) as exc:
        raise RendezvousStateError(
            f"The coordinator key {record.key!r} is corrupt or foreign: {exc}"
        ) from exc
