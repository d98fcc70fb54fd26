"""The benchmark's measurements: time to rendezvous, the steady state, member death,
store latency and import time. Each appends its rows to the run's results; the large
part is :mod:`benchmarks._large`.
"""

from __future__ import annotations

import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import etcd_rdzv
from etcd_rdzv import RendezvousParameters
from etcd_rdzv.runs.status import read_run
from etcd_rdzv.testing.history import Joined, violations
from fleet import Event, Fleet, FleetError

from ._cluster import LeaderKill, cost, leader_name, snapshot
from ._etcd import counts, machine_cpu_seconds, process_cpu_seconds, scrape
from ._harness import REPO_ROOT, TORCH_KINDS, Harness, Series, bench_env, torch_available

MONITOR_INTERVAL = 0.1  # torch's elastic agent's default monitor_interval


def agreed_members(params: RendezvousParameters, done: list[Event]) -> str | None:
    """``None`` if the run's completed round (as ``etcd-rdzv status`` reads it) is the
    round every node in ``done`` reported, and lists each at the rank it reported;
    else what differs."""
    kv = etcd_rdzv.create_client(params)
    try:
        status = read_run(kv, str(params.config["key_prefix"]), params.run_id)
    finally:
        kv.close()
    rounds = {e["round"] for e in done}
    if rounds != {status.completed_round}:
        return f"the nodes reported rounds {sorted(rounds)}, etcd holds {status.completed_round}"
    # One checker over what every node reported and etcd's list: unique ranks
    # 0..N-1, each node at its rank in the one list, every member reported its round.
    entries = [Joined(e["node_id"], e["round"], e["rank"], e["world_size"]) for e in done]
    listed = {status.completed_round: tuple(m.node for m in status.members)}
    found = violations(entries, rounds=listed, complete=True)
    return "; ".join(found[:3]) if found else None


class Bench(Harness):
    """The measurements of one run, on the set-up of :class:`Harness`."""

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

    def measure(
        self,
        series: Series,
        n: int,
        layout: list[int],
        *,
        cold: bool = False,
        kill_after: float | None = None,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One rendezvous of ``n`` nodes, ``layout`` nodes per process: seconds from
        go to the last rank, CPU seconds over that window, etcd's counts per node
        (summed over the members of a cluster: :mod:`benchmarks._cluster`).
        ``cold``: each node builds its handler after the go signal (inside the clock);
        ``kill_after``: on a cluster, its leader is SIGKILLed that many seconds after
        the go signal (the row's ``kill``); ``extra``: more options of the handler."""
        row: dict[str, Any] = {}
        member = before = None
        run_id = f"bench-{series.handler}-{n}-{uuid.uuid4().hex[:8]}"
        params = self.params(series, n, run_id, **(extra or {}))
        fleet, nodes = self.fleet(series, n, params=params, layout=layout, cold=cold)
        kill: LeaderKill | None = None
        try:
            fleet.ready(timeout=self.ready_timeout(series, len(layout)))
            self.prepare(fleet, nodes)
            member = self.members.get(series.api) if series.api else None
            leader = leader_name(member) if member is not None else None
            if member is not None:
                row["etcd_members"] = member.size
                if leader is not None:
                    row["leader"] = leader
            before = snapshot(member) if member else None
            busy_before = machine_cpu_seconds()
            go = self.go(fleet, nodes)
            if kill_after is not None and member is not None and leader is not None:
                kill = LeaderKill(member, leader, go, kill_after).start()
            kept = kill.kept if kill is not None else None
            done = self.rounds(fleet, n, self.args.timeout)
            busy_after = machine_cpu_seconds()
            at_end = snapshot(member, kept) if member else None
            last = max(e["t"] for e in done)
            # Where the CPU went while the nodes joined (2 cores: the floor is what
            # the work costs, not the round trips): etcd's own and the whole machine's.
            if busy_before is not None and busy_after is not None:
                row["machine_cpu"] = busy_after - busy_before
            row["seconds"] = last - go
            row["node_seconds"] = sorted(round(e["t"] - go, 4) for e in done)
            ranks = sorted(e["rank"] for e in done)
            worlds = {e["world_size"] for e in done}
            if ranks != list(range(n)) or worlds != {n}:
                row["error"] = f"inconsistent ranks {ranks[:10]}... or world sizes {worlds}"
            # Member lists are in the round events only where nodes report detail.
            lists = {tuple(e["members"]) for e in done if e.get("members") is not None}
            if lists:
                row["member_lists"] = len(lists)
                if len(lists) > 1:
                    row.setdefault("error", f"{len(lists)} different member lists")
            ours = [e for e in done if e.get("node_id") is not None]
            if series.handler == "ours" and "error" not in row:
                # Our handler: one member list, as etcd holds it, with each node at
                # the rank it reported (read once here: it costs the nodes nothing).
                agreed = agreed_members(params, ours)
                row["member_list"] = agreed or "agreed"
                if agreed is not None:
                    row["error"] = agreed
            if member is not None and before is not None and at_end is not None:
                # Up to the last rank only (the scrape just after it): what the
                # estimated floor of the large part is made of.
                c = cost(before, at_end, member.api)
                row["requests_to_rank"] = c["requests"] / n
                row["writes_to_rank"] = c["writes"] / n
                if c["cpu"]:
                    row["etcd_cpu"] = sum(c["cpu"].values())
                if member.cluster is not None:
                    row["etcd_cpu_members"] = c["cpu"]
                    if leader is not None and leader in c["cpu"]:
                        row["etcd_cpu_leader"] = c["cpu"][leader]
                    if len(c["members"]) < member.size:
                        row["unscraped"] = sorted(set(member.sites) - set(c["members"]))
                time.sleep(max(last + self.args.count_tail - time.monotonic(), 0.0))
                c = cost(before, snapshot(member, kept), member.api)
                row["requests"] = c["requests"] / n
                row["writes"] = c["writes"] / n
                if c["bytes_sent"] is not None:
                    row["bytes_sent"] = c["bytes_sent"] / n
                if member.cluster is not None:
                    row["requests_members"] = {k: v / n for k, v in c["by_member"].items()}
                _kinds(row, c, n)
        except FleetError as exc:
            row["error"] = str(exc).splitlines()[0][:1200]
            row["seconds"] = None
            # What a run that failed cost etcd (a collapse is what is measured then).
            if member is not None and before is not None:
                c = cost(before, snapshot(member, kill.kept if kill else None), member.api)
                row["requests"] = c["requests"] / n
                row["writes"] = c["writes"] / n
                if c["cpu"]:
                    row["etcd_cpu"] = sum(c["cpu"].values())
                _kinds(row, c, n)
            errors = [e for node in nodes for e in node.events("error")]
            row["failed_nodes"] = len(errors)
            why: dict[str, int] = {}
            for e in errors:
                text = str(e.get("error") or e.get("message") or e)[:90]
                why[text] = why.get(text, 0) + 1
            row["errors"] = dict(sorted(why.items(), key=lambda kv: -kv[1])[:5])
        finally:
            row["node_cpu"] = round(sum(process_cpu_seconds(node.pid) for node in nodes), 2)
            if kill is not None:
                row["kill"] = kill.finish()
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
            if "etcd_cpu_leader" in row:
                text += f" (leader {row['leader']} {row['etcd_cpu_leader']:.2f}s)"
        if "bytes_sent" in row:
            text += f" {row['bytes_sent'] / 1024:.1f} KiB sent/node"
        kill = row.get("kill")
        if kill:
            text += f" kill {kill.get('member')} at {kill.get('at', float('nan')):.2f}s"
            if "new_leader" in kill:
                text += f", {kill['new_leader']} elected in {kill['election']:.2f}s"
            if "error" in kill:
                text += f" ({kill['error']})"
        if "error" in row:
            text += f"  ERROR {row['error']}"
        return text

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


def _kinds(row: dict[str, Any], c: dict[str, Any], n: int) -> None:
    """Requests per node by kind, raft proposals per node and leader changes."""
    row["by_method"] = {k: round(v / n, 3) for k, v in c["by_method"].items()}
    if c["proposals"] is not None:
        row["proposals"] = c["proposals"] / n
    if c["leader_changes"] is not None:
        row["leader_changes"] = c["leader_changes"]
