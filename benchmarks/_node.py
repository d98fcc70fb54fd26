"""One benchmark process: builds one or more rendezvous handlers, waits for "go", joins.

Run by :mod:`benchmarks.run` as ``python3 -m benchmarks._node '<json spec>'``; never
by hand. The spec says which handler (``kind``), its parameters, how many nodes this
process runs (one thread each), what to do after the rendezvous (``mode``), and the
file descriptors of three pipes shared by all processes of a measurement:

* ``go_fd``: the process blocks on reading one byte; the parent writes one byte per
  process at once, so every node starts at the same moment (no sleep anywhere);
* ``stop_fd``: one byte tells the process to shut its handlers down and exit;
* ``report_fd``: the process writes one JSON line per event (short, so each write is
  atomic): ``ready``, ``done`` (a node holds its rank: ``t`` is ``time.monotonic()``,
  one clock for every process on Linux), ``done2`` (death mode: the survivors'
  next round), ``error``, ``stopped``.

Modes after the rendezvous: ``rendezvous`` (idle until stopped), ``steady`` (each
node calls ``num_nodes_waiting()`` every ``monitor_interval`` seconds, as torch's
elastic agent does while its workers are healthy), ``death`` (our handler only: as
``steady``, and once ``num_nodes_waiting()`` turns positive the node leaves and
joins the next round with a second handler, built beforehand with the
``death_params``).

Nodes of our handler never import torch.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any


class Reporter:
    def __init__(self, fd: int, proc: int) -> None:
        self._fd = fd
        self._proc = proc
        self._lock = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        data = {"event": event, "proc": self._proc, "t": time.monotonic(), **fields}
        line = (json.dumps(data) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)


def build(kind: str, params: dict[str, Any], host: bool) -> Any:
    """A handler of ``kind`` for ``params`` (endpoint, run_id, min, max, config)."""
    config = dict(params["config"])
    args = (params["endpoint"], params["run_id"], params["min"], params["max"])
    if kind == "ours":
        import etcd_rdzv

        ours = etcd_rdzv.RendezvousParameters("etcd-rdzv", *args, **config)
        return etcd_rdzv.create_handler(ours, use_torch=False)
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    if kind == "ours-dynamic":
        from etcd_rdzv.torch import create_dynamic_handler

        return create_dynamic_handler(RendezvousParameters("etcd-rdzv-dynamic", *args, **config))
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    if kind == "c10d":
        config["is_host"] = host
    return get_rendezvous_handler(RendezvousParameters(kind, *args, **config))


def _watchdog(seconds: float, report: Reporter) -> None:
    time.sleep(seconds)
    report("error", node=-1, message=f"watchdog: still running after {seconds}s")
    os._exit(70)


class Process:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.report = Reporter(spec["report_fd"], spec["proc"])
        self.kind: str = spec["kind"]
        self.mode: str = spec["mode"]
        self.monitor = float(spec.get("monitor_interval", 0.1))
        self.stop = threading.Event()
        self.handlers: list[Any] = []
        self.spares: list[Any] = []  # death mode: the handler of the next round
        for i in range(spec["nodes"]):
            self.handlers.append(build(self.kind, spec["params"], spec["host"] and i == 0))
            if self.mode == "death":
                self.spares.append(build(self.kind, spec["death_params"], False))

    def node(self, i: int, go: threading.Event) -> None:
        handler = self.handlers[i]
        go.wait()
        try:
            info = handler.next_rendezvous()
        except Exception as exc:
            self.report("error", node=i, message=f"{type(exc).__name__}: {exc}")
            return
        self.report("done", node=i, rank=info.rank, world=info.world_size)
        if self.mode == "rendezvous":
            return
        while not self.stop.is_set():
            waiting = handler.num_nodes_waiting()
            if waiting and self.mode == "death":
                detected = time.monotonic()
                handler.shutdown()
                try:
                    info = self.spares[i].next_rendezvous()
                except Exception as exc:
                    self.report("error", node=i, message=f"{type(exc).__name__}: {exc}")
                    return
                self.report(
                    "done2", node=i, rank=info.rank, world=info.world_size, detected=detected
                )
                return
            self.stop.wait(self.monitor)

    def run(self) -> None:
        go = threading.Event()
        threads = [
            threading.Thread(target=self.node, args=(i, go), name=f"node{i}", daemon=True)
            for i in range(len(self.handlers))
        ]
        for thread in threads:
            thread.start()
        self.report("ready", nodes=len(self.handlers), pid=os.getpid())
        os.read(self.spec["go_fd"], 1)
        go.set()
        os.read(self.spec["stop_fd"], 1)
        self.stop.set()
        for handler in [*self.handlers, *self.spares]:
            try:
                handler.shutdown()
            except Exception as exc:  # reported, then the process ends anyway
                self.report("error", node=-1, message=f"shutdown: {type(exc).__name__}: {exc}")
        self.report("stopped")


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    if spec["kind"] == "ours":
        sys.modules["torch"] = None  # type: ignore[assignment]  # never import it by accident
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s",
    )
    report = Reporter(spec["report_fd"], spec["proc"])
    threading.Thread(target=_watchdog, args=(float(spec["max_life"]), report), daemon=True).start()
    try:
        Process(spec).run()
    except Exception as exc:
        traceback.print_exc()
        report("error", node=-1, message=f"{type(exc).__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
