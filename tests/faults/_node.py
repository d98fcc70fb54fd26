"""One worker process of the fault tests: a rendezvous node or a store client.

Usage: ``python _node.py '<json spec>'``. The spec holds ``mode`` (``rdzv`` or
``store``), ``backend``, ``endpoint``, ``run_id``, ``min_nodes``, ``max_nodes``,
``config`` (the rendezvous options) and ``max_life`` (seconds after which the process
exits on its own, should the test process die).

Neither mode imports torch: ``rdzv`` builds the native handler with
``create_handler(params, use_torch=False)``, ``store`` builds a plain ``EtcdStore`` on
``create_client``. Commands come one per stdin line:

* ``join <n>``        (rdzv) complete ``n`` rounds: call ``next_rendezvous()`` until
  it returned ``n`` times (a failed call is reported and tried again, 3 times at most);
  ``join 0``: until the round number written to the file ``stop-after`` is reached
* ``write <tag> <n>`` (store) set ``n`` keys ``<tag>-<i>`` to unique values
* ``add <key> <n>``   (store) ``add(key, 1)`` ``n`` times
* ``exit``            shut down and exit 0 (so does end of input)

Events go to stdout, one ``EVT <json>`` line each, with ``event`` and ``t``
(``time.monotonic()``, one clock for every process on the machine):

* ``ready``: ``node_id`` (rdzv), ``endpoint`` (the client's current endpoint)
* ``key-written``: (rdzv) the node just wrote its join key in ``round``
* ``round``: (rdzv) ``next_rendezvous()`` returned: ``round``, ``rank``,
  ``world_size``, ``members``, ``elapsed``, ``endpoint``
* ``ack``: (store) ``set`` returned for ``key`` with ``value``
* ``added``: (store) ``add`` returned ``total``
* ``error``: a call raised: ``op``, ``kinds`` (exception classes), ``message``,
  ``elapsed``
* ``done``: a command finished: ``command``, ``elapsed``
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from typing import Any

MARK = "EVT "
MAX_FAILED_IN_A_ROW = 3  # a node gives up ``join <n>`` after this many failed joins
STOP_FILE = "stop-after"
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


def _stop_after(round_no: int) -> bool:
    """For ``join 0``: whether the round number in ``./stop-after`` (the process runs in
    its test's directory) has been reached. Every node stops after the same round, so
    none is left waiting for the others."""
    try:
        with open(STOP_FILE) as f:
            return round_no >= int(f.read().strip() or 0)
    except (OSError, ValueError):
        return False


def _params(spec: dict[str, Any]) -> Any:
    import etcd_rdzv

    return etcd_rdzv.RendezvousParameters(
        spec["backend"],
        spec["endpoint"],
        spec["run_id"],
        spec["min_nodes"],
        spec["max_nodes"],
        **spec["config"],
    )


class RdzvNode:
    def __init__(self, spec: dict[str, Any]) -> None:
        import etcd_rdzv

        self.handler = etcd_rdzv.create_handler(_params(spec), use_torch=False)
        self._report_join_keys()
        emit("ready", node_id=self.handler.node_id, endpoint=self.endpoint())

    def endpoint(self) -> str:
        return str(self.handler._kv.endpoints[0])

    def _report_join_keys(self) -> None:
        """Emit ``key-written`` right after each write of this node's join key."""
        from etcd_rdzv import _keys

        h = self.handler
        kv = h._kv
        put_owned = kv.put_owned
        suffix = "/nodes/" + _keys.b64_key(h.node_id)

        def put_and_report(key: str, value: str, ttl: int) -> Any:
            record = put_owned(key, value, ttl)
            where = _keys.round_of(h._rdzv, key)
            if where is not None and key.endswith(suffix):
                emit("key-written", round=where[0])
            return record

        kv.put_owned = put_and_report  # type: ignore[method-assign]
        put_owned_and_get = kv.put_owned_and_get

        def put_get_and_report(key: str, value: str, ttl: int, other: str) -> Any:
            result = put_owned_and_get(key, value, ttl, other)  # may call put_owned (v2)
            where = _keys.round_of(h._rdzv, key)
            if kv.api != "v2" and where is not None and key.endswith(suffix):
                emit("key-written", round=where[0])
            return result

        kv.put_owned_and_get = put_get_and_report  # type: ignore[method-assign]

    def run(self, args: list[str]) -> None:
        if args[0] != "join":
            emit("unknown", command=args)
            return
        started = time.monotonic()
        wanted, done, failed_in_a_row = int(args[1]), 0, 0
        last_round = 0
        while (
            done < wanted if wanted else not _stop_after(last_round)
        ) and failed_in_a_row < MAX_FAILED_IN_A_ROW:
            began = time.monotonic()
            try:
                info = self.handler.next_rendezvous()
            except Exception as exc:
                # Reported, then tried again as an agent would, so that one failure does
                # not leave the other nodes a node short for every later round.
                emit(
                    "error",
                    op="next_rendezvous",
                    kinds=_kinds(exc),
                    message=str(exc),
                    elapsed=time.monotonic() - began,
                )
                failed_in_a_row += 1
                continue
            done, failed_in_a_row, last_round = done + 1, 0, int(info.round)
            emit(
                "round",
                node_id=self.handler.node_id,
                round=info.round,
                rank=info.rank,
                world_size=info.world_size,
                members=list(info.members),
                elapsed=time.monotonic() - began,
                endpoint=self.endpoint(),
            )
        emit("done", command=args[0], elapsed=time.monotonic() - started)

    def close(self) -> None:
        self.handler.shutdown()
        self.handler._kv.close()


class StoreNode:
    def __init__(self, spec: dict[str, Any]) -> None:
        import etcd_rdzv
        from etcd_rdzv import _keys

        params = _params(spec)
        self.kv = etcd_rdzv.create_client(params)
        prefix = _keys.store_dir(str(params.get("key_prefix")), params.run_id)
        self.store = etcd_rdzv.EtcdStore(self.kv, prefix)
        self.writer = uuid.uuid4().hex[:8]
        emit("ready", endpoint=self.kv.endpoints[0])

    def _attempt(self, op: str, fn: Any) -> tuple[bool, Any]:
        """``(True, result)``, or ``(False, None)`` after reporting the error."""
        began = time.monotonic()
        try:
            return True, fn()
        except Exception as exc:
            emit(
                "error",
                op=op,
                kinds=_kinds(exc),
                message=str(exc),
                elapsed=time.monotonic() - began,
            )
            return False, None

    def run(self, args: list[str]) -> None:
        started = time.monotonic()
        if args[0] == "write":
            tag, count = args[1], int(args[2])
            for i in range(count):
                key, value = f"{tag}-{i}", f"{tag}:{i}:{self.writer}"
                ok, _ = self._attempt(f"set {key}", lambda k=key, v=value: self.store.set(k, v))
                if ok:
                    emit("ack", key=key, value=value)
        elif args[0] == "add":
            key, count = args[1], int(args[2])
            for _ in range(count):
                ok, total = self._attempt(f"add {key}", lambda: self.store.add(key, 1))
                if ok:
                    emit("added", total=total)
        else:
            emit("unknown", command=args)
            return
        emit(
            "done",
            command=args[0],
            elapsed=time.monotonic() - started,
            endpoint=self.kv.endpoints[0],
        )

    def close(self) -> None:
        self.kv.close()


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    threading.Thread(
        target=_watchdog, args=(float(spec.get("max_life", 300)),), daemon=True
    ).start()
    import logging

    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s",
    )
    node: RdzvNode | StoreNode = RdzvNode(spec) if spec["mode"] == "rdzv" else StoreNode(spec)
    for line in sys.stdin:
        args = line.split()
        if not args:
            continue
        if args[0] == "exit":
            break
        node.run(args)
    node.close()
    emit("exit")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
