"""The store kinds of the node program: ``store`` (our
:class:`~etcd_rdzv.EtcdStore`) and ``torch-store`` (torch's python-etcd one), both in
the store directory of the run the parameters name; the commands ``write``, ``add``
and ``get`` (see :mod:`fleet.node_kinds` for roles)."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, ClassVar

from .node_kinds import Action, Host, Role, ours_params, type_name
from .protocol import Command, CommandName, NodeKind, ParamsSpec


def build_store(kind: NodeKind, p: ParamsSpec, timeout: float | None) -> tuple[Any, Any]:
    """``(store, client)``: the store of the run ``p`` names (its ``store`` directory),
    ours (``store``) or torch's python-etcd one (``torch-store``)."""
    from etcd_rdzv import _keys
    from etcd_rdzv.config import params

    prefix = _keys.store_dir(p["config"].get("key_prefix", params.DEFAULT_KEY_PREFIX), p["run_id"])
    if kind == "store":
        import etcd_rdzv

        client = etcd_rdzv.create_client(ours_params(p))
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


class StoreNode(Role):
    """A node with a store (kinds ``store`` and ``torch-store``)."""

    def __init__(self, host: Host) -> None:
        super().__init__(host)
        spec = host.spec
        self.store, self._client = build_store(spec["kind"], spec["params"], spec.get("timeout"))
        self.writer = uuid.uuid4().hex[:8]  # makes every written value unique

    def describe(self) -> dict[str, Any]:
        endpoints = getattr(self._client, "endpoints", None)
        return {
            "endpoint": endpoints[0] if endpoints else None,
            "store_type": type_name(self.store),
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

    COMMANDS: ClassVar[Mapping[CommandName, Action]] = {
        "prepare": Role.do_prepare,
        "write": do_write,
        "add": do_add,
        "get": do_get,
    }

    def close(self) -> None:
        close = getattr(self._client, "close", None)
        if callable(close):
            close()
