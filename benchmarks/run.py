"""Benchmark etcd_rdzv's rendezvous beside PyTorch's own handlers: one command.

    python3 -m benchmarks.run                       # everything; writes docs/benchmarks.md
    python3 -m benchmarks.run --quick --out /tmp/b.md   # a smoke run in well under a minute

What it measures (see ``docs/benchmarks.md`` for a run's results):

* **time to rendezvous**: N nodes are started and build their handler (imports,
  connection) first; then one "go" byte per process is written to a pipe they all
  block on, and each node records ``time.monotonic()`` (one clock for all processes on
  Linux) when ``next_rendezvous()`` returned. Time = last node's moment - go. Every
  handler gets ``min_nodes = max_nodes = N``, so none waits for a last call;
* **etcd requests and writes per node** during that (from the go signal to
  ``--count-tail`` seconds after the last node held its rank), counted by etcd itself
  (:mod:`benchmarks._etcd`), and the CPU seconds the machine and etcd spent from go to
  the last rank;
* **steady state**: etcd requests per second per member after completion, while each
  node calls ``num_nodes_waiting()`` every 0.1 s (torch's elastic agent's default
  ``monitor_interval``) and keeps its heartbeats;
* **member death to the survivors' next completed round** (our handler): a member is
  SIGKILLed; the survivors notice through ``num_nodes_waiting()`` and join the next
  round with a handler of ``min_nodes = N - 1`` and no last call;
* **store get latency** when another process sets the key;
* **import time** of ``etcd_rdzv``;
* **large N** (our handler, on each API): ``--large-nodes`` nodes as processes, and as
  threads in ``--large-procs`` processes, with the same figures as the rendezvous part;
  beside each, an **estimated floor** for this machine. A client process first does
  ``--floor-requests`` plain reads and as many plain writes on each API
  (:func:`benchmarks._etcd.calibrate`), which gives the client's and etcd's CPU time
  per read and per write; then floor(N) = N x requests per node (as measured in the
  large run, from go to the last rank) x CPU per request (read and write costs, in
  the run's mix) / cores.

Handlers: ``ours`` (etcd_rdzv's handler, per ``--api``), ``ours-dynamic`` (torch's
``DynamicRendezvousHandler`` over etcd_rdzv's backend and store, per ``--api``),
``etcd-v2`` (torch's, python-etcd backend), ``etcd`` (torch's legacy
``EtcdRendezvousHandler``), ``c10d`` (torch's, a ``TCPStore`` hosted by one node).
torch's handlers speak the v2 API only, so they run on the v2 member. Nodes are
processes, except that torch's handlers run as threads (``--torch-procs`` processes)
above ``--threads-above`` nodes: 256 torch processes do not fit in memory.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from etcd_rdzv import RendezvousParameters
from etcd_rdzv.testing.fleet import Event, Fleet, FleetError, Node, NodeKind, child_env

from . import _report
from ._etcd import (
    Member,
    calibrate,
    cost_dict,
    counts,
    cpu_seconds,
    etcd_version,
    machine_cpu_seconds,
    scrape,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
HANDLERS = ("ours", "ours-dynamic", "etcd-v2", "etcd", "c10d")
TORCH_KINDS = frozenset({"ours-dynamic", "etcd-v2", "etcd", "c10d"})
# The fleet's node kind and the backend name of each handler: torch's own handlers
# come from torch's registry under their own names.
NODE_KINDS: dict[str, tuple[NodeKind, str]] = {
    "ours": ("ours", "etcd-rdzv"),
    "ours-dynamic": ("dynamic", "etcd-rdzv-dynamic"),
}
MONITOR_INTERVAL = 0.1  # torch's elastic agent's default monitor_interval


@dataclass(frozen=True)
class Series:
    """One line of the results: a handler, and the etcd API it talks (None: c10d)."""

    handler: str
    api: str | None

    @property
    def key(self) -> str:
        return self.handler if self.api is None else f"{self.handler}/{self.api}"


def v3_available() -> bool:
    """Whether this etcd_rdzv speaks the v3 API (it names the APIs it supports)."""
    from etcd_rdzv import params

    return "v3" in params.SUPPORTED_APIS


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def spread(n: int, procs: int) -> list[int]:
    """Nodes per process: ``n`` nodes over ``procs`` processes (0: one node each)."""
    procs = min(procs, n)
    if procs:
        return [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    return [1] * n


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.members: dict[str, Member] = {}
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

    # -- set-up ------------------------------------------------------------------------

    def member(self, api: str) -> Member:
        if api not in self.members:
            if self.args.endpoint:
                self.members[api] = Member(self.args.endpoint, api)
            else:
                self.members[api] = Member.start(api)
        return self.members[api]

    def close(self) -> None:
        for member in self.members.values():
            member.stop()

    def fresh_members(self) -> None:
        """Stop the members started so far; the next measurement starts new ones. A
        member that served an hour of runs holds a large store (a v2 member 1.2 GB),
        which 1024 node processes beside it cannot afford: the kernel killed one."""
        if self.args.endpoint:
            return
        self.close()
        self.members.clear()

    def settle(self, quiet: float = 0.1, longest: float = 90.0) -> float:
        """Wait until the machine is quiet (under ``quiet`` of its cores busy over a
        second), at most ``longest`` seconds; the seconds waited. A large run leaves
        the machine busy for a while after its last rank (1024 processes exiting,
        their memory given back): the next run would measure that too."""
        began = time.monotonic()
        cores = os.cpu_count() or 1
        while time.monotonic() - began < longest:
            before = machine_cpu_seconds()
            time.sleep(1.0)
            after = machine_cpu_seconds()
            if before is None or after is None or after - before < quiet * cores:
                break
        return time.monotonic() - began

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
    ) -> tuple[Fleet, list[Node]]:
        """The node processes of one measurement (nodes per process: ``layout``, by
        default :meth:`layout`), built but not joined.

        ``poll``: the nodes call ``num_nodes_waiting()`` that often after their round;
        ``rejoin``: and join the next round with these parameters once it is positive.
        Nodes report only what is measured (``detail=False``).
        """
        if params is None:
            run_id = f"bench-{series.handler}-{n}-{uuid.uuid4().hex[:8]}"
            params = self.params(series, n, run_id)
        workdir = Path(tempfile.mkdtemp(prefix=f"{series.handler}-{n}-", dir=self.workdir))
        fleet = Fleet(workdir, env=bench_env(), max_life=900.0)
        kind, _ = NODE_KINDS.get(series.handler, ("torch", series.handler))
        nodes = [
            fleet.start(
                f"p{index}",
                params,
                kind=kind,
                nodes=size,
                host=index == 0,
                poll=poll,
                rejoin=rejoin,
                detail=False,
                log_level="WARNING",
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
        """Our handlers prepare their next join again (its key's lease, the watch of
        its round): each did when it was built, but a fleet of 1024 processes takes
        minutes to start, and a lease prepared more than half its TTL (a watch more
        than ``read_timeout``) before the join is made anew inside it (an agent joins
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

    # -- measurements ------------------------------------------------------------------

    def rendezvous(self, series: Series, n: int, rep: int) -> None:
        row: dict[str, Any] = {"series": series.key, "n": n, "rep": rep}
        layout = self.layout(series, n)
        row["layout"] = "processes" if max(layout) == 1 else f"threads in {len(layout)} processes"
        failed_at = self.failed.get(series.key)
        if failed_at is not None and n >= failed_at:
            # It already failed at this or a smaller N: do not spend the timeout again.
            row.update(seconds=None, error=f"skipped: failed at N={failed_at}", skipped=True)
            self.results["rendezvous"].append(row)
            self.log(f"  {series.key:<16} N={n:<4} rep {rep}: skipped (failed at N={failed_at})")
            return
        row.update(self.measure(series, n, layout))
        if row.get("seconds") is None:
            self.failed.setdefault(series.key, n)
        self.results["rendezvous"].append(row)
        self.log(f"  {series.key:<16} N={n:<4} rep {rep}: {self.shown(row)}")

    def large(self, series: Series, procs: int, rep: int) -> dict[str, Any]:
        """One rendezvous of ``--large-nodes`` nodes of our handler: as processes
        (``procs`` 0) or as threads in ``procs`` processes."""
        assert series.api is not None
        n = self.args.large_nodes
        layout = spread(n, procs)
        row: dict[str, Any] = {
            "series": series.key,
            "api": series.api,
            "n": n,
            "rep": rep,
            "layout": "threads" if procs else "processes",
            "procs": len(layout),
        }
        row["settled"] = round(self.settle(), 1)
        row.update(self.measure(series, n, layout))
        self.results["large"].append(row)
        where = f"threads in {len(layout)} processes" if procs else "processes"
        self.log(
            f"  large {series.key:<8} N={n} as {where}, rep {rep} "
            f"(after {row['settled']:.0f}s of settling): {self.shown(row)}"
        )
        return row

    def measure(self, series: Series, n: int, layout: list[int]) -> dict[str, Any]:
        """One rendezvous of ``n`` nodes, ``layout`` nodes per process: seconds from
        go to the last rank, CPU seconds over that window, etcd's counts per node."""
        row: dict[str, Any] = {}
        fleet, nodes = self.fleet(series, n, layout=layout)
        try:
            fleet.ready(timeout=self.ready_timeout(series, len(layout)))
            self.prepare(fleet, nodes)
            member = self.members.get(series.api) if series.api else None
            before = scrape(member.url) if member else None
            busy_before = machine_cpu_seconds()
            go = self.go(fleet, nodes)
            done = self.rounds(fleet, n, self.args.timeout)
            busy_after = machine_cpu_seconds()
            at_end = scrape(member.url) if member else None
            last = max(e["t"] for e in done)
            # Where the CPU went while the nodes joined (2 cores: the floor is what
            # the work costs, not the round trips): etcd's own and the whole machine's.
            if busy_before is not None and busy_after is not None:
                row["machine_cpu"] = busy_after - busy_before
            etcd_cpu = [cpu_seconds(m) for m in (before, at_end) if m is not None]
            if len(etcd_cpu) == 2 and None not in etcd_cpu:
                row["etcd_cpu"] = etcd_cpu[1] - etcd_cpu[0]  # type: ignore[operator]
            row["seconds"] = last - go
            row["node_seconds"] = sorted(round(e["t"] - go, 4) for e in done)
            ranks = sorted(e["rank"] for e in done)
            worlds = {e["world_size"] for e in done}
            if ranks != list(range(n)) or worlds != {n}:
                row["error"] = f"inconsistent ranks {ranks[:10]}... or world sizes {worlds}"
            if member is not None and before is not None:
                if at_end is not None:
                    # Up to the last rank only (the scrape just after it): what the
                    # estimated floor of the large part is made of.
                    c = counts(before, at_end, member.api)
                    row["requests_to_rank"] = c.requests / n
                    row["writes_to_rank"] = c.writes / n
                time.sleep(max(last + self.args.count_tail - time.monotonic(), 0.0))
                c = counts(before, scrape(member.url), member.api)
                row["requests"] = c.requests / n
                row["writes"] = c.writes / n
        except FleetError as exc:
            row["error"] = str(exc).splitlines()[0][:300]
            row["seconds"] = None
        finally:
            fleet.stop()
        return row

    @staticmethod
    def shown(row: dict[str, Any]) -> str:
        """A measured rendezvous in one line of the log."""
        text = f"{row['seconds']:.3f}s" if row.get("seconds") is not None else "-"
        if "requests" in row:
            text += f" {row['requests']:.1f} req/node {row['writes']:.2f} writes/node"
        if "machine_cpu" in row:
            text += f" cpu: machine {row['machine_cpu']:.2f}s"
            if "etcd_cpu" in row:
                text += f" etcd {row['etcd_cpu']:.2f}s"
        if "error" in row:
            text += f"  ERROR {row['error']}"
        return text

    def calibrate(self, api: str) -> None:
        """The client's and etcd's CPU per plain read and write on ``api`` (the floor's
        inputs); on failure the floor is left out, the run goes on."""
        count = self.args.floor_requests
        entry: dict[str, Any] = {"count": count, "cores": usable_cores()}
        try:
            costs = calibrate(self.member(api), count, bench_env(), REPO_ROOT)
        except RuntimeError as exc:
            entry["error"] = str(exc).splitlines()[0][:300]
            self.log(f"  calibration {api}: ERROR {entry['error']}")
        else:
            entry.update({kind: cost_dict(cost) for kind, cost in costs.items()})
            self.log(
                f"  calibration {api}, {count} plain requests of each kind, CPU per request: "
                + ", ".join(
                    f"{kind} {c.client * 1000:.3f} ms client + {c.etcd * 1000:.3f} ms etcd"
                    for kind, c in costs.items()
                )
            )
        self.results["calibration"][api] = entry

    def steady(self, series: Series, n: int) -> None:
        assert series.api is not None
        row: dict[str, Any] = {"series": series.key, "n": n, "window": self.args.steady_window}
        fleet, nodes = self.fleet(series, n, poll=MONITOR_INTERVAL)
        try:
            self.start(fleet, nodes, series)
            self.rounds(fleet, n, self.args.timeout)
            time.sleep(self.args.steady_settle)
            member = self.members[series.api]
            before = scrape(member.url)
            time.sleep(self.args.steady_window)
            c = counts(before, scrape(member.url), member.api)
            row["rate"] = c.requests / n / self.args.steady_window
            row["write_rate"] = c.writes / n / self.args.steady_window
        except FleetError as exc:
            row["error"] = str(exc).splitlines()[0][:300]
        finally:
            fleet.stop()
        self.results["steady"].append(row)
        shown = f"{row['rate']:.3f} req/s/node" if "rate" in row else f"ERROR {row['error']}"
        self.log(f"  steady {series.key:<16} N={n}: {shown}")

    def death(self, series: Series, n: int, rep: int) -> None:
        interval, attempts = self.args.keep_alive_interval, self.args.keep_alive_max_attempt
        bound = interval * attempts + 1.0
        row: dict[str, Any] = {"series": series.key, "n": n, "rep": rep, "bound": bound}
        alive = {"keep_alive_interval": interval, "keep_alive_max_attempt": attempts}
        run_id = f"bench-death-{n}-{uuid.uuid4().hex[:8]}"
        first = self.params(series, n, run_id, **alive)
        second = self.params(series, n, run_id, min_nodes=n - 1, last_call_timeout=0, **alive)
        fleet, nodes = self.fleet(series, n, params=first, poll=MONITOR_INTERVAL, rejoin=second)
        try:
            self.start(fleet, nodes, series)
            self.rounds(fleet, n, self.args.timeout)
            time.sleep(1.0 + random.uniform(0.0, interval))  # any phase of the heartbeat
            killed = nodes[1].kill()
            done = self.rounds(fleet, n - 1, bound + 30, rejoined=True)
            row["seconds"] = max(e["t"] for e in done) - killed
            row["detected"] = max(e["detected"] for e in done) - killed
            worlds = {e["world_size"] for e in done}
            if worlds != {n - 1}:
                row["error"] = f"next round of size {worlds}, not {n - 1}"
        except FleetError as exc:
            row["error"] = str(exc).splitlines()[0][:300]
        finally:
            fleet.stop()
        self.results["death"].append(row)
        shown = (
            f"{row['seconds']:.2f}s (detected after {row['detected']:.2f}s, bound {bound:.0f}s)"
            if "seconds" in row
            else f"ERROR {row.get('error')}"
        )
        self.log(f"  death {series.key:<16} N={n} rep {rep}: {shown}")

    def store(self, kind: str, api: str) -> None:
        row: dict[str, Any] = {"kind": kind, "api": api}
        tag = uuid.uuid4().hex[:8]
        params = RendezvousParameters(
            "etcd-rdzv",
            self.member(api).endpoint,
            f"bench-store-{tag}",
            1,
            1,
            api=api,
            key_prefix=f"/bench-store/{tag}",
        )
        workdir = Path(tempfile.mkdtemp(prefix=f"store-{kind}-{api}-", dir=self.workdir))
        latencies: list[float] = []
        with Fleet(workdir, env=bench_env()) as fleet:
            waiter, setter = (
                fleet.start(
                    name,
                    params,
                    kind="store" if kind == "ours" else "torch-store",
                    timeout=30.0,
                    log_level="WARNING",
                )
                for name in ("waiter", "setter")
            )
            try:
                fleet.ready(timeout=60.0)
                for i in range(self.args.store_samples):
                    key = f"k{i}-0"  # what ``write`` with tag k<i> sets first

                    def this_key(e: Event, key: str = key) -> bool:
                        return bool(e["key"] == key)

                    waiter.send("get", key=key)
                    fleet.wait(waiter, "getting", 30.0, this_key)
                    time.sleep(0.05)  # let the waiter's read and watch reach etcd
                    setter.send("write", tag=f"k{i}", count=1)
                    t_set = fleet.wait(setter, "ack", 30.0, this_key)["started"]
                    latencies.append(fleet.wait(waiter, "got", 30.0, this_key)["t"] - t_set)
            except FleetError as exc:
                row["error"] = str(exc).splitlines()[0][:300]
            finally:
                fleet.stop(timeout=10.0)
        row["samples"] = latencies
        if latencies:
            row["median"] = statistics.median(latencies)
            row["p90"] = sorted(latencies)[int(0.9 * (len(latencies) - 1))]
            row["max"] = max(latencies)
        self.results["store"].append(row)
        shown = (
            f"median {row['median'] * 1000:.2f} ms, p90 {row['p90'] * 1000:.2f} ms"
            if latencies
            else f"ERROR {row.get('error')}"
        )
        self.log(f"  store get after a remote set, {kind} {api}: {shown}")

    def imports(self) -> None:
        code = "import time; t = time.perf_counter(); import {mod}; print(time.perf_counter() - t)"
        todo = [("etcd_rdzv", self.args.import_reps)]
        if torch_available() and set(self.args.handlers) & TORCH_KINDS:
            todo.append(("torch.distributed.elastic.rendezvous", 3))
        for module, reps in todo:
            times = []
            for _ in range(reps):
                out = subprocess.run(
                    [sys.executable, "-c", code.format(mod=module)],
                    capture_output=True,
                    text=True,
                    env=bench_env(),
                    cwd=str(REPO_ROOT),
                    check=True,
                )
                times.append(float(out.stdout.strip()))
            self.results["imports"][module] = times
            self.log(f"  import {module}: median {statistics.median(times) * 1000:.0f} ms")


def run_large(bench: Bench, ours: list[Series]) -> None:
    """The large part: calibrate each API first (on a machine the large runs have not
    loaded yet), then each API and layout; print each row's estimated floor."""
    args = bench.args
    bench.log(f"large N={args.large_nodes}, our handler; calibration of the floor first")
    bench.fresh_members()
    for s in ours:
        assert s.api is not None
        bench.calibrate(s.api)
    layouts = ([args.large_procs] if args.large_procs else []) + [0]
    for s in ours:
        for procs in layouts:
            for rep in range(1, args.large_reps + 1):
                row = bench.large(s, procs, rep)
                floor = _report.floor(row, bench.results["calibration"].get(s.api))
                if floor is not None:
                    bench.log(f"    estimated floor: {_report.floor_formula(row, floor)}")


def bench_env() -> dict[str, str]:
    """The nodes' environment: torch's elastic logging at WARNING unless set."""
    return child_env(LOGLEVEL=os.environ.get("LOGLEVEL", "WARNING"))


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gib"] = round(int(line.split()[1]) / 1024 / 1024, 1)
    return info


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"etcd": etcd_version()}
    for dist in ("etcd_rdzv", "torch", "python-etcd", "urllib3", "matplotlib"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _csv(kind: type, allowed: tuple[str, ...] | None = None) -> Any:
    def parse(text: str) -> list[Any]:
        items = [kind(x.strip()) for x in text.split(",") if x.strip()]
        if allowed is not None:
            bad = [x for x in items if x not in allowed]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {allowed}")
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        return items

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 -m benchmarks.run",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("--nodes", type=_csv(int), help="node counts (default 2,8,32,128,256)")
    parser.add_argument("--reps", type=int, help="repetitions of each rendezvous (default 3)")
    parser.add_argument(
        "--handlers",
        type=_csv(str, HANDLERS),
        help=f"handlers (default {','.join(HANDLERS)}; --quick: ours)",
    )
    parser.add_argument(
        "--api",
        type=_csv(str, ("v2", "v3")),
        help="etcd APIs for our handler and backend (default v2,v3 when v3 is available)",
    )
    parser.add_argument(
        "--endpoint", help="host:port of an etcd to use (http, both APIs); default: start our own"
    )
    parser.add_argument("--out", type=Path, help="markdown report (default docs/benchmarks.md)")
    parser.add_argument("--plot", type=Path, help="PNG plot (default: the report's name with .png)")
    parser.add_argument("--json", type=Path, help="raw results (default: the report's name .json)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: small N, short waits")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per rendezvous")
    parser.add_argument("--threads-above", type=int, default=32)
    parser.add_argument("--torch-procs", type=int, default=8)
    parser.add_argument(
        "--ours-procs",
        type=int,
        default=0,
        help="our handler's nodes as threads in this many processes (default 0: one each)",
    )
    parser.add_argument("--steady-nodes", type=int, help="N of the steady-state run (default 8)")
    parser.add_argument("--steady-window", type=float, help="seconds counted (default 60)")
    parser.add_argument("--steady-settle", type=float, help="seconds before counting (default 10)")
    parser.add_argument("--death-nodes", type=int, help="N of the member-death run (default 8)")
    parser.add_argument("--keep-alive-interval", type=int, help="(default 5, torch's default)")
    parser.add_argument("--keep-alive-max-attempt", type=int, help="(default 3)")
    parser.add_argument("--store-samples", type=int, help="store latency samples (default 50)")
    parser.add_argument("--import-reps", type=int, help="(default 7)")
    parser.add_argument(
        "--count-tail",
        type=float,
        help="seconds after the last rank that etcd's requests are still counted "
        "(default 3; --quick: 0)",
    )
    parser.add_argument(
        "--large-nodes",
        type=int,
        help="N of the large part, our handler (default 1024; --quick: 16)",
    )
    parser.add_argument(
        "--large-procs",
        type=int,
        help="the large part's nodes as threads in this many processes, besides the "
        "run with one process each (default 32; --quick: 2; 0: processes only)",
    )
    parser.add_argument("--large-reps", type=int, help="repetitions of the large part (default 1)")
    parser.add_argument(
        "--floor-requests",
        type=int,
        help="plain reads, and as many writes, of the floor's calibration "
        "(default 300; --quick: 100)",
    )
    parser.add_argument(
        "--skip",
        type=_csv(str, ("rendezvous", "steady", "death", "store", "imports", "large")),
        default=[],
        help="parts to skip: rendezvous,steady,death,store,imports,large",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    defaults: dict[str, Any] = {
        "nodes": [2, 4] if quick else [2, 8, 32, 128, 256],
        "reps": 1 if quick else 3,
        "handlers": ["ours"] if quick else list(HANDLERS),
        "api": ["v2", "v3"] if v3_available() else ["v2"],
        "out": REPO_ROOT / "docs" / "benchmarks.md",
        "steady_nodes": 4 if quick else 8,
        "steady_window": 3.0 if quick else 60.0,
        "steady_settle": 1.0 if quick else 10.0,
        "death_nodes": 4 if quick else 8,
        "keep_alive_interval": 1 if quick else 5,
        "keep_alive_max_attempt": 2 if quick else 3,
        "store_samples": 10 if quick else 50,
        "import_reps": 3 if quick else 7,
        "count_tail": 0.0 if quick else 3.0,
        "large_nodes": 16 if quick else 1024,
        "large_procs": 2 if quick else 32,
        "large_reps": 1,
        "floor_requests": 100 if quick else 300,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name, least in (
        ("large_nodes", 1),
        ("large_procs", 0),
        ("large_reps", 1),
        ("floor_requests", 1),
        ("count_tail", 0),
    ):
        if getattr(args, name) < least:
            option = "--" + name.replace("_", "-")
            parser.error(f"{option} {getattr(args, name)}: must be at least {least}")
    if args.plot is None:
        args.plot = args.out.with_suffix(".png")
    if args.json is None:
        args.json = args.out.with_suffix(".json")
    if "v3" in args.api and not v3_available():
        parser.error("--api v3: this etcd_rdzv has no v3 API yet")
    if set(args.handlers) & TORCH_KINDS and not torch_available():
        parser.error(f"handlers {sorted(set(args.handlers) & TORCH_KINDS)} need torch")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    workdir = Path(tempfile.mkdtemp(prefix="etcd-rdzv-bench-"))
    bench = Bench(args, workdir)
    results = bench.results
    results.update(
        count_tail=args.count_tail,
        started=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        load_before=os.getloadavg(),
        machine=machine(),
        versions=versions(),
        args={
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("out", "plot", "json")
        },
    )
    bench.log(f"load average before: {results['load_before']}; work dir {workdir}")
    try:
        series = bench.series()
        ours = [s for s in series if s.handler == "ours"]
        if "imports" not in args.skip:
            bench.imports()
        if "store" not in args.skip:
            for api in args.api:
                bench.store("ours", api)
            if "etcd-v2" in args.handlers:
                bench.store("torch-etcd", "v2")
        if "rendezvous" not in args.skip:
            for n in args.nodes:
                bench.log(f"rendezvous, N={n}")
                for rep in range(1, args.reps + 1):
                    for s in series:
                        bench.rendezvous(s, n, rep)
        if "steady" not in args.skip:
            for s in series:
                if s.api is not None:
                    bench.steady(s, args.steady_nodes)
        if "death" not in args.skip:
            for s in ours:
                for rep in range(1, args.reps + 1):
                    bench.death(s, args.death_nodes, rep)
        if "large" not in args.skip:
            if ours:
                run_large(bench, ours)
            else:
                bench.log("large N: skipped (it runs our handler only: --handlers ours)")
    finally:
        bench.close()
    results["load_after"] = os.getloadavg()
    results["seconds"] = time.time() - started
    bench.log(f"load average after: {results['load_after']}; took {results['seconds']:.0f}s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    plotted = _report.plot(results, args.plot)
    args.out.write_text(_report.markdown(results, args.plot if plotted else None, args.out))
    bench.log(f"wrote {args.out}, {args.json}" + (f", {args.plot}" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
