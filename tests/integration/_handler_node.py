"""One node of the native-handler integration tests (run as a child process).

Usage: ``python _handler_node.py '<json spec>'`` where the spec holds ``backend``,
``endpoint``, ``run_id``, ``min_nodes``, ``max_nodes``, ``config`` (the rendezvous
options) and optionally ``max_life`` (seconds before the node exits on its own, a
safety net should the test process die) and ``torch`` (``false``: hide an installed
torch, so ``create_handler`` takes its torch-free path and the node starts fast).

The node builds its handler with ``etcd_rdzv.create_handler`` and then obeys one
command per stdin line:

* ``join``     call ``next_rendezvous()`` (again); blocks until it returns or raises
* ``close``    ``set_closed()``
* ``status``   report ``num_nodes_waiting()``, ``is_closed()`` and the round
* ``shutdown`` ``shutdown()`` (leave the round; the process stays)
* ``exit``     ``shutdown()`` and exit 0 (so does end of input)

It reports on stdout, one line ``EVT <json>`` per event, every event with its
``event`` name and ``t`` (``time.monotonic()``, the machine-wide monotonic clock):

* ``ready``        handler created: ``node_id``, ``torch`` (torch integration active)
* ``key-written``  this node just wrote its join key: ``round``, ``key``
* ``rendezvous``   ``next_rendezvous()`` returned: ``node_id``, ``rank``, ``world_size``,
  ``round``, ``members`` (node ids in rank order), ``elapsed``, ``info_type``, ``torch``
* ``error``        ``next_rendezvous()`` raised: ``kinds`` (the exception's classes,
  ``module.qualname``), ``message``, ``elapsed``
* ``waiting``      ``num_nodes_waiting()`` changed: ``n``, ``round`` (polled every 50 ms)
* ``closed``, ``status``, ``shutdown``, ``exit``: answers to the commands

With torch installed ``next_rendezvous()`` returns torch's ``RendezvousInfo`` (no
round, no members): the node then reads the round from the handler and the member
list from the round's result key.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from typing import Any

MARK = "EVT "
_print_lock = threading.Lock()


def emit(event: str, **fields: Any) -> None:
    line = MARK + json.dumps({"event": event, "t": time.monotonic(), **fields})
    with _print_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _watchdog(seconds: float) -> None:
    time.sleep(seconds)
    emit("watchdog", after=seconds)
    os._exit(70)


def _kinds(exc: BaseException) -> list[str]:
    return [f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__]


class Node:
    def __init__(self, spec: dict[str, Any]) -> None:
        import etcd_rdzv

        params = etcd_rdzv.RendezvousParameters(
            spec["backend"],
            spec["endpoint"],
            spec["run_id"],
            spec["min_nodes"],
            spec["max_nodes"],
            **spec["config"],
        )
        self.handler = etcd_rdzv.create_handler(params)
        self._report_join_keys()
        threading.Thread(target=self._monitor, name="monitor", daemon=True).start()
        emit(
            "ready",
            node_id=self.handler.node_id,
            torch=sys.modules.get("etcd_rdzv.torch") is not None,
            handler_type=type(self.handler).__qualname__,
        )

    def _monitor(self) -> None:
        last: int | None = None
        while True:
            n = self.handler.num_nodes_waiting()
            if n != last:
                emit("waiting", n=n, round=self.handler._round)
                last = n
            time.sleep(0.05)

    def _report_join_keys(self) -> None:
        """Emit ``key-written`` right after each write of this node's join key.

        Wraps ``put_owned`` and ``put_owned_and_get`` of the handler's KV client (this
        instance only), the methods join keys are written with, so the event follows
        the write exactly, however fast the round then completes.
        """
        from etcd_rdzv import _keys

        h = self.handler
        kv = h._kv
        put_owned = kv.put_owned
        suffix = "/nodes/" + _keys.b64_key(h.node_id)

        def put_and_report(key: str, value: str, ttl: int) -> Any:
            record = put_owned(key, value, ttl)
            where = _keys.round_of(h._rdzv, key)
            if where is not None and key.endswith(suffix):
                emit("key-written", round=where[0], key=key)
            return record

        kv.put_owned = put_and_report  # type: ignore[method-assign]
        put_owned_and_get = kv.put_owned_and_get

        def put_get_and_report(key: str, value: str, ttl: int, other: str) -> Any:
            result = put_owned_and_get(key, value, ttl, other)  # may call put_owned (v2)
            where = _keys.round_of(h._rdzv, key)
            if kv.api != "v2" and where is not None and key.endswith(suffix):
                emit("key-written", round=where[0], key=key)
            return result

        kv.put_owned_and_get = put_get_and_report  # type: ignore[method-assign]

    def _members(self, info: Any, round_no: int) -> list[str]:
        members = getattr(info, "members", None)
        if members is not None:
            return list(members)
        from etcd_rdzv import _keys

        h = self.handler
        record, _ = h._kv.get(_keys.result_key(h.settings.key_prefix, h.get_run_id(), round_no))
        return list(json.loads(record.value)["members"]) if record else []

    def join(self) -> None:
        started = time.monotonic()
        try:
            info = self.handler.next_rendezvous()
        except Exception as exc:
            emit("error", kinds=_kinds(exc), message=str(exc), elapsed=time.monotonic() - started)
            return
        elapsed = time.monotonic() - started
        round_no = getattr(info, "round", None) or self.handler._round
        emit(
            "rendezvous",
            node_id=self.handler.node_id,
            rank=info.rank,
            world_size=info.world_size,
            round=round_no,
            members=self._members(info, round_no),
            elapsed=elapsed,
            info_type=f"{type(info).__module__}.{type(info).__qualname__}",
            torch=sys.modules.get("etcd_rdzv.torch") is not None,
        )

    def serve(self, lines: Any) -> int:
        for line in lines:
            command = line.strip()
            if command == "join":
                self.join()
            elif command == "close":
                self.handler.set_closed()
                emit("closed")
            elif command == "status":
                emit(
                    "status",
                    waiting=self.handler.num_nodes_waiting(),
                    is_closed=self.handler.is_closed(),
                    round=self.handler._round,
                )
            elif command == "shutdown":
                emit("shutdown", ok=self.handler.shutdown())
            elif command == "exit":
                break
            elif command:
                emit("unknown", command=command)
        self.handler.shutdown()
        emit("exit")
        return 0


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    if spec.get("torch") is False:
        sys.modules["torch"] = None  # type: ignore[assignment]  # find_spec -> None
    threading.Thread(
        target=_watchdog, args=(float(spec.get("max_life", 120)),), daemon=True
    ).start()
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s",
    )
    return Node(spec).serve(sys.stdin)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
