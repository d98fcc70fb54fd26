"""torch's dynamic rendezvous state, read without torch and without trusting its pickle.

torch's ``DynamicRendezvousHandler`` (torchrun's ``etcd-rdzv-dynamic`` over our
backend) keeps its state, a pickled ``_RendezvousState``, base64-encoded under
``<key_prefix>/<run>/state``. Whoever can write that key can put any pickle there, and
an ordinary unpickler calls whatever a pickle names: reading it with :func:`pickle.loads`
would hand them this process. :func:`decode_state` reads it in three guarded steps:

1. the size is bounded (:data:`MAX_STATE_BYTES`) and the opcodes are scanned first
   (:mod:`._pickle_scan`) with
   :func:`pickletools.genops`, which decodes them without building any object: only the
   opcodes a pickled state needs pass, and the nesting depth is bounded (hashing a
   tuple nested a million deep, a few bytes per level, overflows the C stack);
2. a :class:`pickle.Unpickler` whose ``find_class`` knows exactly five names (torch's
   state and node classes, ``datetime``, ``timezone``, ``timedelta``) and maps them to
   small local stand-ins that check their arguments; every other name is refused, so
   nothing the pickle names is imported or called;
3. the stand-ins are checked field by field and turned into the frozen
   :class:`TorchState` and :class:`TorchNode`.

Anything else is a :class:`~etcd_rdzv.errors.RendezvousStateError` naming the key.
This module never imports torch (``import etcd_rdzv`` must not).
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import io
import pickle
from dataclasses import dataclass
from typing import Any

from ..errors import RendezvousStateError
from ._pickle_scan import Refused as _Refused
from ._pickle_scan import scan as _scan

__all__ = [
    "MAX_STATE_BYTES",
    "TORCH_STATE_MODULE",
    "TorchNode",
    "TorchState",
    "decode_state",
    "parse_state_value",
]

#: The largest pickled state read (bytes, after base64): a state of 10,000 nodes is
#: about 1 MB, and etcd refuses requests above 1.5 MiB unless told otherwise.
MAX_STATE_BYTES = 4 * 1024 * 1024
#: The module of torch's state classes, as a pickle names it.
TORCH_STATE_MODULE = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"

_MAX_TEXT = 1024  # characters of a node address
_MAX_INT = 2**63 - 1  # round numbers, pids, local ids
_MAX_RANK = 2**31 - 1
_FIELDS = (
    "round",
    "complete",
    "deadline",
    "closed",
    "participants",
    "wait_list",
    "redundancy_list",
    "last_heartbeats",
)


@dataclass(frozen=True, order=True)
class TorchNode:
    """A node of torch's dynamic rendezvous (torch's ``_NodeDesc``)."""

    addr: str
    pid: int
    local_id: int

    @property
    def node_id(self) -> str:
        """The node as torch names it in its logs: ``<addr>_<pid>_<local_id>``."""
        return f"{self.addr}_{self.pid}_{self.local_id}"


@dataclass(frozen=True)
class TorchState:
    """torch's ``_RendezvousState``, checked; collections in a stable order.

    ``participants`` are ``(node, rank)`` by rank (every rank is 0 while the round
    forms: torch assigns them when it completes); ``wait_list`` and
    ``redundancy_list`` (the spares) are sorted; times are as the writers' clocks saw
    them, in UTC when torch wrote them.
    """

    round: int
    complete: bool
    deadline: dt.datetime | None
    closed: bool
    participants: tuple[tuple[TorchNode, int], ...]
    wait_list: tuple[TorchNode, ...]
    redundancy_list: tuple[TorchNode, ...]
    last_heartbeats: tuple[tuple[TorchNode, dt.datetime], ...]

    def heartbeat_of(self, node: TorchNode) -> dt.datetime | None:
        """The node's last heartbeat, if the state has one."""
        return next((at for n, at in self.last_heartbeats if n == node), None)


def _short(text: str, limit: int = 80) -> str:
    """A bounded repr of untrusted text (repr escapes control characters)."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def _kind(value: object) -> str:
    """The type of an untrusted value, by name (its value is not shown)."""
    return type(value).__name__


# -- step 2: the restricted unpickler -------------------------------------------------------


class _StandIn:
    """An object of torch's state as the pickle builds it: created empty (NEWOBJ),
    then given its fields once (BUILD, with a dict), kept in :attr:`fields`.

    No ``__dict__`` (slots): the pickle's field names never become attributes, so
    none can shadow a method (BUILD looks ``__setstate__`` up on the object).
    """

    __slots__ = ("fields",)

    fields: dict[str, Any]

    def __setstate__(self, state: object) -> None:
        if self.built:
            raise _Refused(f"a {type(self).__name__} is built twice")
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise _Refused(f"a {type(self).__name__} has a state that is not a dict of fields")
        self._check(state)
        self.fields = dict(state)

    @property
    def built(self) -> bool:
        return hasattr(self, "fields")

    def _check(self, state: dict[str, Any]) -> None:
        del state

    def __reduce__(self) -> Any:  # never pickled again: not a real object of torch
        raise TypeError(f"{type(self).__name__} is a stand-in")


class _StateStandIn(_StandIn):
    """torch's ``_RendezvousState``: its fields, checked later (:func:`_to_state`)."""

    __slots__ = ()


class _NodeStandIn(_StandIn):
    """torch's ``_NodeDesc``. Hashable (a dict key, a set member) once built, on
    flat fields only, so hashing it never recurses into untrusted data."""

    __slots__ = ()

    def _check(self, state: dict[str, Any]) -> None:
        if set(state) != {"addr", "pid", "local_id"}:
            fields = sorted(map(_short, state))[:8]
            raise _Refused(f"a node has the fields {', '.join(fields)}, not addr, pid, local_id")
        addr = state["addr"]
        if not isinstance(addr, str):
            raise _Refused(f"a node's addr is a {_kind(addr)}, not a string")
        if len(addr) > _MAX_TEXT:
            raise _Refused(f"a node's addr is longer than {_MAX_TEXT} characters")
        for name in ("pid", "local_id"):
            value = state[name]
            if type(value) is not int or not 0 <= value <= _MAX_INT:
                raise _Refused(f"a node's {name} is not a non-negative integer")

    def _key(self) -> tuple[str, int, int]:
        if not self.built:
            # Hashed before its fields were set: torch's pickles never do that, and a
            # key whose hash changes afterwards would corrupt the dict.
            raise _Refused("a node is used before it was built")
        return (self.fields["addr"], self.fields["pid"], self.fields["local_id"])

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NodeStandIn) and self._key() == other._key()


def _datetime(*args: object) -> dt.datetime:
    """``datetime.datetime`` as a pickle rebuilds it: ``(10 bytes[, tzinfo])``."""
    if not 1 <= len(args) <= 2 or not isinstance(args[0], bytes) or len(args[0]) != 10:
        raise _Refused("a datetime has arguments other than its 10-byte state")
    tz = args[1] if len(args) == 2 else None
    if tz is not None and not isinstance(tz, dt.timezone):
        raise _Refused(f"a datetime has a time zone of type {_kind(tz)}")
    b = args[0]
    fold, month = b[2] >> 7, b[2] & 0x7F
    try:
        return dt.datetime(
            b[0] * 256 + b[1],
            month,
            b[3],
            b[4],
            b[5],
            b[6],
            (b[7] << 16) | (b[8] << 8) | b[9],
            tzinfo=tz,
            fold=fold,
        )
    except ValueError as exc:
        raise _Refused(f"a datetime is out of range ({exc})") from None


def _timezone(*args: object) -> dt.timezone:
    """``datetime.timezone(offset[, name])``."""
    if not 1 <= len(args) <= 2 or not isinstance(args[0], dt.timedelta):
        raise _Refused("a timezone has arguments other than an offset and a name")
    if len(args) == 2 and not (isinstance(args[1], str) and len(args[1]) <= _MAX_TEXT):
        raise _Refused("a timezone's name is not a string")
    try:
        return dt.timezone(*args)  # type: ignore[arg-type]
    except ValueError as exc:
        raise _Refused(f"a timezone is out of range ({exc})") from None


def _timedelta(*args: object) -> dt.timedelta:
    """``datetime.timedelta(days, seconds, microseconds)``."""
    if len(args) != 3 or not all(type(a) is int and abs(a) <= _MAX_INT for a in args):
        raise _Refused("a timedelta has arguments other than three integers")
    days, seconds, microseconds = args
    try:
        return dt.timedelta(days, seconds, microseconds)  # type: ignore[arg-type]
    except OverflowError as exc:
        raise _Refused(f"a timedelta is out of range ({exc})") from None


# The only names a pickled state may name, and what each stands for here.
_NAMES: dict[tuple[str, str], Any] = {
    (TORCH_STATE_MODULE, "_RendezvousState"): _StateStandIn,
    (TORCH_STATE_MODULE, "_NodeDesc"): _NodeStandIn,
    ("datetime", "datetime"): _datetime,
    ("datetime", "timezone"): _timezone,
    ("datetime", "timedelta"): _timedelta,
}


class _Unpickler(pickle.Unpickler):
    """Resolves only :data:`_NAMES`; imports and calls nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        found = _NAMES.get((module, name))
        if found is None:
            raise _Refused(
                f"it names {_short(module)}.{_short(name)}, which torch's state never does"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("it refers to a persistent object")


# -- step 3: the fields ---------------------------------------------------------------------


def _node(value: object, where: str) -> TorchNode:
    if not isinstance(value, _NodeStandIn):
        raise _Refused(f"{where} holds a {_kind(value)}, not a node")
    addr, pid, local_id = value._key()
    return TorchNode(addr, pid, local_id)


def _time(value: object, where: str) -> dt.datetime:
    if not isinstance(value, dt.datetime):
        raise _Refused(f"{where} is a {_kind(value)}, not a datetime")
    return value


def _to_state(obj: object) -> TorchState:
    if not isinstance(obj, _StateStandIn) or not obj.built:
        raise _Refused(f"it holds a {_kind(obj)}, not torch's _RendezvousState")
    fields = obj.fields
    missing = [f for f in _FIELDS if f not in fields]
    if missing:
        raise _Refused(f"the state lacks the field(s) {', '.join(missing)}")
    # Fields a later torch may add are ignored: what is read here is all status shows.
    round_no = fields["round"]
    if type(round_no) is not int or not 0 <= round_no <= _MAX_INT:
        raise _Refused("round is not a non-negative integer")
    flags = {}
    for name in ("complete", "closed"):
        if type(fields[name]) is not bool:
            raise _Refused(f"{name} is a {_kind(fields[name])}, not a bool")
        flags[name] = fields[name]
    deadline = fields["deadline"]
    if deadline is not None:
        deadline = _time(deadline, "deadline")
    participants = fields["participants"]
    if not isinstance(participants, dict):
        raise _Refused(f"participants is a {_kind(participants)}, not a dict")
    ranked: list[tuple[TorchNode, int]] = []
    for node, rank in participants.items():
        if type(rank) is not int or not 0 <= rank <= _MAX_RANK:
            raise _Refused("a participant's rank is not a non-negative integer")
        ranked.append((_node(node, "participants"), rank))
    lists: dict[str, tuple[TorchNode, ...]] = {}
    for name in ("wait_list", "redundancy_list"):
        members = fields[name]
        if not isinstance(members, set):
            raise _Refused(f"{name} is a {_kind(members)}, not a set")
        lists[name] = tuple(sorted(_node(n, name) for n in members))
    beats = fields["last_heartbeats"]
    if not isinstance(beats, dict):
        raise _Refused(f"last_heartbeats is a {_kind(beats)}, not a dict")
    heartbeats = sorted(
        (_node(n, "last_heartbeats"), _time(at, "a heartbeat")) for n, at in beats.items()
    )
    return TorchState(
        round_no,
        flags["complete"],
        deadline,
        flags["closed"],
        tuple(sorted(ranked, key=lambda item: (item[1], item[0]))),
        lists["wait_list"],
        lists["redundancy_list"],
        tuple(heartbeats),
    )


def decode_state(data: bytes, key: str) -> TorchState:
    """torch's pickled ``_RendezvousState`` (the bytes of ``key``), without torch and
    without calling anything the pickle names.

    Raises:
        RendezvousStateError: ``data`` is larger than :data:`MAX_STATE_BYTES`, is not a
            pickle, names anything but torch's state and node classes and the
            ``datetime`` types, or its fields are not those of torch's state; the
            message names ``key``.
    """
    try:
        if len(data) > MAX_STATE_BYTES:
            raise _Refused(f"it is {len(data)} bytes, more than the {MAX_STATE_BYTES} read")
        _scan(data)
        try:
            obj = _Unpickler(io.BytesIO(data), fix_imports=False).load()
        except _Refused:
            raise
        except Exception as exc:  # whatever a malformed pickle makes the unpickler raise
            raise _Refused(f"it does not unpickle ({type(exc).__name__}: {exc})") from None
        return _to_state(obj)
    except _Refused as exc:
        raise RendezvousStateError(
            f"The value of {key!r} is not the state of torch's dynamic rendezvous: {exc}. "
            "It was not loaded further: it is corrupt or was written by something else."
        ) from None


def parse_state_value(value: str, key: str) -> TorchState:
    """:func:`decode_state` of a value as our backend stores it (base64 text).

    Raises:
        RendezvousStateError: not base64, or see :func:`decode_state`.
    """
    if len(value) > MAX_STATE_BYTES * 4 // 3 + 4:
        raise RendezvousStateError(
            f"The value of {key!r} is {len(value)} characters, more than the "
            f"{MAX_STATE_BYTES} bytes of state read."
        )
    try:
        data = base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise RendezvousStateError(
            f"The value of {key!r} is not base64: not the state our backend writes."
        ) from None
    return decode_state(data, key)
