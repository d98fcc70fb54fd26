"""The etcd members a benchmark runs against, and request counts read from etcd itself.

Requests are counted at the server, from its Prometheus ``/metrics``, so the numbers
do not depend on any client's bookkeeping:

* v2 API: ``etcd_http_received_total`` (every non-watch request of the v2 keys API,
  all methods) plus ``etcd_debugging_store_watch_requests_total`` (each v2 watch,
  a long poll, is one request); writes are ``etcd_debugging_store_writes_total``
  (every write the v2 store executed or refused: set, create, update, compareAndSwap,
  delete, ...).
* v3 API: ``grpc_server_started_total`` of the unary calls (Range, Put, Txn,
  DeleteRange, LeaseGrant, ...) plus ``grpc_server_msg_received_total`` of the
  streams (each watch create request and each lease keep-alive is one message; the
  JSON gateway turns every HTTP call into one of these); writes are the started
  Put, Txn, DeleteRange, LeaseGrant and LeaseRevoke calls.

:func:`calibrate` measures what one plain request costs on this machine: a client
process (``python3 -m benchmarks._etcd``, etcd_rdzv's own KV client) does a number of
plain reads, then as many plain writes, and reports its CPU time for each; etcd's CPU
time over each phase comes from its ``process_cpu_seconds_total`` (on a cluster,
every member's added up).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from etcd_rdzv.testing import EtcdCluster, EtcdServer, find_etcd_binary

__all__ = [
    "Cost",
    "Counts",
    "Member",
    "by_method",
    "calibrate",
    "counts",
    "cpu_seconds",
    "etcd_version",
    "machine_cpu_seconds",
    "process_cpu_seconds",
    "scrape",
    "scrape_sites",
]

_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')
_V3_WRITES = {"Put", "Txn", "DeleteRange", "LeaseGrant", "LeaseRevoke"}

Metrics = list[tuple[str, dict[str, str], float]]


@dataclass(frozen=True)
class Counts:
    requests: float
    writes: float


@dataclass
class Member:
    """The etcd to benchmark against: one member we started, one given, or a
    cluster of members we started (``cluster``; ``endpoint`` then lists them all)."""

    endpoint: str  # host:port, or host:port,host:port,... of a cluster
    api: str  # the API the benchmark counts on it: "v2" or "v3"
    server: EtcdServer | None = None
    cluster: EtcdCluster | None = None

    @property
    def url(self) -> str:
        """The URL of the (first) member."""
        return f"http://{self.endpoint.split(',')[0]}"

    @property
    def sites(self) -> dict[str, str]:
        """Each member's name and URL (``etcd`` for a member on its own)."""
        if self.cluster is None:
            return {"etcd": self.url}
        return {m.name: m.client_url for m in self.cluster.members}

    @property
    def size(self) -> int:
        return 1 if self.cluster is None else len(self.cluster.members)

    @classmethod
    def start(cls, api: str, size: int = 1) -> Member:
        """A member (``size`` 1) or a cluster of ``size`` members started for ``api``."""
        if size > 1:
            cluster = EtcdCluster(size, enable_v2=api == "v2").start()
            return cls(cluster.endpoint, api, cluster=cluster)
        server = EtcdServer(f"bench-{api}", enable_v2=api == "v2").start()
        return cls(server.endpoint, api, server)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.cluster is not None:
            self.cluster.close()


def scrape(url: str) -> Metrics:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: Metrics = []
    for line in text.splitlines():
        match = _LINE.match(line)
        if match is None or line.startswith("#"):
            continue
        labels = dict(_LABEL.findall(match.group("labels") or ""))
        out.append((match.group("name"), labels, float(match.group("value"))))
    return out


def by_method(before: Metrics, after: Metrics, api: str) -> dict[str, float]:
    """Requests between two scrapes of one member by kind: v3 the gRPC method (a
    stream's by its messages: ``Watch``, ``LeaseKeepAlive``), v2 the HTTP method
    (``GET``, ``PUT``, ...) and ``watch``."""

    def tally(metrics: Metrics) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, labels, value in metrics:
            kind = None
            if api == "v2":
                if name == "etcd_http_received_total":
                    kind = labels.get("method", "?")
                elif name == "etcd_debugging_store_watch_requests_total":
                    kind = "watch"
            elif labels.get("grpc_service", "").startswith("etcdserverpb."):
                unary = labels.get("grpc_type") == "unary"
                if (name == "grpc_server_started_total" and unary) or (
                    name == "grpc_server_msg_received_total" and not unary
                ):
                    kind = labels.get("grpc_method", "?")
            if kind is not None:
                out[kind] = out.get(kind, 0.0) + value
        return out

    a, b = tally(before), tally(after)
    return {k: b[k] - a.get(k, 0.0) for k in sorted(b) if b[k] - a.get(k, 0.0)}


def _sum(metrics: Metrics, api: str) -> Counts:
    requests = writes = 0.0
    for name, labels, value in metrics:
        if api == "v2":
            if name in ("etcd_http_received_total", "etcd_debugging_store_watch_requests_total"):
                requests += value
            elif name == "etcd_debugging_store_writes_total":
                writes += value
        elif labels.get("grpc_service", "").startswith("etcdserverpb."):
            if name == "grpc_server_started_total" and labels.get("grpc_type") == "unary":
                requests += value
                if labels.get("grpc_method") in _V3_WRITES:
                    writes += value
            elif name == "grpc_server_msg_received_total" and labels.get("grpc_type") != "unary":
                requests += value
    return Counts(requests, writes)


def counts(before: Metrics, after: Metrics, api: str) -> Counts:
    """Requests and writes between two scrapes of one member."""
    a, b = _sum(before, api), _sum(after, api)
    return Counts(b.requests - a.requests, b.writes - a.writes)


def scrape_sites(member: Member) -> Metrics:
    """Every member's metrics in one list (a cluster's counts and CPU add up)."""
    return [entry for url in member.sites.values() for entry in scrape(url)]


def cpu_seconds(metrics: Metrics) -> float | None:
    """etcd's own CPU time (user + system) at a scrape, if it reports it; of every
    member in the list (:func:`scrape_sites`), added up."""
    found = [value for name, _, value in metrics if name == "process_cpu_seconds_total"]
    return sum(found) if found else None


def machine_cpu_seconds() -> float | None:
    """CPU time every process on this machine has used (all cores), from /proc/stat."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    ticks = sum(int(x) for x in fields[1:9]) - int(fields[4]) - int(fields[5])  # not idle
    return ticks / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` used so far; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def etcd_version() -> str:
    try:
        out = subprocess.run(
            [find_etcd_binary(), "--version"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    match = re.search(r"etcd Version: (\S+)", out)
    return match.group(1) if match else "unknown"


# -- the cost of one plain request ------------------------------------------------------

CALIBRATION_WARMUP = 20  # requests of each kind before counting: connections, code paths


@dataclass(frozen=True)
class Cost:
    """What one plain request of a kind cost, in CPU seconds (see :func:`calibrate`).

    ``requests`` is what etcd counted over the phase (the client sent ``sent``);
    ``client`` and ``etcd`` are CPU seconds per counted request; ``wall`` the phase's
    seconds per request (one request at a time).
    """

    sent: int
    requests: float
    client: float
    etcd: float
    wall: float

    @property
    def total(self) -> float:
        return self.client + self.etcd


def calibrate(
    member: Member, count: int, env: dict[str, str], cwd: Path, timeout: float = 120.0
) -> dict[str, Cost]:
    """The cost of a plain read and of a plain write on ``member``: ``{"read", "write"}``.

    One client process (etcd_rdzv's KV client for ``member.api``, as the handler uses
    it) connects and warms up, then does ``count`` reads of one key, then ``count``
    writes of new keys (no TTL, no lease), one at a time; its CPU time
    (``time.process_time()``) over each phase is the client's cost. etcd is scraped
    before and after each phase: its CPU seconds and the requests it counted. The
    keys are deleted afterwards (not counted).

    Args:
        env, cwd: the client process's environment and directory (``benchmarks`` and
            ``etcd_rdzv`` importable).
        timeout: seconds the whole calibration may take.

    Raises:
        RuntimeError: the client process failed or did not answer within ``timeout``,
            or etcd did not report its CPU time (``process_cpu_seconds_total``) or
            counted no requests; the message ends with the client's last output.
    """
    cmd = [sys.executable, "-m", "benchmarks._etcd", member.endpoint, member.api, str(count)]
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            cwd=str(cwd),
        )
        try:
            return _calibrate(member, proc, deadline)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            proc.kill()
            proc.wait(timeout=10)
            stderr.seek(0)
            tail = "\n".join(stderr.read().splitlines()[-20:])
            raise RuntimeError(
                f"calibration on {member.endpoint} ({member.api}): {exc}\n{tail}"
            ) from exc
        finally:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def _calibrate(member: Member, proc: subprocess.Popen[str], deadline: float) -> dict[str, Cost]:
    """:func:`calibrate` with its client process started."""

    def answer(command: str | None) -> dict[str, Any]:
        assert proc.stdin is not None and proc.stdout is not None
        if command is not None:
            proc.stdin.write(command + "\n")
            proc.stdin.flush()
        # One line answers each command, and none comes unasked: nothing waits unread
        # in the pipe's buffer, so select() sees every answer.
        ready, _, _ = select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))
        line = proc.stdout.readline() if ready else ""
        if not line:
            code = proc.poll()
            why = "in time" if code is None else f"(it exited with code {code})"
            raise RuntimeError(f"the client did not answer {command or 'its start'!r} {why}")
        data: dict[str, Any] = json.loads(line)
        return data

    answer(None)  # connected and warmed up
    out: dict[str, Cost] = {}
    for kind in ("read", "write"):
        before = scrape_sites(member)
        done = answer(kind)
        after = scrape_sites(member)
        start, end = cpu_seconds(before), cpu_seconds(after)
        if start is None or end is None:
            raise RuntimeError(f"etcd at {member.url} does not report process_cpu_seconds_total")
        counted = counts(before, after, member.api).requests
        if counted <= 0:
            raise RuntimeError(f"etcd at {member.url} counted no {kind} requests")
        out[kind] = Cost(
            sent=int(done["sent"]),
            requests=counted,
            client=float(done["cpu"]) / counted,
            etcd=(end - start) / counted,
            wall=float(done["wall"]) / counted,
        )
    answer("exit")
    return out


def _calibration_client(endpoint: str, api: str, count: int) -> None:
    """The client side of :func:`calibrate`: one JSON line per command on stdin."""
    from etcd_rdzv import RendezvousParameters, create_client

    tag = uuid.uuid4().hex[:8]
    prefix = f"/bench-calibrate/{tag}"
    params = RendezvousParameters(
        "etcd-rdzv", endpoint, f"calibrate-{tag}", 1, 1, api=api, key_prefix=prefix
    )
    kv = create_client(params)
    key = f"{prefix}/read"
    kv.put(key, "x" * 64, None)
    for i in range(CALIBRATION_WARMUP):
        kv.get(key)
        kv.put(f"{prefix}/warm/{i}", "x" * 64, None)

    def say(**fields: Any) -> None:
        print(json.dumps(fields), flush=True)

    say(ready=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "exit":
            break
        cpu, wall = time.process_time(), time.monotonic()
        for i in range(count):
            if command == "read":
                kv.get(key)
            else:
                kv.put(f"{prefix}/write/{i}", "x" * 64, None)
        say(sent=count, cpu=time.process_time() - cpu, wall=time.monotonic() - wall)
    kv.delete_prefix(prefix)
    kv.close()
    say(exit=True)


def cost_dict(cost: Cost) -> dict[str, float]:
    """``cost`` as JSON-able numbers."""
    return {k: float(v) for k, v in asdict(cost).items()}


if __name__ == "__main__":
    _calibration_client(sys.argv[1], sys.argv[2], int(sys.argv[3]))
