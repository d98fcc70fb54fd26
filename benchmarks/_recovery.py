"""The recovery part of ``python3 -m benchmarks.run``: real torchrun jobs, faulted.

Each measurement is a fresh run id: torchrun agents (:mod:`benchmarks._torchrun`, one
gloo worker each, :mod:`benchmarks._train_job`) start and train; once every worker of
the starting world completed a step, one fault is applied, and the harness waits for
the workers of the new world to train. The in-process handler (``inprocess/v3``,
``inprocess/v2``) has no agents: each host is one process running
:func:`etcd_rdzv.inprocess.run` (:mod:`benchmarks._inprocess_job`), and "agent" below
means that process; its survivors are to train again without a new process. The NVRx
handlers (``nvrx-tcpstore``, ``nvrx-etcd/v3``) are alike, with NVIDIA's in-process
``Wrapper`` instead (:mod:`benchmarks._nvrx_job`: a fixed world of 3, each host told
its rank; ``killed`` and ``rank0`` only, :data:`NVRX_FAULTS`); NVRx's monitor daemons,
outside their process's tree, are killed when the measurement ends.

==========  ======  =========  ===========================================================
fault       agents  --nnodes   the fault (victim: a host holding neither worker rank 0
                               nor, for c10d, the TCPStore, unless said otherwise)
==========  ======  =========  ===========================================================
frozen      3       2:3        SIGSTOP the victim's agent and every process under it; 3 -> 2
killed      3       2:3        SIGKILL the same; 3 -> 2
rank0       3       2:3        SIGKILL the host of worker rank 0 (it may host c10d's store)
sigterm     3       2:3        SIGTERM to the victim's agent alone (scale down); 3 -> 2
scaleup     2 + 1   2:3        a third agent starts (the moment of its start); 2 -> 3
spare       3       2:2        two train, one is a spare; SIGKILL a member; 2 -> 2
leader      3       2:3        SIGKILL the leader of a 3-member etcd cluster; 3 -> 3
==========  ======  =========  ===========================================================

Recovery time: from the fault (``time.monotonic()`` just before the signal) to the
first moment every rank of the worker group that trains at the end (at the new world
size) completed a step after the fault; one clock for every process. After the new
world first trains, the job is watched ``settle`` seconds more (``leader``: 20 s) so
later restarts count too. Restarts: workers started after the fault, less the first
worker of a host that had none before (the joining host, the spare). A limit bounds
every wait: "not within N s". In-process rows also count the function's calls again
(``recalls``: calls after the first of a process, first stepping after the fault).

Idle cost: etcd requests per node per second (counted by etcd, :mod:`benchmarks._etcd`)
over ``idle`` seconds (from 2 s after every worker trained) while the first job of
each handler trains undisturbed, before its fault.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from etcd_rdzv.testing import EtcdCluster
from etcd_rdzv.testing._member import consecutive_free_ports

from ._etcd import Member, counts, scrape
from ._nvrx_job import daemon_pids, is_worker
from ._torchrun import (
    BACKENDS,
    Host,
    Step,
    Steps,
    calls_after,
    final_group,
    host_argv,
    nvrx_argv,
    ranks_of,
    starts_after,
    trained,
)

FAULTS = ("frozen", "killed", "rank0", "sigterm", "scaleup", "spare", "leader")
HANDLERS = tuple(BACKENDS)
START_TIMEOUT = 150.0  # seconds for the job to train at its starting world size
LEADER_WATCH = 20.0  # seconds a leader kill is watched: etcd's request timeout is ~7 s
#: The faults an NVRx job can take: it has a fixed world (no scale up, no spares) and
#: no rendezvous on etcd (its store aside). Others give no row (an empty cell).
NVRX_FAULTS = ("killed", "rank0")
#: Restart iterations an NVRx job has process-group ports for (MASTER_PORT + 2 + i).
NVRX_ITERATIONS = 4


@dataclass(frozen=True)
class Layout:
    agents: int  # started before the fault
    nnodes: str
    before: int  # world size before the fault
    after: int  # world size after it


LAYOUTS = {
    "frozen": Layout(3, "2:3", 3, 2),
    "killed": Layout(3, "2:3", 3, 2),
    "rank0": Layout(3, "2:3", 3, 2),
    "sigterm": Layout(3, "2:3", 3, 2),
    "scaleup": Layout(2, "2:3", 2, 3),
    "spare": Layout(3, "2:2", 2, 2),
    "leader": Layout(3, "2:3", 3, 3),
}


class NotWithin(Exception):
    """A wait ran out of time (the message says which)."""


class Job:
    """One job of a measurement (torchrun agents, or in-process workers): its hosts,
    its steps, its clean-up."""

    def __init__(self, workdir: Path, handler: str, endpoint: str, nnodes: str, timeout: float):
        self.dir = workdir
        self.out = workdir / "steps"
        self.out.mkdir(parents=True)
        run_id = f"recovery-{uuid.uuid4().hex[:8]}"
        self.endpoint = endpoint
        self.nvrx = BACKENDS[handler][0] == "nvrx"
        if self.nvrx:  # a fixed world: each host is told its rank, as NVRx's example
            world = int(nnodes.rpartition(":")[2])
            port = consecutive_free_ports(3 + NVRX_ITERATIONS)  # +1 the Wrapper's, +2.. the groups'
            self.argvs = [
                nvrx_argv(handler, endpoint, run_id, self.out, timeout, rank, world, port)
                for rank in range(world)
            ]
        else:
            self.argv = host_argv(handler, endpoint, run_id, nnodes, self.out, timeout)
        self.hosts: list[Host] = []
        self.steps = Steps(self.out)

    def start(self) -> Host:
        i = len(self.hosts)
        argv = self.argvs[i] if self.nvrx else self.argv
        host = Host(f"host{i}", argv, self.dir / f"host{i}.log")
        self.hosts.append(host)
        return host

    def wait(self, what: str, check: Callable[[list[Step]], Any], limit: float) -> Any:
        deadline = time.monotonic() + limit
        while True:
            found = check(self.steps.read())
            if found is not None:
                return found
            if time.monotonic() > deadline:
                raise NotWithin(f"{what}: not within {limit:g} s")
            time.sleep(0.05)

    def close(self) -> None:
        for host in self.hosts:
            host.close()
        if self.nvrx:
            kill_nvrx_daemons(self.out)

    def describe(self) -> str:
        return "\n".join(f"--- {h.name} (pid {h.pid}):\n{h.tail()}" for h in self.hosts)


def _victim(job: Job, group: int, fault: str, c10d: bool) -> tuple[Host, bool]:
    """The host the fault hits, and whether it hosts c10d's TCPStore (the first agent)."""
    ranks = ranks_of(job.steps.steps, group)
    training = [h for h in job.hosts if h.pid in ranks]
    if fault == "rank0":
        host = next(h for h in training if ranks[h.pid] == 0)
        return host, c10d and host is job.hosts[0]
    fits = [h for h in training if ranks[h.pid] != 0 and not (c10d and h is job.hosts[0])]
    host = fits[0] if fits else next(h for h in training if ranks[h.pid] != 0)
    return host, c10d and host is job.hosts[0]


class Recovery:
    """The recovery part: one row per (handler, fault, repetition)."""

    def __init__(
        self,
        args: argparse.Namespace,
        member: Callable[[str], Member],
        log: Callable[[str], None],
    ) -> None:
        self.limit: float = args.recovery_limit
        self.settle: float = args.recovery_settle
        self.idle: float = args.recovery_idle
        self.worker_timeout: float = args.recovery_worker_timeout
        self.member = member
        self.log = log
        self.rows: list[dict[str, Any]] = []
        self.idle_rows: list[dict[str, Any]] = []

    def results(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "idle": self.idle_rows,
            "limit": self.limit,
            "settle": self.settle,
            "idle_window": self.idle,
            "worker_timeout": self.worker_timeout,
            "layouts": {k: vars(v) for k, v in LAYOUTS.items()},
        }

    def run(self, handler: str, fault: str, rep: int, measure_idle: bool) -> None:
        row: dict[str, Any] = {"series": handler, "fault": fault, "rep": rep}
        api = BACKENDS[handler][1]
        if BACKENDS[handler][0] == "nvrx" and fault not in NVRX_FAULTS:
            self.log(f"  recovery {handler:<16} {fault:<8} rep {rep}: n/a (NVRx: no row)")
            return
        if api is None and fault == "leader":
            row["error"] = "n/a: c10d does not use etcd"
            self.rows.append(row)
            return
        workdir = Path(tempfile.mkdtemp(prefix=f"recovery-{fault}-"))
        cluster: EtcdCluster | None = None
        job: Job | None = None
        try:
            if fault == "leader":
                cluster = EtcdCluster(3, enable_v2=api == "v2").start()
                endpoint = cluster.endpoint
            elif api is None:
                endpoint = f"127.0.0.1:{_free_port()}"
            else:
                endpoint = self.member(api).endpoint
            job = Job(workdir, handler, endpoint, LAYOUTS[fault].nnodes, self.worker_timeout)
            idle = measure_idle and self.idle > 0 and api is not None and cluster is None
            self._measure(job, row, handler, fault, cluster, idle)
        except NotWithin as exc:
            row["error"] = str(exc)
        except Exception as exc:  # a failed measurement is a row, the part goes on
            row["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            if job is not None:
                if row.get("error"):
                    row["logs"] = job.describe()[-4000:]
                    if "fault_at" in row:  # how many restarts it took, up to the limit
                        row["restarts"] = restarts(job.steps.read(), row["fault_at"])
                job.close()
            if cluster is not None:
                cluster.close()
            shutil.rmtree(workdir, ignore_errors=True)
        self.rows.append(row)
        self.log(f"  recovery {handler:<16} {fault:<8} rep {rep}: {_shown(row)}")

    def _measure(
        self,
        job: Job,
        row: dict[str, Any],
        handler: str,
        fault: str,
        cluster: EtcdCluster | None,
        idle: bool,
    ) -> None:
        layout = LAYOUTS[fault]
        c10d = BACKENDS[handler][0] == "c10d"
        for _ in range(layout.agents):
            job.start()
            if c10d and len(job.hosts) == 1:
                _wait_listening(job.endpoint, 60.0)  # the first agent hosts the TCPStore
        job.wait(
            f"{layout.before} workers training",
            lambda s: trained(s, layout.before, 0.0),
            START_TIMEOUT,
        )
        if fault == "spare":  # the spare has had time to join, or to fail
            time.sleep(3.0)
        row["started"] = time.monotonic() - job.hosts[0].started
        api = BACKENDS[handler][1]
        if idle and api is not None:
            self.idle_rows.append({"series": handler, **self._idle(api, layout.agents)})
        # The group that trains now picks the victim: the one that trained first may
        # have been replaced meanwhile (a spare's arrival can restart the members).
        now = time.monotonic()
        group, _ = job.wait(
            f"{layout.before} workers training before the fault",
            lambda s: trained(s, layout.before, now),
            START_TIMEOUT,
        )
        row["load"] = os.getloadavg()[0]  # the machine is shared: say how busy it was
        fault_t = self._fault(job, row, group, fault, c10d, cluster)
        row["fault_at"] = fault_t
        watch = LEADER_WATCH if fault == "leader" else self.settle
        # Only the leader kill leaves the group as it was; after any other fault a step
        # of the old group (one in flight when the signal went out) is no recovery.
        old = -1 if fault == "leader" else group

        def new_world(steps: list[Step]) -> tuple[int, float] | None:
            return trained([s for s in steps if s.group != old], layout.after, fault_t)

        first = job.wait(f"{layout.after} workers training after the fault", new_world, self.limit)
        time.sleep(watch)
        steps = job.steps.read()
        last = final_group(steps)
        if last is None or last.world != layout.after or last.group == old:
            raise NotWithin(f"the new world did not last {watch:g} s")
        done = trained([s for s in steps if s.group == last.group], layout.after, fault_t)
        assert done is not None
        row["seconds"] = done[1] - fault_t
        row["first_seconds"] = first[1] - fault_t
        row["restarts"] = restarts(steps, fault_t)
        if BACKENDS[handler][0] in ("inprocess", "nvrx"):
            row["recalls"] = calls_after(steps, fault_t)

    def _fault(
        self,
        job: Job,
        row: dict[str, Any],
        group: int,
        fault: str,
        c10d: bool,
        cluster: EtcdCluster | None,
    ) -> float:
        if fault == "scaleup":
            now = time.monotonic()
            job.start()
            row["victim"] = "a new host"
            return now
        if fault == "leader":
            assert cluster is not None
            leader = cluster.leader(timeout=10.0)
            now = time.monotonic()
            leader.kill()
            row["victim"] = f"etcd {leader.name}"
            return now
        host, store = _victim(job, group, fault, c10d)
        row["victim"] = host.name + (" (hosts the TCPStore)" if store else "")
        act: Callable[[], float] = {"frozen": host.freeze, "sigterm": host.terminate}.get(
            fault, host.kill
        )
        return act()

    def _idle(self, api: str, nodes: int) -> dict[str, Any]:
        """Requests per node per second while the job trains undisturbed."""
        member = self.member(api)
        time.sleep(2.0)  # past the round's own requests
        before = scrape(member.url)
        t0 = time.monotonic()
        time.sleep(self.idle)
        after = scrape(member.url)
        window = time.monotonic() - t0
        c = counts(before, after, api)
        return {
            "nodes": nodes,
            "window": window,
            "rate": c.requests / nodes / window,
            "write_rate": c.writes / nodes / window,
        }


def restarts(steps: list[Step], since: float) -> int:
    """Workers started after ``since``, less the first worker of a host that had none
    before (the joining host, the spare taking over)."""
    started = starts_after(steps, since)
    had = {s.agent for s in steps if s.world == 0 and s.t <= since}
    return len(started) - len({s.agent for s in started} - had)


def _wait_listening(endpoint: str, limit: float) -> None:
    host, port = endpoint.rsplit(":", 1)
    deadline = time.monotonic() + limit
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise NotWithin(f"c10d's store listening: not within {limit:g} s") from None
            time.sleep(0.1)


def kill_nvrx_daemons(out_dir: Path) -> list[int]:
    """SIGCONT and SIGKILL NVRx's monitor daemons of a job's workers (they leave their
    worker's session, so killing a host's tree misses them); the pids signalled."""
    pids = [pid for pid in daemon_pids(out_dir) if is_worker(pid)]
    for sig in (signal.SIGCONT, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
    return pids


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _shown(row: dict[str, Any]) -> str:
    if row.get("error"):
        return str(row["error"]).splitlines()[0]
    recalls = ""
    if "recalls" in row:
        recalls = f", {row['recalls']} call{'' if row['recalls'] == 1 else 's'} again"
    return (
        f"{row['seconds']:.2f} s (first {row['first_seconds']:.2f} s), "
        f"{row['restarts']} restarts{recalls}, victim {row.get('victim')}"
    )
