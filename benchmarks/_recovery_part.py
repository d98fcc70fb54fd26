"""The recovery part of ``python3 -m benchmarks.run``: which series it runs, running
them (:mod:`benchmarks._recovery`), and writing its report when it ran alone."""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ._measure import Bench
from ._recovery import Recovery
from ._recovery_report import recovery_section, splice, svg
from ._torchrun import BACKENDS


def recovery_series(args: argparse.Namespace) -> list[str]:
    """The recovery part's series keys (``ours/v3``, ``c10d``, ...), in report order."""
    keys = []
    for handler in args.recovery_handlers:
        # nvrx-etcd: only nvrx-etcd/v3 is a series (where our store under NVRx is tested).
        if handler in ("ours", "ours-fast", "ours-dynamic", "inprocess", "nvrx-etcd"):
            keys += [f"{handler}/{api}" for api in sorted(args.api, reverse=True)]
        else:
            keys.append(handler if handler in ("c10d", "nvrx-tcpstore") else f"{handler}/v2")
    return [k for k in keys if k in BACKENDS]


def run_recovery(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """The recovery part: each series under each fault, ``--recovery-reps`` times."""
    started = time.time()
    load = os.getloadavg()[0]
    recovery = Recovery(args, bench.member, bench.log)
    bench.log("recovery")
    for rep in range(1, args.recovery_reps + 1):
        for key in recovery_series(args):
            idle_done = rep > 1
            for fault in args.recovery_faults:
                idle = not idle_done and fault in ("frozen", "killed", "rank0", "sigterm")
                idle_done = idle_done or idle
                recovery.run(key, fault, rep, idle)
    out = recovery.results()
    when = datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds")
    for row in out["rows"] + out["idle"]:
        row["run"] = when
    out["runs"] = [
        {"started": when, "seconds": time.time() - started, "load": [load, os.getloadavg()[0]]}
    ]
    return out


def merge(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """``new`` results with the rows (and idle counts) of ``old`` that ``new`` did not
    measure again (another handler, another fault), when both ran with the same limit
    and worker timeout; ``runs`` lists the runs whose rows are kept."""
    settings = ("limit", "settle", "worker_timeout")
    if not old or any(old.get(k) != new[k] for k in settings) or "runs" not in old:
        return new
    done = {(r["series"], r["fault"]) for r in new["rows"]}
    rows = [r for r in old["rows"] if (r["series"], r["fault"]) not in done] + new["rows"]
    measured = {r["series"] for r in new["idle"]}
    idle = [r for r in old["idle"] if r["series"] not in measured] + new["idle"]
    kept = {r["run"] for r in rows + idle}
    runs = [r for r in old["runs"] if r["started"] in kept] + new["runs"]
    return {**new, "rows": rows, "idle": idle, "runs": runs}


def write_recovery_alone(results: dict[str, Any], args: argparse.Namespace) -> None:
    """Only the recovery part ran: its section replaces its own in the existing report,
    and its results those of the existing JSON (merged: see :func:`merge`); every other
    section and result is kept."""
    old: dict[str, Any] = {}
    if args.json.exists():
        old = json.loads(args.json.read_text())
    results["recovery"] = merge(old.get("recovery"), results["recovery"])
    old["recovery"] = results["recovery"]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(old, indent=1) + "\n")
    plot = recovery_plot(args)
    svg(results, plot)
    section = recovery_section(results, plot, args.out)
    page = args.out.read_text() if args.out.exists() else "# Benchmarks\n"
    args.out.write_text(splice(page, section))


def recovery_plot(args: argparse.Namespace) -> Path:
    out: Path = args.out
    return out.with_name(f"{out.stem}-recovery.svg")
