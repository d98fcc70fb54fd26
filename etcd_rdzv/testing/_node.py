"""The node program of :mod:`etcd_rdzv.testing.fleet`: one process, one or more nodes.

Started by :class:`~etcd_rdzv.testing.fleet.Fleet` as ``python -m
etcd_rdzv.testing._node '<json spec>'``, never by hand; the spec, the commands and
the events are described in :mod:`etcd_rdzv.testing.fleet`. Each node of the process
runs its commands in order in a thread of its own, so the main thread always reads
stdin (``status``, ``finish`` and ``exit`` are answered at once, even while a node
waits in a round).

The kinds ``ours`` and ``store`` hide torch from the process (an installed torch is
never imported, as on a machine without it); the other kinds import torch here, in
the node process, never in the process that drives the fleet.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TextIO

from etcd_rdzv.rendezvous.listener import Listener, RoundDone

Command = dict[str, Any]
Emit = Callable[..., None]

# Kinds whose nodes must not import torch.
_TORCH_FREE = frozenset({"ours", "store"})
# Answered by the main thread at once, not queued behind a node's running command.
_IMMEDIATE = frozenset({"status"})


class Events:
    """The event stream to the parent: one JSON object per line on the original stdout.

    File descriptor 1 is then pointed at stderr, so nothing else that prints (torch,
    a stray ``print``) can break a line of the stream.
    """

    def __init__(self) -> None:
        sys.stdout.flush()
        self._out: TextIO = os.fdopen(os.dup(1), "w", encoding="utf-8")
        os.dup2(2, 1)
        self._lock = threading.Lock()

    def __call__(self, event: str, t: float | None = None, **fields: Any) -> None:
        """Report ``event``; ``t`` (``time.monotonic()``) defaults to now."""
        data = {"event": event, "t": time.monotonic() if t is None else t, **fields}
        line = json.dumps(data, default=str) + "\n"
        try:
            with self._lock:
                self._out.write(line)
                self._out.flush()
        except (BrokenPipeError, OSError):
            os._exit(71)  # nobody reads the events any more: the fleet is gone


def kinds(exc: BaseException) -> list[str]:
    """The exception's classes, most specific first, as ``module.qualname``."""
    return [f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__]


def _type_name(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _ours_params(p: dict[str, Any]) -> Any:
    from etcd_rdzv import RendezvousParameters

    args = (p["backend"], p["endpoint"], p["run_id"], p["min_nodes"], p["max_nodes"])
    return RendezvousParameters(*args, p.get("local_addr"), **p["config"])


def _torch_params(p: dict[str, Any]) -> Any:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    args = (p["backend"], p["endpoint"], p["run_id"], p["min_nodes"], p["max_nodes"])
    return RendezvousParameters(*args, p.get("local_addr"), **p["config"])


def build_handler(kind: str, p: dict[str, Any], host: bool) -> tuple[Any, Any]:
    """``(handler, store)`` of ``kind`` for the parameters ``p``; the store is ours,
    where the node built one itself (``dynamic``), else ``None``."""
    import etcd_rdzv

    if kind == "ours":
        return etcd_rdzv.create_handler(_ours_params(p), use_torch=False), None
    if kind == "ours-torch":
        # torch's flavour (what torchrun runs) wherever torch is installed.
        use_torch = importlib.util.find_spec("torch") is not None
        return etcd_rdzv.create_handler(_ours_params(p), use_torch=use_torch), None
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


def build_store(kind: str, p: dict[str, Any], timeout: float | None) -> tuple[Any, Any]:
    """``(store, client)``: the store of the run ``p`` names (its ``store`` directory),
    ours (``store``) or torch's python-etcd one (``torch-store``)."""
    from etcd_rdzv import _keys, params

    prefix = _keys.store_dir(p["config"].get("key_prefix", params.DEFAULT_KEY_PREFIX), p["run_id"])
    if kind == "store":
        import etcd_rdzv

        client = etcd_rdzv.create_client(_ours_params(p))
        store: Any = etcd_rdzv.EtcdStore(client, prefix)
    else:
        import etcd
        from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

        host, port = p["endpoint"].rsplit(":", 1)
        client = etcd.Client(host, int(port))
        store = EtcdStore(client, prefix)
    if timeout is not None:
        store.set_timeout(timedelta(seconds=timeout))
    return store, client


class Process:
    """What the nodes of this process share: the spec, the event stream, the stop
    signal, the start gate and the round to finish after."""

    def __init__(self, spec: dict[str, Any], emit: Events) -> None:
        self.spec = spec
        self.emit = emit
        self.stop = threading.Event()
        self.finish: int | None = None  # ``join`` with ``rounds=0`` ends after this round
        self._go_fd: int | None = spec.get("go_fd")

    def gate(self) -> threading.Event:
        """An event set once this process took its byte from the fleet's go pipe; says
        ``armed`` just before it blocks on the pipe."""
        opened = threading.Event()
        fd = self._go_fd

        def wait() -> None:
            if fd is not None:
                self.emit("armed")
                os.read(fd, 1)
            opened.set()

        threading.Thread(target=wait, name="go", daemon=True).start()
        return opened

    def finished(self, round_no: int) -> bool:
        return self.finish is not None and round_no >= self.finish


class Node:
    """One node of the process: commands run in order, in a thread of its own."""

    def __init__(self, index: int, proc: Process) -> None:
        self.index = index
        self.proc = proc
        self.commands: queue.Queue[Command | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name=f"node{index}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def emit(self, event: str, t: float | None = None, **fields: Any) -> None:
        self.proc.emit(event, t, node=self.index, **fields)

    def error(self, op: str, exc: BaseException, began: float) -> None:
        now = time.monotonic()
        self.emit("error", now, op=op, kinds=kinds(exc), message=str(exc), elapsed=now - began)

    def run(self, command: Command) -> None:
        """Run one command now (in the calling thread); errors become ``error`` events."""
        name = str(command.get("do"))
        method = getattr(self, "do_" + name.replace("-", "_"), None)
        if method is None:
            self.emit("unknown", command=command)
            return
        began = time.monotonic()
        try:
            method(command)
        except Exception as exc:
            self.error(name, exc, began)

    def do_prepare(self, command: Command) -> None:
        """Nothing to prepare (see :meth:`HandlerNode.do_prepare`)."""
        self.emit("prepared")

    def _serve(self) -> None:
        while (command := self.commands.get()) is not None:
            self.run(command)

    def describe(self) -> dict[str, Any]:
        """This node for the ``ready`` event."""
        return {}

    def close(self) -> None:
        """Release what the node holds (the process is about to exit)."""


class _Observer(Listener):
    """Hears one of our handlers (a listener): keeps its last completed round, and
    reports each write of its join key as a ``key-written`` event (``emit``), right
    after the write, however fast the round then completes."""

    def __init__(self, emit: Emit | None) -> None:
        self.emit = emit
        self.done: RoundDone | None = None

    def on_key_written(self, round_no: int, key: str) -> None:
        if self.emit is not None:
            self.emit("key-written", round=round_no, key=key)

    def on_round(self, done: RoundDone) -> None:
        self.done = done


class HandlerNode(Node):
    """A node with a rendezvous handler (every kind but the stores)."""

    def __init__(self, index: int, proc: Process) -> None:
        super().__init__(index, proc)
        spec = proc.spec
        self.kind: str = spec["kind"]
        self.detail = bool(spec.get("detail", True))
        host = bool(spec.get("host")) and index == 0
        self.handler, self.store = build_handler(self.kind, spec["params"], host)
        rejoin = spec.get("rejoin")
        self.spare = build_handler(self.kind, rejoin, False)[0] if rejoin else None
        self.info: Any = None  # what the last next_rendezvous() returned
        self._monitor: threading.Thread | None = None
        self._observers: dict[int, _Observer] = {}
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
        found: dict[str, Any] = {
            "node_id": getattr(self.handler, "node_id", None),
            "endpoint": self.endpoint(),
            "handler_type": _type_name(self.handler),
        }
        if self.store is not None:
            found["store_type"] = _type_name(self.store)
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
                self.emit if handler is self.handler and self.detail else None
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
            return event
        event.update(
            node_id=getattr(handler, "node_id", None),
            members=self._members(handler, info, round_no),
            endpoint=self.endpoint(),
            info_type=_type_name(info),
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
        wanted, retries = int(command.get("rounds", 1)), int(command.get("retries", 0))
        done = failed = last_round = 0
        while (done < wanted if wanted else not self.proc.finished(last_round)) and (
            failed <= retries
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
        while not self.proc.stop.is_set() and not self.proc.finished(last_round):
            if self.handler.num_nodes_waiting() > 0:
                return
            self.proc.stop.wait(poll)

    def _start_monitor(self) -> None:
        poll = self.proc.spec.get("poll")
        if poll is None or self._monitor is not None:
            return
        self._monitor = threading.Thread(
            target=self._watch, args=(float(poll),), name=f"monitor{self.index}", daemon=True
        )
        self._monitor.start()

    def _watch(self, poll: float) -> None:
        """Poll ``num_nodes_waiting()`` as torch's agent does between rounds; report each
        change. With a spare handler, leave once it turns positive and join the next
        round with the spare (what an agent does, with new parameters)."""
        last: int | None = None
        while not self.proc.stop.is_set():
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
            self.proc.stop.wait(poll)

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
        """Our handler: prepare its next join again, as when it was built (the lease
        of its join key and the watch of its round; the join makes again a lease older
        than half its TTL, a watch older than ``read_timeout``). For a fleet that took
        longer to start than that. Other kinds have nothing to prepare."""
        if self._ours(self.handler):
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
        if self.info is None or self.kind in _TORCH_FREE:
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

    def close(self) -> None:
        for handler in (self.handler, self.spare):
            if handler is None:
                continue
            began = time.monotonic()
            try:
                handler.shutdown()
            except Exception as exc:  # reported; the process exits anyway
                self.error("shutdown", exc, began)


class StoreNode(Node):
    """A node with a store (kinds ``store`` and ``torch-store``)."""

    def __init__(self, index: int, proc: Process) -> None:
        super().__init__(index, proc)
        spec = proc.spec
        self.store, self._client = build_store(spec["kind"], spec["params"], spec.get("timeout"))
        self.writer = uuid.uuid4().hex[:8]  # makes every written value unique

    def describe(self) -> dict[str, Any]:
        endpoints = getattr(self._client, "endpoints", None)
        return {
            "endpoint": endpoints[0] if endpoints else None,
            "store_type": _type_name(self.store),
        }

    def _attempt(self, op: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """``(True, result)``, or ``(False, None)`` after reporting the error."""
        began = time.monotonic()
        try:
            return True, fn()
        except Exception as exc:
            self.error(op, exc, began)
            return False, None

    def do_write(self, command: Command) -> None:
        """Set ``count`` keys ``<tag>-<i>`` to unique values; ``ack`` each."""
        started = time.monotonic()
        tag = str(command["tag"])
        for i in range(int(command.get("count", 1))):
            key, value = f"{tag}-{i}", f"{tag}:{i}:{self.writer}"
            began = time.monotonic()
            ok, _ = self._attempt(f"set {key}", functools.partial(self.store.set, key, value))
            if ok:
                self.emit("ack", key=key, value=value, started=began)
        self.emit("done", command="write", elapsed=time.monotonic() - started)

    def do_add(self, command: Command) -> None:
        """``add(key, 1)`` ``count`` times; ``added`` each running total."""
        started = time.monotonic()
        key = str(command["key"])
        for _ in range(int(command.get("count", 1))):
            ok, total = self._attempt(f"add {key}", functools.partial(self.store.add, key, 1))
            if ok:
                self.emit("added", total=total)
        self.emit("done", command="add", elapsed=time.monotonic() - started)

    def do_get(self, command: Command) -> None:
        """``getting`` just before the blocking ``get(key)``, ``got`` once it returned."""
        key = str(command["key"])
        self.emit("getting", key=key)
        ok, value = self._attempt(f"get {key}", functools.partial(self.store.get, key))
        if ok:
            self.emit("got", key=key, size=len(value))

    def close(self) -> None:
        close = getattr(self._client, "close", None)
        if callable(close):
            close()


def _watchdog(seconds: float, emit: Events) -> None:
    time.sleep(seconds)
    emit("watchdog", after=seconds)
    os._exit(70)


def serve(proc: Process, nodes: list[Node], lines: Any) -> None:
    """Read commands until ``exit`` or the end of input; hand each to its nodes."""
    for line in lines:
        if not line.strip():
            continue
        try:
            command: Command = json.loads(line)
        except ValueError:
            proc.emit("unknown", command=line.strip())
            continue
        name = command.get("do")
        if name == "exit":
            return
        if name == "leave":
            # The process ends without shutdown(), as an agent's does on a signal it
            # handles: what is left to clean up is up to the handlers' finalizers.
            proc.emit("exit")
            sys.exit(0)
        if name == "finish":
            proc.finish = int(command["round"])
            continue
        index = command.get("node")
        if index is not None and not (isinstance(index, int) and 0 <= index < len(nodes)):
            proc.emit("unknown", command=command)
            continue
        targets = nodes if index is None else [nodes[index]]
        if name == "join" and command.get("go"):
            command["gate"] = proc.gate()  # one byte of the go pipe for this process
        for node in targets:
            if name in _IMMEDIATE:
                node.run(command)
            else:
                node.commands.put(command)


def main(argv: list[str]) -> int:
    spec: dict[str, Any] = json.loads(argv[0])
    kind = str(spec["kind"])
    if kind in _TORCH_FREE:
        sys.modules["torch"] = None  # type: ignore[assignment]  # find_spec("torch") -> None
    emit = Events()
    threading.Thread(
        target=_watchdog, args=(float(spec.get("max_life", 300)), emit), daemon=True
    ).start()
    logging.basicConfig(
        level=str(spec.get("log_level", "INFO")),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s",
    )
    proc = Process(spec, emit)
    node_cls = StoreNode if kind in ("store", "torch-store") else HandlerNode
    nodes: list[Node] = [node_cls(i, proc) for i in range(int(spec.get("nodes", 1)))]
    for node in nodes:
        node.start()
    emit(
        "ready",
        nodes=len(nodes),
        pid=os.getpid(),
        torch=sys.modules.get("etcd_rdzv.torch") is not None,
        details=[node.describe() for node in nodes],
    )
    serve(proc, nodes, sys.stdin)
    proc.stop.set()
    for node in nodes:
        node.close()
    emit("exit")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
