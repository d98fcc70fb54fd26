"""Scale: one cold round of N nodes on a 3-member etcd cluster, and what it costs etcd.

``python3 -m benchmarks.scale --nodes 4096 --api v3``

The harness of the scale measurements (docs/benchmarks.md, "Scale"):

* a 3-member etcd cluster of local processes (a new one per run, per API);
* N nodes of our handler as threads in ``--procs`` processes (default 128), the GIL
  switch interval at ``--switch-interval`` (default 0.1 s), node ``i`` listing the
  members from member ``i % 3`` on;
* every node builds its handler *inside* the clock (after the go signal), as an agent
  that starts and joins at once; ``min_nodes = max_nodes = N``; ``join_timeout`` 60 s;
  each node process imports every module of the package under test *before* the go
  signal (an agent has its rendezvous package loaded before it joins; since
  2026-11-28: before, the modules a build imports lazily were compiled inside the
  clock by all node processes at once, where no bytecode is cached);
* the round must be exact: ranks ``0..N-1`` once each, one world size, distinct node
  ids; the recorded-history checker runs over what every node reported and the member
  list etcd holds;
* etcd's counts from its own ``/metrics``, summed over the members, from the go signal
  to the last rank: requests by kind (v3: gRPC method, a stream by its messages; v2:
  HTTP method and watches), writes, raft proposals, leader changes, bytes sent, CPU;
  the node processes' CPU from ``/proc``;
* the same counts again through ``--after`` seconds past the last rank
  (``settled``): what a node does once it has its rank (its member watcher) falls
  after the last rank at small N and before it at large N; counted this way, every N
  pays it. ``alive``: the mean seconds from a node's handler built to the last rank,
  the node-seconds its lease's keep-alives are paid for;
* ``--idle S``: then the N nodes stay members for S seconds (after ``--idle-settle``),
  and etcd's CPU and requests per node per second are counted: what liveness costs;
  with it, the cluster's own CPU is counted for ``--baseline`` seconds before the go
  signal (the node processes started, no handler built), and what the idle nodes add
  to it is given per node per second (``idle_nodes_cpu_ms_per_node_s``); the idle
  requests by member (``idle_by_member``) and the leader at the end (``idle_leader``)
  tell whether the keep-alives went to the leader.

``--package ROOT`` runs the nodes on the package tree at ROOT (a worktree of another
commit: ``git worktree add /tmp/old <commit>``), the rest of the harness unchanged: an
A/B of two commits on one harness. Rows are appended to ``--json`` (one JSON object
per line) and printed.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import etcd_rdzv
from etcd_rdzv.runs.status import read_run
from etcd_rdzv.testing.history import Joined, violations

from ._cluster import cost, leader_name, rotated, snapshot
from ._etcd import Member, process_cpu_seconds

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _config(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--config: {item!r} is not key=value")
        out[key.strip()] = int(value) if value.strip().isdigit() else value.strip()
    return out


def _commit(root: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or "?"


def _per_node(c: dict[str, Any], n: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "requests": round(c["requests"] / n, 3),
        "writes": round(c["writes"] / n, 3),
        "by_kind": {k: round(v / n, 3) for k, v in c["by_method"].items()},
        "etcd_cpu": round(sum(c["cpu"].values()), 2),
        "etcd_cpu_ms_per_node": round(1000 * sum(c["cpu"].values()) / n, 3),
    }
    if c["bytes_sent"] is not None:
        out["bytes_sent"] = round(c["bytes_sent"] / n)
    if c["proposals"] is not None:
        out["proposals"] = round(c["proposals"] / n, 3)
    if c["leader_changes"] is not None:
        out["leader_changes"] = c["leader_changes"]
    return out


def run(args: argparse.Namespace, api: str) -> dict[str, Any]:
    n, procs = args.nodes, min(args.procs, args.nodes)
    package = Path(args.package).resolve()
    row: dict[str, Any] = {
        "n": n,
        "api": api,
        "procs": procs,
        "commit": _commit(package),
        "switch_interval": args.switch_interval,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    member = Member.start(api, 3)
    children: list[subprocess.Popen[str]] = []
    lines: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
    try:
        config = {"key_prefix": "/scale", "api": api, "join_timeout": args.join_timeout}
        config.update(_config(args.config))
        row["config"] = config
        run_id = f"scale-{uuid.uuid4().hex[:8]}"
        env = dict(os.environ, PYTHONPATH=str(package))
        logs = open(args.logs, "a") if args.logs else subprocess.DEVNULL  # noqa: SIM115
        per = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
        first = 0
        for index, size in enumerate(per):
            spec = {
                "run_id": run_id,
                "n": n,
                "config": config,
                "switch_interval": args.switch_interval,
                "log_level": args.log_level,
                "endpoints": [rotated(member.endpoint, first + j) for j in range(size)],
            }
            first += size
            child = subprocess.Popen(
                [sys.executable, str(HERE / "_scale_node.py"), json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=logs,
                text=True,
                env=env,
                cwd="/",
            )
            children.append(child)

            def read(i: int = index, out: Any = child.stdout) -> None:
                for line in out:
                    try:
                        lines.put((i, json.loads(line)))
                    except ValueError:
                        continue

            threading.Thread(target=read, daemon=True).start()
        ready = 0
        deadline = time.monotonic() + 120 + procs
        while ready < procs:
            _, msg = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            ready += "ready" in msg
        time.sleep(args.settle)
        if args.idle:
            # The cluster's own CPU with no node connected (raft heartbeats, its
            # housekeeping): what an idle node costs is what comes on top of it.
            start = snapshot(member)
            time.sleep(args.baseline)
            alone = cost(start, snapshot(member), api)
            row["baseline_cpu_ms_s"] = round(1000 * sum(alone["cpu"].values()) / args.baseline, 2)
        row["leader_before"] = leader_name(member)
        before = snapshot(member)
        cpu_before = sum(process_cpu_seconds(c.pid) for c in children)
        go = time.monotonic()
        row["go_wall"] = round(time.time(), 3)  # the go signal on the logs' clock
        for child in children:
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        done: list[dict[str, Any]] = []
        errors: list[dict[str, Any]] = []
        deadline = go + args.join_timeout + 20
        while len(done) + len(errors) < n and time.monotonic() < deadline:
            try:
                _, msg = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                break
            if "rank" in msg:
                done.append(msg)
            elif "error" in msg:
                errors.append(msg)
        at_end = snapshot(member)
        row["node_cpu"] = round(sum(process_cpu_seconds(c.pid) for c in children) - cpu_before, 1)
        row.update(_per_node(cost(before, at_end, api), n))
        if args.after and not errors:
            # What each node does once it has its rank (its member watcher) lands after
            # the last rank at small N and before it at large N: counted through a
            # window after the last rank, every N pays it.
            time.sleep(args.after)
            row["after_s"] = args.after
            row["settled"] = _per_node(cost(before, snapshot(member), api), n)
        row["answered"] = len(done)
        row["failed"] = len(errors)
        if errors:
            why: dict[str, int] = {}
            for e in errors:
                why[e["error"][:100]] = why.get(e["error"][:100], 0) + 1
            row["errors"] = dict(sorted(why.items(), key=lambda kv: -kv[1])[:5])
            # The whole text of the commonest error, and when the errors came.
            common = max(why, key=lambda k: why[k])
            row["error_text"] = next(e["error"] for e in errors if e["error"][:100] == common)
            row["errors_from"] = round(min(e["t"] for e in errors) - go, 2)
            row["errors_to"] = round(max(e["t"] for e in errors) - go, 2)
        if done:
            row["seconds"] = round(max(e["t"] for e in done) - go, 2) if not errors else None
            row["built_by"] = round(max(e["built"] for e in done) - go, 2)
            row["median"] = round(sorted(e["t"] for e in done)[len(done) // 2] - go, 2)
            # What liveness costs in a round grows with how long the nodes wait in it.
            row["waited"] = round(sum(e["t"] - e["built"] for e in done) / len(done), 2)
            # Seconds each node's lease lived in the counted window (built to the last
            # rank), on average: the node-seconds its keep-alives are paid for.
            last = max(e["t"] for e in done)
            row["alive"] = round(sum(last - e["built"] for e in done) / len(done), 2)
        ranks = sorted(e["rank"] for e in done)
        exact = (
            ranks == list(range(n))
            and {e["world"] for e in done} == {n}
            and len({e["node"] for e in done}) == n
        )
        row["exact"] = exact
        if not exact:
            row["seconds"] = None
        if exact:
            checked_at = time.monotonic()
            row["history"] = _history(member.endpoint, api, run_id, done)
            row["history_s"] = round(time.monotonic() - checked_at, 1)
        if args.idle and exact:
            time.sleep(args.idle_settle)
            start = snapshot(member)
            time.sleep(args.idle)
            idle = cost(start, snapshot(member), api)
            row["idle_seconds"] = args.idle
            row["idle_cpu_ms_per_node_s"] = round(
                1000 * sum(idle["cpu"].values()) / n / args.idle, 4
            )
            if "baseline_cpu_ms_s" in row:
                row["idle_nodes_cpu_ms_per_node_s"] = round(
                    (1000 * sum(idle["cpu"].values()) / args.idle - row["baseline_cpu_ms_s"]) / n,
                    4,
                )
            row["idle_requests_per_node_s"] = round(idle["requests"] / n / args.idle, 4)
            row["idle_by_kind"] = {
                k: round(v / n / args.idle, 4) for k, v in idle["by_method"].items()
            }
            # Where the requests went (a keep-alive a follower gets is forwarded to
            # the leader, at a cost to both): by member, and which one led at the end.
            row["idle_by_member"] = {
                name: round(v / n / args.idle, 4) for name, v in idle["by_member"].items()
            }
            row["idle_leader"] = leader_name(member)
    finally:
        for child in children:
            try:
                assert child.stdin is not None
                child.stdin.write("stop\n")
                child.stdin.close()
            except OSError:
                pass
        for child in children:
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()
        member.stop()
    return row


def _history(endpoint: str, api: str, run_id: str, done: list[dict[str, Any]]) -> str:
    """The recorded-history checker over what every node reported and the member list
    etcd holds (read with this tree's code): ``ok`` or the violations."""
    params = etcd_rdzv.RendezvousParameters(
        "etcd-rdzv", endpoint, run_id, 1, 1, key_prefix="/scale", api=api
    )
    for attempt in range(5):  # the cluster may be electing a leader after the round
        try:
            kv = etcd_rdzv.create_client(params)
            try:
                status = read_run(kv, "/scale", run_id)
            finally:
                kv.close()
            break
        except Exception as exc:
            if attempt == 4:
                return f"etcd's list unreadable: {exc}"[:300]
            time.sleep(2.0)
    entries = [Joined(e["node"], e["round"], e["rank"], e["world"]) for e in done]
    if status.completed_round is None:
        return "etcd holds no completed round"
    listed = {status.completed_round: tuple(m.node for m in status.members)}
    found = violations(entries, rounds=listed, complete=True)
    return "; ".join(found[:3]) if found else "ok"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks.scale", description=__doc__)
    parser.add_argument("--nodes", type=int, default=4096)
    parser.add_argument("--procs", type=int, default=128)
    parser.add_argument("--api", default="v3", help="v3, v2 or v3,v2 (default v3)")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--switch-interval", type=float, default=0.1)
    parser.add_argument("--join-timeout", type=int, default=60)
    parser.add_argument("--settle", type=float, default=5.0, help="seconds before go")
    parser.add_argument("--idle", type=float, default=0.0, help="seconds of idle counting")
    parser.add_argument("--idle-settle", type=float, default=15.0)
    parser.add_argument(
        "--baseline",
        type=float,
        default=30.0,
        help="with --idle: seconds the cluster's own CPU is counted before the go signal",
    )
    parser.add_argument(
        "--after",
        type=float,
        default=3.0,
        help="seconds after the last rank that a second count runs to ('settled'; 0: none)",
    )
    parser.add_argument("--config", type=lambda s: s.split(","), default=[])
    parser.add_argument("--log-level", default="", help="the nodes' log level (INFO...)")
    parser.add_argument("--logs", default="", help="the nodes' logs go to this file")
    parser.add_argument("--package", default=str(ROOT), help="the package tree under test")
    parser.add_argument("--json", default="", help="append each row to this file")
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.procs < 1:
        raise SystemExit("--nodes and --procs must be at least 1")
    for _ in range(args.reps):
        for api in args.api.split(","):
            row = run(args, api)
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "a") as out:
                    out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
