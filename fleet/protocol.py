"""What a fleet (:mod:`fleet`) and its node processes
(``python -m fleet.node``) say to each other: one JSON object per line.

The names of the node kinds, the commands and the events are ``Literal`` types
(:data:`NodeKind`, :data:`CommandName`, :data:`EventName`), so a misspelled name in
typed code is a type error; the helpers below write and read the lines. Both sides
import this module: it imports nothing of the package, and never torch.

**The spec** (:class:`NodeSpec`): the process's only argument, one JSON object:
``kind``; ``params`` (:class:`ParamsSpec`: the fields of ``RendezvousParameters``,
``config`` its options); ``nodes`` (how many nodes the process runs, one thread
each); ``poll`` (seconds between ``num_nodes_waiting()`` calls after a node's first
round, or ``null``); ``rejoin`` (parameters of a spare handler, or ``null``);
``detail``; ``host``; ``timeout`` (the store timeout, seconds, or ``null``);
``log_level``; ``go_fd`` (the read end of the fleet's go pipe); ``cold`` (build the
handler in the first join, after the go signal); ``max_life`` (seconds after which
the process exits by itself). :meth:`Fleet.start
<fleet.Fleet.start>` says what each means.

**Kinds** of node; the first two never import torch (:data:`TORCH_FREE`):

* ``ours``: ``etcd_rdzv.create_handler(params, use_torch=False)`` with torch hidden
  (the torch-free path, as on a machine without torch);
* ``ours-torch``: ``etcd_rdzv.create_handler(params, use_torch=True)`` where torch is
  installed (torch's flavour, what torchrun runs), else as ``ours`` but torch visible;
* ``store``: an :class:`~etcd_rdzv.EtcdStore` over ``create_client(params)``, in the
  run's store directory;
* ``dynamic``: torch's ``DynamicRendezvousHandler`` over ``create_backend(params)``;
* ``torch``: torch's own handler named ``params.backend`` (``c10d``, ``etcd-v2``,
  ``etcd``) from torch's registry; with ``host=True`` the first node of the process
  hosts c10d's store;
* ``torch-store``: torch's ``EtcdStore`` (python-etcd) in the same place as ``store``.

**Commands** (:func:`encode_command`; each is one JSON object on the node's stdin,
``do`` naming it; ``node=i`` addresses one node of a process that runs several, the
default is all of them). A node runs its commands in order; ``status``, ``finish``
and ``exit`` are answered at once:

* ``join`` (``rounds=1``, ``retries=0``, ``go=False``, ``agent=False``, ``poll=0.1``):
  call ``next_rendezvous()`` until it returned ``rounds`` times (``0``: until the
  ``finish`` round), trying again after up to ``retries`` failures in a row; with
  ``go``, first wait for the fleet's go signal; with ``agent``, between rounds wait
  (as torch's agent does) until ``num_nodes_waiting()`` turns positive, polling every
  ``poll`` seconds. Ends with ``done``;
* ``prepare``: our handlers prepare their next join again now, as when they were
  built (the lease of the join key, the watch of its round: made earlier than half
  the key's TTL, or than ``read_timeout``, before the join, they would be made anew
  inside it); ends with ``prepared``;
* ``finish`` (``round``): ``join`` with ``rounds=0`` ends after that round;
* ``status``, ``close`` (``set_closed()``), ``shutdown``;
* ``allreduce``: a gloo all-reduce of ``rank + 1`` over the last round's store
  (torch kinds, one node per process);
* ``write`` (``tag``, ``count``): set keys ``<tag>-<i>`` to unique values (stores);
* ``add`` (``key``, ``count``): ``add(key, 1)`` that many times (stores);
* ``get`` (``key``): a blocking ``get`` (stores);
* ``exit``: shut every handler down and exit 0 (so does closing stdin);
* ``leave``: exit 0 at once without ``shutdown()`` (the handlers' finalizers clean up).

**Events** (:func:`encode_event`): one JSON object each, with ``event``, ``t`` (the
node's ``time.monotonic()``: one clock for every process on Linux and macOS, so
comparable with the driver's) and ``node`` (the node's index in its process):

* ``ready``: handlers built: ``nodes``, ``pid``, ``torch`` (etcd_rdzv's torch
  integration is loaded), ``details`` (per node: ``node_id``, ``endpoint``,
  ``handler_type``; ``store_type``, ``store_is_torch``, ``backend_name`` where known);
* ``key-written``: our handler just wrote its join key: ``round``, ``key``;
* ``round``: ``next_rendezvous()`` returned: ``round``, ``rank``, ``world_size``,
  ``elapsed``, ``cpu`` (the process's CPU seconds since the ``join``; not after a
  rejoin); with ``detail`` also ``node_id``, ``members`` (node ids in rank order),
  ``endpoint``, ``info_type``, ``torch``, and for torch's handlers ``backend``,
  ``store_is_prefix``, ``store_wraps_ours``, ``master_port``; after a rejoin
  (``rejoin``) ``rejoined`` and ``detected`` (when the waiting node was seen);
* ``waiting``: ``num_nodes_waiting()`` changed (``poll``): ``n``, ``round``;
* ``error``: a call raised: ``op``, ``kinds`` (its classes, ``module.qualname``),
  ``message``, ``elapsed``;
* ``done``: a ``join``, ``write`` or ``add`` ended: ``command``, ``elapsed``;
* ``prepared``, ``status`` (``waiting``, ``is_closed``, ``round``), ``closed``,
  ``shutdown`` (``ok``), ``allreduce`` (``rank``, ``value``), ``ack`` (``key``,
  ``value``, ``started``), ``added`` (``total``), ``getting`` (``key``) and ``got``
  (``key``, ``size``): answers;
* ``armed`` (waits for the go signal), ``exit``, ``watchdog`` (``max_life`` passed:
  ``after``), ``unknown`` (a command it does not know: ``command``);
* ``unparsed``: made by the driver, never sent: a line of a node's stdout that is not
  a JSON object (``line``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any, Literal, TypedDict, TypeGuard, get_args

__all__ = [
    "ANSWERS",
    "COMMAND_NAMES",
    "EVENT_NAMES",
    "STORE_KINDS",
    "TORCH_FREE",
    "Command",
    "CommandName",
    "Event",
    "EventName",
    "NodeKind",
    "NodeSpec",
    "ParamsSpec",
    "decode_command",
    "decode_event",
    "encode_command",
    "encode_event",
    "is_command_name",
]

NodeKind = Literal["ours", "ours-torch", "store", "dynamic", "torch", "torch-store"]
CommandName = Literal[
    "join",
    "prepare",
    "finish",
    "status",
    "close",
    "shutdown",
    "allreduce",
    "write",
    "add",
    "get",
    "exit",
    "leave",
]
EventName = Literal[
    "ready",
    "key-written",
    "round",
    "waiting",
    "error",
    "done",
    "prepared",
    "status",
    "closed",
    "shutdown",
    "allreduce",
    "ack",
    "added",
    "getting",
    "got",
    "armed",
    "exit",
    "watchdog",
    "unknown",
    "unparsed",
]

Event = dict[str, Any]
"""One event as read: ``event`` (an :data:`EventName`), ``t``, ``node`` and its fields."""
Command = dict[str, Any]
"""One command as read: ``do`` (a :data:`CommandName`) and its fields."""

COMMAND_NAMES: frozenset[CommandName] = frozenset(get_args(CommandName))
EVENT_NAMES: frozenset[EventName] = frozenset(get_args(EventName))
TORCH_FREE: frozenset[NodeKind] = frozenset({"ours", "store"})
STORE_KINDS: frozenset[NodeKind] = frozenset({"store", "torch-store"})

ANSWERS: Mapping[CommandName, EventName] = {
    "join": "done",
    "prepare": "prepared",
    "status": "status",
    "close": "closed",
    "shutdown": "shutdown",
    "allreduce": "allreduce",
    "write": "done",
    "add": "done",
    "get": "got",
    "exit": "exit",
    "leave": "exit",
}
"""The event that ends each command's work (``finish`` has none: it only marks a round)."""


class ParamsSpec(TypedDict):
    """``RendezvousParameters`` as JSON."""

    backend: str
    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    local_addr: str | None
    config: dict[str, Any]


class NodeSpec(TypedDict):
    """The node program's argument (see the module's docstring)."""

    kind: NodeKind
    params: ParamsSpec
    nodes: int
    poll: float | None
    rejoin: ParamsSpec | None
    detail: bool
    host: bool
    timeout: float | None
    log_level: str
    go_fd: int | None
    max_life: float
    cold: bool


def is_command_name(name: object) -> TypeGuard[CommandName]:
    """Whether ``name`` names a command."""
    return name in COMMAND_NAMES


def encode_command(do: CommandName, fields: Mapping[str, Any]) -> bytes:
    """The line of the command ``do`` with ``fields``, newline included."""
    return (json.dumps({"do": do, **fields}) + "\n").encode()


def decode_command(line: str) -> Command | None:
    """The command on ``line``; ``None`` if it is not a JSON object. Its ``do`` is
    not checked here: see :func:`is_command_name`."""
    try:
        command = json.loads(line)
    except ValueError:
        return None
    return command if isinstance(command, dict) else None


def encode_event(event: EventName, t: float, fields: Mapping[str, Any]) -> str:
    """The line of ``event`` at ``t`` with ``fields``, newline included; what JSON
    cannot hold is written as its ``str()``."""
    return json.dumps({"event": event, "t": t, **fields}, default=str) + "\n"


def decode_event(raw: bytes) -> Event:
    """The event on the line ``raw``; an ``unparsed`` event (now, with the ``line``)
    if it is not a JSON object."""
    try:
        event = json.loads(raw)
    except ValueError:
        event = None
    if not isinstance(event, dict):
        unparsed: EventName = "unparsed"
        event = {"event": unparsed, "t": time.monotonic(), "line": raw.decode(errors="replace")}
    return event
