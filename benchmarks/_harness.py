"""The benchmark's set-up: its etcd members, and the node processes of one measurement,
built, prepared and started at one go signal.

Every measurement (:mod:`benchmarks._measure`, :mod:`benchmarks._large`) is made on a
:class:`Harness`; its nodes are processes of :mod:`fleet`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from etcd_rdzv import RendezvousParameters
from fleet import Event, Fleet, Node, NodeKind, child_env

from ._cluster import rotated, with_endpoint
from ._etcd import Member

REPO_ROOT = Path(__file__).resolve().parent.parent
HANDLERS = ("ours", "ours-dynamic", "etcd-v2", "etcd", "c10d")
TORCH_KINDS = frozenset({"ours-dynamic", "etcd-v2", "etcd", "c10d"})
# The fleet's node kind and the backend name of each handler: torch's own handlers
# come from torch's registry under their own names.
NODE_KINDS: dict[str, tuple[NodeKind, str]] = {
    "ours": ("ours", "etcd-rdzv"),
    "ours-dynamic": ("dynamic", "etcd-rdzv-dynamic"),
}


@dataclass(frozen=True)
class Series:
    """One line of the results: a handler, and the etcd API it talks (None: c10d)."""

    handler: str
    api: str | None

    @property
    def key(self) -> str:
        return self.handler if self.api is None else f"{self.handler}/{self.api}"


def v2_available() -> bool:
    """Whether the ``v2`` extra is installed (python-etcd: our v2 API and torch's etcd
    handlers use it)."""
    return importlib.util.find_spec("etcd") is not None


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def nvrx_available() -> bool:
    """NVIDIA's resiliency extension (the nvrx extra) importable."""
    return importlib.util.find_spec("nvidia_resiliency_ext") is not None


def spread(n: int, procs: int) -> list[int]:
    """Nodes per process: ``n`` nodes over ``procs`` processes (0: one node each)."""
    procs = min(procs, n)
    if procs:
        return [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    return [1] * n


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def bench_env() -> dict[str, str]:
    """The nodes' environment: torch's elastic logging at WARNING unless set."""
    env = {"LOGLEVEL": os.environ.get("LOGLEVEL", "WARNING")}
    if os.environ.get("FLEET_SWITCH_INTERVAL"):  # --switch-interval
        env["FLEET_SWITCH_INTERVAL"] = os.environ["FLEET_SWITCH_INTERVAL"]
    return child_env(**env)


class Harness:
    """One run's etcd members, its results and the set-up of each measurement: the
    parameters and node processes of a series at N, started together at a go signal.
    The measurements themselves are :class:`benchmarks._measure.Bench`'s."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.members: dict[str, Member] = {}
        self.cluster_size = 1  # members of the etcd started for each API
        self.failed: dict[str, int] = {}  # series -> the smallest N it failed at
        self.results: dict[str, Any] = {
            "rendezvous": [],
            "steady": [],
            "death": [],
            "store": [],
            "imports": {},
            "large": [],
            "calibration": {},
        }

    def member(self, api: str) -> Member:
        if api not in self.members:
            if self.args.endpoint:
                self.members[api] = Member(self.args.endpoint, api)
            else:
                self.members[api] = Member.start(api, self.cluster_size)
        return self.members[api]

    def close(self) -> None:
        for member in self.members.values():
            member.stop()

    def fresh_members(self, size: int = 1) -> None:
        """Stop the members started so far; the next measurement starts new ones
        (``size`` members per API: a cluster above 1). A member that served an hour
        of runs holds a large store (a v2 member 1.2 GB), which 1024 node processes
        beside it cannot afford: the kernel killed one."""
        if self.args.endpoint:
            return
        self.close()
        self.members.clear()
        self.cluster_size = size

    def replace_member(self, api: str) -> None:
        """Stop ``api``'s members (a cluster whose leader was killed); the next
        measurement starts new, healthy ones."""
        member = self.members.pop(api, None)
        if member is not None:
            member.stop()

    def series(self) -> list[Series]:
        out: list[Series] = []
        for handler in self.args.handlers:
            if handler in ("ours", "ours-dynamic"):
                out += [Series(handler, api) for api in self.args.api]
            elif handler == "c10d":
                out.append(Series(handler, None))
            else:
                out.append(Series(handler, "v2"))
        return out

    def layout(self, series: Series, n: int) -> list[int]:
        """Nodes per process."""
        procs = 0
        if series.handler in TORCH_KINDS and n > self.args.threads_above:
            procs = self.args.torch_procs
        elif series.handler == "ours":
            procs = self.args.ours_procs
        return spread(n, procs)

    def params(
        self, series: Series, n: int, run_id: str, *, min_nodes: int | None = None, **extra: Any
    ) -> RendezvousParameters:
        join = int(self.args.timeout)
        config: dict[str, Any] = {}
        if series.handler in ("ours", "ours-dynamic"):
            config = {"key_prefix": "/bench", "api": series.api, "join_timeout": join}
        elif series.handler == "etcd-v2":
            config = {"join_timeout": join}
        elif series.handler == "etcd":
            config = {"timeout": join}
        elif series.handler == "c10d":
            config = {"join_timeout": join, "read_timeout": join}
        config.update(extra)
        if series.api is None:
            endpoint = f"127.0.0.1:{_free_port()}"
        else:
            endpoint = self.member(series.api).endpoint
        _, backend = NODE_KINDS.get(series.handler, ("torch", series.handler))
        low = n if min_nodes is None else min_nodes
        return RendezvousParameters(backend, endpoint, run_id, low, n, **config)

    def fleet(
        self,
        series: Series,
        n: int,
        *,
        params: RendezvousParameters | None = None,
        poll: float | None = None,
        rejoin: RendezvousParameters | None = None,
        layout: list[int] | None = None,
        cold: bool = False,
    ) -> tuple[Fleet, list[Node]]:
        """The node processes of one measurement (nodes per process: ``layout``, by
        default :meth:`layout`), built but not joined.

        ``poll``: the nodes call ``num_nodes_waiting()`` that often after their round;
        ``rejoin``: and join the next round with these parameters once it is positive.
        Nodes report only what is measured (``detail=False``); ``cold``: each builds
        its handler in its join, after the go signal. On a cluster, node process
        ``i`` lists the members from member ``i % size`` on (:func:`rotated`).
        """
        if params is None:
            run_id = f"bench-{series.handler}-{n}-{uuid.uuid4().hex[:8]}"
            params = self.params(series, n, run_id)
        workdir = Path(tempfile.mkdtemp(prefix=f"{series.handler}-{n}-", dir=self.workdir))
        fleet = Fleet(workdir, env=bench_env(), max_life=900.0)
        kind, _ = NODE_KINDS.get(series.handler, ("torch", series.handler))
        member = self.members.get(series.api) if series.api else None
        spread_over = member is not None and member.cluster is not None

        def own(p: RendezvousParameters, index: int) -> RendezvousParameters:
            return with_endpoint(p, rotated(p.endpoint, index)) if spread_over else p

        nodes = [
            fleet.start(
                f"p{index}",
                own(params, index),
                kind=kind,
                nodes=size,
                host=index == 0,
                poll=poll,
                rejoin=None if rejoin is None else own(rejoin, index),
                detail=False,
                log_level=os.environ.get("BENCH_NODE_LOG_LEVEL", "WARNING"),
                cold=cold,
            )
            for index, size in enumerate(self.layout(series, n) if layout is None else layout)
        ]
        return fleet, nodes

    def start(self, fleet: Fleet, nodes: list[Node], series: Series) -> float:
        """Wait until every node is built, then start them all at once; the go moment."""
        fleet.ready(timeout=self.ready_timeout(series, len(nodes)))
        self.prepare(fleet, nodes)
        return self.go(fleet, nodes)

    @staticmethod
    def prepare(fleet: Fleet, nodes: list[Node]) -> None:
        """Our handlers prepare their next join again (v3: the watch of its round,
        and the read of the run): each did when it was built, but a fleet of 1024
        processes takes minutes to start, and a watch opened more than
        ``read_timeout`` before the join is opened anew inside it (an agent joins
        right after building its handler). Before anything is counted."""
        asked = time.monotonic()
        for node in nodes:
            node.send("prepare")
        for node in nodes:
            fleet.wait_each(
                [node], "prepared", 60.0, match=lambda e: e["t"] >= asked, count=node.size
            )

    @staticmethod
    def go(fleet: Fleet, nodes: list[Node]) -> float:
        """Every node joins at the same moment (one go pipe): that moment."""
        for node in nodes:
            node.join(go=True)
        return fleet.go()

    @staticmethod
    def rounds(fleet: Fleet, count: int, timeout: float, *, rejoined: bool = False) -> list[Event]:
        """The first ``count`` completed rounds (``rejoined``: of the second handlers);
        any node's error fails the measurement at once."""
        return fleet.wait_total(
            "round",
            count,
            timeout,
            match=lambda e: bool(e.get("rejoined")) == rejoined,
            fail_on=("error",),
        )

    def ready_timeout(self, series: Series, procs: int) -> float:
        per_proc = 3.0 if series.handler in TORCH_KINDS else 0.5  # CPU seconds of imports
        return 60.0 + procs * per_proc

    def log(self, text: str) -> None:
        print(text, flush=True)
