"""One node process of :mod:`benchmarks.scale`: ``threads`` nodes of our handler.

Run as a script (``python3 benchmarks/_scale_node.py SPEC``) with ``PYTHONPATH`` at the
tree of the package under test, so that any commit of it can be measured with the
same harness: it uses only the public API (``create_handler``, ``next_rendezvous``,
``shutdown``). It prints one JSON object per line:

* ``{"ready": pid}`` once the package is imported and the threads wait;
* after ``go`` on stdin, per node, ``{"t", "rank", "world", "node", "built"}`` when
  its ``next_rendezvous()`` returned (``t``: ``time.monotonic()``, one clock for every
  process), or ``{"t", "error"}``;
* after ``stop`` (or the end of stdin) it exits at once, as a killed job would (each
  run has a cluster of its own: nothing is left for the next).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

_out = threading.Lock()


def _say(**fields: Any) -> None:
    line = json.dumps(fields) + "\n"
    with _out:
        sys.stdout.write(line)
        sys.stdout.flush()


def _import_all(package: Any) -> None:
    """Import every module of ``package`` now, before the go signal: an agent has
    its rendezvous package loaded long before it joins. Modules imported lazily by a
    handler's build would otherwise be compiled inside the clock by every node
    process at once (no bytecode is cached where ``PYTHONDONTWRITEBYTECODE`` is set,
    as on the machine of the 4,096-node runs): measured there, more than half of a
    node process's CPU in the first 45 s of a round. A module that cannot be
    imported on a node (torch's, blocked here) is skipped, and so is the testing
    package (pytest and docker, tens of MB in each of 128 processes): a node never
    uses them."""
    import contextlib
    import importlib
    import pkgutil

    testing = package.__name__ + ".testing"
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".", lambda _: None):
        if info.name == testing or info.name.startswith(testing + "."):
            continue
        # torch is blocked on the nodes; docker may be missing
        with contextlib.suppress(Exception):
            importlib.import_module(info.name)


def main(spec: dict[str, Any]) -> None:
    if spec.get("switch_interval"):
        sys.setswitchinterval(float(spec["switch_interval"]))
    sys.modules["torch"] = None  # type: ignore[assignment]  # nodes never import torch
    if spec.get("log_level"):
        import logging

        logging.basicConfig(
            level=spec["log_level"],
            stream=sys.stderr,
            format="%(created).3f %(levelname)s %(threadName)s %(name)s: %(message)s",
        )
    import etcd_rdzv

    _import_all(etcd_rdzv)
    go = threading.Event()
    held: list[Any] = []  # a dropped handler leaves its round (its finalizer)

    def node(endpoint: str) -> None:
        go.wait()
        try:
            params = etcd_rdzv.RendezvousParameters(
                "etcd-rdzv",
                endpoint,
                spec["run_id"],
                spec["n"],
                spec["n"],
                **spec["config"],
            )
            handler = etcd_rdzv.create_handler(params)
            built = time.monotonic()
            held.append(handler)
            info = handler.next_rendezvous()
            rank = getattr(info, "rank", None)
            world = getattr(info, "world_size", None)
            if rank is None:  # a (store, rank, world_size) tuple
                _, rank, world = info
            _say(
                t=time.monotonic(),
                rank=rank,
                world=world,
                round=getattr(info, "round", None),
                node=handler.node_id,
                built=built,
            )
        except Exception as exc:
            _say(t=time.monotonic(), error=f"{type(exc).__name__}: {exc}"[:600])

    threads = [
        threading.Thread(target=node, args=(endpoint,), daemon=True, name=f"node{i}")
        for i, endpoint in enumerate(spec["endpoints"])
    ]
    for thread in threads:
        thread.start()
    _say(ready=os.getpid())
    for line in sys.stdin:
        if line.strip() == "go":
            go.set()
        elif line.strip() == "stop":
            break
    os._exit(0)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
