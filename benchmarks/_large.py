"""The large part: ``--large-nodes`` nodes of our handler on each API, as processes and
as threads in ``--large-procs`` processes, each row beside its estimated floor on this
machine. Each API's floor is calibrated first (:func:`benchmarks._etcd.calibrate`),
on a machine the large runs have not loaded yet.

The etcd of each API is one member, or (``--large-cluster 3``) a cluster of three,
each node process listing the members in its own order; with ``--large-kill-leader``
each run SIGKILLs the cluster's leader ``--large-kill-after`` seconds after the go
signal, and the next run gets a new cluster (:mod:`benchmarks._cluster`).
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

from ._etcd import calibrate, cost_dict, machine_cpu_seconds
from ._harness import REPO_ROOT, Series, bench_env, spread
from ._large_report import floor, floor_formula
from ._measure import Bench


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def settle(quiet: float = 0.1, longest: float = 90.0) -> float:
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


def calibrate_floor(bench: Bench, api: str) -> None:
    """The client's and etcd's CPU per plain read and write on ``api`` (the floor's
    inputs); on failure the floor is left out, the run goes on."""
    count = bench.args.floor_requests
    entry: dict[str, Any] = {"count": count, "cores": usable_cores()}
    try:
        costs = calibrate(bench.member(api), count, bench_env(), REPO_ROOT)
    except RuntimeError as exc:
        entry["error"] = str(exc).splitlines()[0][:300]
        bench.log(f"  calibration {api}: ERROR {entry['error']}")
    else:
        entry.update({kind: cost_dict(cost) for kind, cost in costs.items()})
        bench.log(
            f"  calibration {api}, {count} plain requests of each kind, CPU per request: "
            + ", ".join(
                f"{kind} {c.client * 1000:.3f} ms client + {c.etcd * 1000:.3f} ms etcd"
                for kind, c in costs.items()
            )
        )
    bench.results["calibration"][api] = entry


def large_config(items: list[str]) -> dict[str, Any]:
    """``--large-config``'s ``key=value`` items as handler options."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--large-config: {item!r} is not key=value")
        out[key.strip()] = int(value) if value.strip().isdigit() else value.strip()
    return out


def large(
    bench: Bench, series: Series, procs: int, rep: int, clock: str = "built"
) -> dict[str, Any]:
    """One rendezvous of ``--large-nodes`` nodes of our handler: as processes
    (``procs`` 0) or as threads in ``procs`` processes; ``clock`` ``built``: each
    handler built before the go signal, ``cold``: after it (inside the clock)."""
    assert series.api is not None
    n = bench.args.large_nodes
    layout = spread(n, procs)
    row: dict[str, Any] = {
        "series": series.key,
        "api": series.api,
        "n": n,
        "rep": rep,
        "layout": "threads" if procs else "processes",
        "procs": len(layout),
        "clock": clock,
        "cluster": bench.args.large_cluster,
    }
    row["settled"] = round(settle(longest=bench.args.large_settle), 1)
    kill_after = bench.args.large_kill_after if bench.args.large_kill_leader else None
    bench.member(series.api)  # started (a new cluster after a kill) before the clock
    extra = large_config(bench.args.large_config)
    if extra:
        row["config"] = extra
    row.update(
        bench.measure(series, n, layout, cold=clock == "cold", kill_after=kill_after, extra=extra)
    )
    if kill_after is not None:
        bench.replace_member(series.api)  # the next run starts on three healthy members
    bench.results["large"].append(row)
    where = f"threads in {len(layout)} processes" if procs else "processes"
    bench.log(
        f"  large {series.key:<8} N={n} as {where}, clock {clock}, rep {rep}, "
        f"{row.get('etcd_members', '?')} etcd member(s) "
        f"(after {row['settled']:.0f}s of settling): {bench.shown(row)}"
    )
    return row


def run_large(bench: Bench, ours: list[Series]) -> None:
    """The large part: calibrate each API first (on a machine the large runs have not
    loaded yet), then each API and layout; print each row's estimated floor."""
    args = bench.args
    bench.log(
        f"large N={args.large_nodes}, our handler, {args.large_cluster} etcd member(s) per "
        "API; calibration of the floor first"
    )
    bench.fresh_members(args.large_cluster)
    for s in ours:
        assert s.api is not None
        calibrate_floor(bench, s.api)
    layouts = [args.large_procs] if args.large_procs and "threads" in args.large_layouts else []
    layouts += [0] if "processes" in args.large_layouts else []
    for s in ours:
        for procs in layouts:
            for clock, rep in itertools.product(args.large_clocks, range(1, args.large_reps + 1)):
                row = large(bench, s, procs, rep, clock)
                est = floor(row, bench.results["calibration"].get(s.api))
                if est is not None:
                    bench.log(f"    estimated floor: {floor_formula(row, est)}")
