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
"""

from __future__ import annotations

import os
import re
import subprocess
import urllib.request
from dataclasses import dataclass

from etcd_rdzv.testing import EtcdServer, find_etcd_binary

__all__ = ["Counts", "Member", "counts", "etcd_version", "scrape"]

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
    """An etcd member to benchmark against: one we started, or one given."""

    endpoint: str  # host:port
    api: str  # the API the benchmark counts on it: "v2" or "v3"
    server: EtcdServer | None = None

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    @classmethod
    def start(cls, api: str) -> Member:
        server = EtcdServer(f"bench-{api}", enable_v2=api == "v2").start()
        return cls(server.endpoint, api, server)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


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


def cpu_seconds(metrics: Metrics) -> float | None:
    """etcd's own CPU time (user + system) at a scrape, if it reports it."""
    for name, _, value in metrics:
        if name == "process_cpu_seconds_total":
            return value
    return None


def machine_cpu_seconds() -> float | None:
    """CPU time every process on this machine has used (all cores), from /proc/stat."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    ticks = sum(int(x) for x in fields[1:9]) - int(fields[4]) - int(fields[5])  # not idle
    return ticks / os.sysconf("SC_CLK_TCK")


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
