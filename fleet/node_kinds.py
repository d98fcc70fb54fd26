"""The kinds of node of the node program (:mod:`fleet.node`): what a node
builds, and how it runs the commands that reach it.

A :class:`Role` is what one node is: :class:`HandlerNode` here (a rendezvous handler,
every kind but the stores) or :class:`~fleet.node_stores.StoreNode`
(``store``, ``torch-store``). Its ``COMMANDS`` table maps each command it runs to the
method that runs it; the node (the program's :class:`~fleet.node.Node`,
seen here as a :class:`Host`) answers any other command with ``unknown``.

Our handlers are observed only through their public API: a listener
(``add_listener()``), ``endpoints``, ``round`` and ``prepare_join()``.

Nothing here imports torch when the module loads: the torch kinds import it when
a node is built, so the kinds of :data:`~fleet.protocol.TORCH_FREE`
never do.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, ClassVar, Protocol

from etcd_rdzv.rendezvous.listener import Listener, RoundDone

from .protocol import TORCH_FREE, Command, CommandName, EventName, NodeKind, NodeSpec, ParamsSpec

Action = Callable[[Any, Command], None]
"""A method of a role that runs one command (called with the role and the command)."""


class Host(Protocol):
    """What a role needs of the node that runs it."""

    @property
    def index(self) -> int:
        """The node's index in its process."""

    @property
    def spec(self) -> NodeSpec:
        """The process's spec."""

    @property
    def stop(self) -> threading.Event:
        """Set when the process is about to exit."""

    def finished(self, round_no: int) -> bool:
        """Whether a ``join`` of ``rounds=0`` is to end after ``round_no``."""

    def emit(self, event: EventName, t: float | None = None, **fields: Any) -> None:
        """Report ``event`` of this node; ``t`` (``time.monotonic()``) defaults to now."""

    def error(self, op: str, exc: BaseException, began: float) -> None:
        """Report that ``op``, begun at ``began``, raised ``exc``."""


def type_name(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def ours_params(p: ParamsSpec) -> Any:
    from etcd_rdzv import RendezvousParameters

    args = (p["backend"], p["endpoint"], p["run_id"], p["min_nodes"], p["max_nodes"])
    return RendezvousParameters(*args, p.get("local_addr"), **p["config"])


def _torch_params(p: ParamsSpec) -> Any:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    args = (p["backend"], p["endpoint"], p["run_id"], p["min_nodes"], p["max_nodes"])
    return RendezvousParameters(*args, p.get("local_addr"), **p["config"])


def build_handler(kind: NodeKind, p: ParamsSpec, host: bool) -> tuple[Any, Any]:
    """``(handler, store)`` of ``kind`` for the parameters ``p``; the store is ours,
    where the node built one itself (``dynamic``), else ``None``."""
    import etcd_rdzv

    if kind == "ours":
        return etcd_rdzv.create_handler(ours_params(p), use_torch=False), None
    if kind == "ours-torch":
        # torch's flavour (what torchrun runs) wherever torch is installed.
        use_torch = importlib.util.find_spec("torch") is not None
        return etcd_rdzv.create_handler(ours_params(p), use_torch=use_torch), None
    params = _torch_params(p)
    if kind == "dynamic":
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous

        pair: tuple[Any, Any] = etcd_rdzv.create_backend(params)
        backend, store = pair
        return dynamic_rendezvous.create_handler(store, backend, params), store
    if kind == "torch":
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        if params.backend == "c10d":
            params.config["is_host"] = host  # one node hosts the TCPStore
        return get_rendezvous_handler(params), None
    raise ValueError(f"unknown node kind {kind!r}")


class Role:
    """What one node is: what it built, and the commands it runs (``COMMANDS``).

    Args:
        host: the node that runs it; it reports through the host's ``emit`` and
            ``error``.
    """

    COMMANDS: ClassVar[Mapping[CommandName, Action]] = {}

    def __init__(self, host: Host) -> None:
        self.host = host
        self.emit = host.emit
        self.error = host.error

    def do_prepare(self, command: Command) -> None:
        """Nothing to prepare (see :meth:`HandlerNode.do_prepare`)."""
        self.emit("prepared")

    def describe(self) -> dict[str, Any]:
        """This node for the ``ready`` event."""
        return {}

    def close(self) -> None:
        """Release what the node holds (the process is about to exit)."""


class _Observer(Listener):
    """Hears one of our handlers (a listener): keeps its last completed round, and
    reports each write of its join key as a ``key-written`` event of ``host``, if
    given, right after the write, however fast the round then completes."""

    def __init__(self, host: Host | None) -> None:
        self.host = host
        self.done: RoundDone | None = None

    def on_key_written(self, round_no: int, key: str) -> None:
        if self.host is not None:
            self.host.emit("key-written", round=round_no, key=key)

    def on_round(self, done: RoundDone) -> None:
        self.done = done


class HandlerNode(Role):
    """A node with a rendezvous handler (every kind but the stores)."""

    def __init__(self, host: Host) -> None:
        super().__init__(host)
        spec = host.spec
        self.kind: NodeKind = spec["kind"]
        self.detail = bool(spec.get("detail", True))
        self.info: Any = None  # what the last next_rendezvous() returned
        self._monitor: threading.Thread | None = None
        self._observers: dict[int, _Observer] = {}
        self.handler: Any = None
        self.store: Any = None
        self.spare: Any = None
        # A cold node builds its handler in its first join (after the go signal), as
        # an agent that builds and joins at once: the build is inside the clock.
        self.cold = bool(spec.get("cold", False))
        if not self.cold:
            self._build()

    def _build(self) -> None:
        spec = self.host.spec
        is_host = bool(spec.get("host")) and self.host.index == 0
        self.handler, self.store = build_handler(self.kind, spec["params"], is_host)
        rejoin = spec.get("rejoin")
        self.spare = build_handler(self.kind, rejoin, False)[0] if rejoin else None
        for handler in (self.handler, self.spare):
            self._observe(handler)

    @staticmethod
    def _ours(handler: Any) -> bool:
        from etcd_rdzv import EtcdRendezvousHandler

        return isinstance(handler, EtcdRendezvousHandler)

    def endpoint(self) -> str | None:
        return self.handler.endpoints[0] if self._ours(self.handler) else None

    def round_now(self) -> int | None:
        return int(self.handler.round) if self._ours(self.handler) else None

    def describe(self) -> dict[str, Any]:
        if self.handler is None:  # cold: built in its first join
            return {"node_id": None, "endpoint": None, "handler_type": None, "cold": True}
        found: dict[str, Any] = {
            "node_id": getattr(self.handler, "node_id", None),
            "endpoint": self.endpoint(),
            "handler_type": type_name(self.handler),
        }
        if self.store is not None:
            found["store_type"] = type_name(self.store)
            dist = sys.modules.get("torch.distributed")
            found["store_is_torch"] = dist is not None and isinstance(self.store, dist.Store)
        if hasattr(self.handler, "get_backend"):
            found["backend_name"] = self.handler.get_backend()
        return found

    def _observe(self, handler: Any) -> _Observer | None:
        """The observer of one of our handlers (``None`` for the other kinds)."""
        if not self._ours(handler):
            return None
        found = self._observers.get(id(handler))
        if found is None:
            found = self._observers[id(handler)] = _Observer(
                self.host if handler is self.handler and self.detail else None
            )
            handler.add_listener(found)
        return found

    def _round_no(self, handler: Any, info: Any) -> int | None:
        found = getattr(info, "round", None)
        if found is None and self._ours(handler):
            found = handler.round
        return None if found is None else int(found)

    def _members(self, handler: Any, info: Any, round_no: int | None) -> list[str] | None:
        members = getattr(info, "members", None)
        if members is not None:
            return list(members)
        # torch's RendezvousInfo has no member list: the handler told its observer.
        observer = self._observe(handler)
        done = observer.done if observer is not None else None
        return list(done.members) if done is not None and done.round == round_no else None

    def _round_event(self, handler: Any, info: Any, began: float, t: float) -> dict[str, Any]:
        round_no = self._round_no(handler, info)
        event: dict[str, Any] = {
            "round": round_no,
            "rank": info.rank,
            "world_size": info.world_size,
            "elapsed": t - began,
        }
        if not self.detail:
            node_id = getattr(handler, "node_id", None)  # ours: checked against etcd's list
            if isinstance(node_id, str):
                event["node_id"] = node_id
            return event
        event.update(
            node_id=getattr(handler, "node_id", None),
            members=self._members(handler, info, round_no),
            endpoint=self.endpoint(),
            info_type=type_name(info),
            torch=sys.modules.get("etcd_rdzv.torch") is not None,
        )
        dist = sys.modules.get("torch.distributed")
        if dist is not None and hasattr(handler, "get_backend"):
            store: Any = getattr(info, "store", None)
            prefixed = isinstance(store, dist.PrefixStore)
            bootstrap = getattr(info, "bootstrap_store_info", None)
            event.update(
                backend=handler.get_backend(),
                store_is_prefix=prefixed,
                store_wraps_ours=prefixed
                and self.store is not None
                and store.underlying_store is self.store,
                master_port=None if bootstrap is None else bootstrap.master_port,
            )
        return event

    def do_join(self, command: Command) -> None:
        """``rounds`` completed rounds (``0``: until the ``finish`` round), trying again
        after up to ``retries`` failures in a row; with ``go``, first wait for the
        fleet's go signal."""
        gate = command.get("gate")
        if isinstance(gate, threading.Event):
            gate.wait()
        started = time.monotonic()
        cpu_at_start = time.process_time()
        if self.handler is None:
            try:
                self._build()
            except Exception as exc:
                self.error("build", exc, started)
                self.emit("done", command="join", elapsed=time.monotonic() - started)
                return
        wanted, retries = int(command.get("rounds", 1)), int(command.get("retries", 0))
        done = failed = last_round = 0
        # An agent joins no more once told to stop (its process is exiting).
        while (
            (done < wanted if wanted else not self.host.finished(last_round))
            and failed <= retries
            and not (command.get("agent") and self.host.stop.is_set())
        ):
            began = time.monotonic()
            try:
                info = self.handler.next_rendezvous()
            except Exception as exc:
                # Reported, then (within ``retries``) tried again as an agent would.
                self.error("next_rendezvous", exc, began)
                failed += 1
                continue
            t = time.monotonic()
            self.info = info
            event = self._round_event(self.handler, info, began, t)
            event["cpu"] = time.process_time() - cpu_at_start
            done, failed = done + 1, 0
            last_round = event["round"] if event["round"] is not None else done
            self.emit("round", t, **event)
            self._start_monitor()
            if command.get("agent"):
                self._until_waiting(float(command.get("poll", 0.1)), last_round)
        self.emit("done", command="join", elapsed=time.monotonic() - started)

    def _until_waiting(self, poll: float, last_round: int) -> None:
        """As torch's agent does while its workers run: poll ``num_nodes_waiting()``
        and return when it turns positive (time to re-rendezvous), or when the node
        is told to stop or finish."""
        stop = self.host.stop
        while not stop.is_set() and not self.host.finished(last_round):
            if self.handler.num_nodes_waiting() > 0:
                return
            stop.wait(poll)

    def _start_monitor(self) -> None:
        poll = self.host.spec.get("poll")
        if poll is None or self._monitor is not None:
            return
        self._monitor = threading.Thread(
            target=self._watch, args=(float(poll),), name=f"monitor{self.host.index}", daemon=True
        )
        self._monitor.start()

    def _watch(self, poll: float) -> None:
        """Poll ``num_nodes_waiting()`` as torch's agent does between rounds; report each
        change. With a spare handler, leave once it turns positive and join the next
        round with the spare (what an agent does, with new parameters)."""
        last: int | None = None
        stop = self.host.stop
        while not stop.is_set():
            began = time.monotonic()
            try:
                waiting = int(self.handler.num_nodes_waiting())
            except Exception as exc:
                self.error("num_nodes_waiting", exc, began)
                return
            if waiting != last:
                self.emit("waiting", n=waiting, round=self.round_now())
                last = waiting
            if waiting and self.spare is not None:
                self._rejoin(self.spare, detected=time.monotonic())
                return
            stop.wait(poll)

    def _rejoin(self, spare: Any, detected: float) -> None:
        self.handler.shutdown()
        began = time.monotonic()
        try:
            info = spare.next_rendezvous()
        except Exception as exc:
            self.error("next_rendezvous", exc, began)
            return
        t = time.monotonic()
        event = self._round_event(spare, info, began, t)
        self.emit("round", t, rejoined=True, detected=detected, **event)

    def do_prepare(self, command: Command) -> None:
        """Our handler: prepare its next join again, as when it was built (the watch
        of its round and the read of the run; the join opens again a watch older than
        ``read_timeout``). For a fleet that took longer to start than that. Other
        kinds have nothing to prepare."""
        if self.handler is not None and self._ours(self.handler):
            self.handler.prepare_join()
        self.emit("prepared")

    def do_status(self, command: Command) -> None:
        self.emit(
            "status",
            waiting=self.handler.num_nodes_waiting(),
            is_closed=self.handler.is_closed(),
            round=self.round_now(),
        )

    def do_close(self, command: Command) -> None:
        self.handler.set_closed()
        self.emit("closed")

    def do_shutdown(self, command: Command) -> None:
        self.emit("shutdown", ok=self.handler.shutdown())

    def do_allreduce(self, command: Command) -> None:
        """A gloo all-reduce of ``rank + 1`` over the store of the last round (one node
        per process: the default process group)."""
        if self.info is None or self.kind in TORCH_FREE:
            raise RuntimeError("allreduce needs a completed round of a torch kind")
        import torch
        import torch.distributed as dist

        info = self.info
        dist.init_process_group(
            "gloo",
            store=info.store,
            rank=info.rank,
            world_size=info.world_size,
            timeout=timedelta(seconds=60),
        )
        try:
            tensor = torch.tensor([info.rank + 1.0])
            dist.all_reduce(tensor)
        finally:
            dist.destroy_process_group()
        self.emit("allreduce", rank=info.rank, value=tensor.item())

    COMMANDS: ClassVar[Mapping[CommandName, Action]] = {
        "join": do_join,
        "prepare": do_prepare,
        "status": do_status,
        "close": do_close,
        "shutdown": do_shutdown,
        "allreduce": do_allreduce,
    }

    def close(self) -> None:
        for handler in (self.handler, self.spare):
            if handler is None:
                continue
            began = time.monotonic()
            try:
                handler.shutdown()
            except Exception as exc:  # reported; the process exits anyway
                self.error("shutdown", exc, began)
