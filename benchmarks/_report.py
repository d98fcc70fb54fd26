"""The benchmark report: a markdown page and a PNG plot from one run's results."""

from __future__ import annotations

import os
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["LABELS", "evaluate", "floor", "floor_formula", "markdown", "plot"]

LABELS = {
    "ours/v2": "etcd_rdzv, v2 API",
    "ours/v3": "etcd_rdzv, v3 API",
    "ours-dynamic/v2": "torch dynamic over etcd_rdzv backend, v2",
    "ours-dynamic/v3": "torch dynamic over etcd_rdzv backend, v3",
    "etcd-v2/v2": "torch etcd-v2",
    "etcd/v2": "torch etcd (legacy)",
    "c10d": "torch c10d",
}

# The reference numbers for torch's handlers (2-core machines, etcd 3.5.1).
REFERENCE = {
    ("etcd-v2/v2", 2): 1.16,
    ("etcd-v2/v2", 8): 1.33,
    ("etcd-v2/v2", 32): 5.16,
    ("etcd/v2", 8): 1.35,
    ("etcd/v2", 32): 2.83,
    ("c10d", 8): 1.28,
    ("c10d", 32): 6.22,
}


def label(key: str) -> str:
    return LABELS.get(key, key)


def _order(key: str) -> int:
    return list(LABELS).index(key) if key in LABELS else len(LABELS)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def rendezvous_table(results: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    """``(series, n)`` -> median, min, max seconds, request and write medians, errors."""
    cells: dict[tuple[str, int], dict[str, Any]] = defaultdict(
        lambda: {"seconds": [], "requests": [], "writes": [], "errors": [], "layout": ""}
    )
    for row in results["rendezvous"]:
        cell = cells[(row["series"], row["n"])]
        cell["layout"] = row.get("layout", "")
        if row.get("error"):
            cell["errors"].append(row["error"])
        if row.get("seconds") is not None and not row.get("error"):
            cell["seconds"].append(row["seconds"])
        for name in ("requests", "writes"):
            if row.get(name) is not None:
                cell[name].append(row[name])
    out = {}
    for key, cell in cells.items():
        secs = cell["seconds"]
        out[key] = {
            "median": _median(secs),
            "min": min(secs) if secs else None,
            "max": max(secs) if secs else None,
            "reps": len(secs),
            "requests": _median(cell["requests"]),
            "writes": _median(cell["writes"]),
            "errors": cell["errors"],
            "layout": cell["layout"],
        }
    return out


def _fmt(value: float | None, digits: int = 2, unit: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


LARGE_TARGET_N = 1024
LARGE_TARGET_SECONDS = 3.0
V3_OVER_V2_AT_32 = 1.25


def floor(row: dict[str, Any], calibration: dict[str, Any] | None) -> dict[str, Any] | None:
    """The estimated floor of a large-N row on this machine, or None without its inputs.

    floor(N) = N x requests per node x CPU per request / cores, where requests per node
    are those etcd counted from the go signal to the last rank (the window of the
    row's seconds), and CPU per request is the client's plus etcd's CPU for one plain
    request (the calibration of the same run), reads and writes mixed as in the row
    (its writes per node are writes, the rest reads). It is what those requests alone
    would cost with every core busy.
    """
    if not calibration or "read" not in calibration or "write" not in calibration:
        return None
    requests, writes = row.get("requests_to_rank"), row.get("writes_to_rank")
    if requests is None or writes is None or requests <= 0:
        return None
    read = calibration["read"]["client"] + calibration["read"]["etcd"]
    write = calibration["write"]["client"] + calibration["write"]["etcd"]
    written = min(writes, requests)
    per_request = ((requests - written) * read + written * write) / requests
    cores = calibration["cores"]
    return {
        "seconds": row["n"] * requests * per_request / cores,
        "requests": requests,
        "writes": writes,
        "per_request": per_request,
        "read": read,
        "write": write,
        "cores": cores,
    }


def floor_formula(row: dict[str, Any], est: dict[str, Any]) -> str:
    """``est`` (from :func:`floor`) as its formula with the numbers put in."""
    text = (
        f"{row['n']} x {est['requests']:.2f} req/node to the last rank x "
        f"{est['per_request'] * 1000:.3f} ms CPU/req (read {est['read'] * 1000:.3f} ms, "
        f"write {est['write'] * 1000:.3f} ms; {est['writes']:.2f} writes/node) / "
        f"{est['cores']} cores = {est['seconds']:.2f} s"
    )
    if row.get("seconds") is not None:
        text += f"; measured {row['seconds']:.2f} s"
    return text


def _layout(row: dict[str, Any]) -> str:
    return "processes" if row["layout"] == "processes" else f"threads ({row['procs']} processes)"


def _large_targets(results: dict[str, Any], ours: list[str]) -> list[dict[str, Any]]:
    """N=1024 within 3 s, per API and layout, from the large part's rows."""
    lines: list[dict[str, Any]] = []
    large = results.get("large", [])
    ran_at = sorted({r["n"] for r in large} - {LARGE_TARGET_N})
    for series in ours:
        for layout in ("processes", "threads"):
            target = (
                f"N={LARGE_TARGET_N}: {label(series)}, nodes as {layout}, "
                f"within {LARGE_TARGET_SECONDS:.0f} s"
            )
            rows = [
                r
                for r in large
                if r["series"] == series and r["layout"] == layout and r["n"] == LARGE_TARGET_N
            ]
            if not rows:
                elsewhere = f" (large part ran at N={ran_at[0]})" if ran_at else ""
                lines.append(
                    {"target": target, "measured": "not measured" + elsewhere, "met": None}
                )
                continue
            done = [
                r["seconds"] for r in rows if r.get("seconds") is not None and not r.get("error")
            ]
            failed = len(rows) - len(done)
            if not done:
                error = rows[0].get("error", "no time")
                lines.append({"target": target, "measured": f"failed: {error}", "met": False})
                continue
            mid = statistics.median(done)
            measured = f"{mid:.2f} s" + (f" (median of {len(done)})" if len(done) > 1 else "")
            if failed:
                measured += f", {failed} of {len(rows)} failed"
            if rows[0].get("procs") and layout == "threads":
                measured += f", {rows[0]['procs']} processes"
            met = mid <= LARGE_TARGET_SECONDS and not failed
            lines.append({"target": target, "measured": measured, "met": met})
    return lines


def evaluate(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets: ``{"target", "measured", "met"}`` per line (met None: not run)."""
    table = rendezvous_table(results)
    args = results.get("args", {})
    ours = sorted({r["series"] for r in results["rendezvous"] if r["series"].startswith("ours/")})
    ours = ours or [f"ours/{api}" for api in args.get("api", ["v2"])]
    lines: list[dict[str, Any]] = []

    def med(series: str, n: int) -> float | None:
        cell = table.get((series, n))
        return None if cell is None else cell["median"]

    for series in ours:
        mine = med(series, 32)
        for other, factor in (("etcd-v2/v2", 10), ("etcd/v2", 5), ("c10d", 5)):
            theirs = med(other, 32)
            target = f"N=32: {label(series)} >= {factor}x faster than {label(other)}"
            if mine is None or theirs is None:
                lines.append({"target": target, "measured": "not measured", "met": None})
                continue
            ratio = theirs / mine
            lines.append(
                {
                    "target": target,
                    "measured": f"{ratio:.1f}x ({theirs:.3f} s vs {mine:.3f} s)",
                    "met": ratio >= factor,
                }
            )
        big = med(series, 256)
        lines.append(
            {
                "target": f"N=256: {label(series)} completes in under 2 s",
                "measured": "not measured" if big is None else f"{big:.3f} s (median)",
                "met": None if big is None else big < 2.0,
            }
        )
        writes = {n: table[(series, n)]["writes"] for n in (8, 32, 256) if (series, n) in table}
        known = {n: w for n, w in writes.items() if w is not None}
        if len(known) >= 2:
            shown = ", ".join(f"N={n}: {w:.2f}" for n, w in sorted(known.items()))
            # Constant: bounded by the smallest N's figure. Each node writes its own
            # keys (a fixed number); the round's few shared writes (coordinator key,
            # result, hint) are spread over N, so the figure falls towards that number.
            ordered = [w for _, w in sorted(known.items())]
            constant = all(w <= ordered[0] * 1.1 + 0.1 for w in ordered[1:])
            lines.append(
                {
                    "target": (
                        f"{label(series)}: etcd writes per node stay constant as N grows "
                        "(do not grow beyond the smallest N's)"
                    ),
                    "measured": shown,
                    "met": constant,
                }
            )
        steady = [r for r in results["steady"] if r["series"] == series and "rate" in r]
        if steady:
            rate = steady[0]["rate"]
            lines.append(
                {
                    "target": f"{label(series)}: steady state <= 0.5 etcd requests/s per node",
                    "measured": f"{rate:.3f} req/s per node (N={steady[0]['n']})",
                    "met": rate <= 0.5,
                }
            )
        deaths = [r for r in results["death"] if r["series"] == series and "seconds" in r]
        if deaths:
            bound = deaths[0]["bound"]
            worst = max(r["seconds"] for r in deaths)
            lines.append(
                {
                    "target": (
                        f"{label(series)}: member death to next completed round <= "
                        f"keep_alive_interval x keep_alive_max_attempt + 1 s = {bound:.0f} s"
                    ),
                    "measured": (
                        f"median {statistics.median(r['seconds'] for r in deaths):.2f} s, "
                        f"worst {worst:.2f} s ({len(deaths)} runs)"
                    ),
                    "met": worst <= bound,
                }
            )
    v2, v3 = med("ours/v2", 32), med("ours/v3", 32)
    if "ours/v2" in ours and "ours/v3" in ours:
        target = f"N=32: {label('ours/v3')} within {V3_OVER_V2_AT_32}x of {label('ours/v2')}"
        if v2 is None or v3 is None:
            lines.append({"target": target, "measured": "not measured", "met": None})
        else:
            lines.append(
                {
                    "target": target,
                    "measured": f"{v3 / v2:.2f}x ({v3:.3f} s vs {v2:.3f} s, medians)",
                    "met": v3 / v2 <= V3_OVER_V2_AT_32,
                }
            )
    lines += _large_targets(results, ours)
    for row in results["store"]:
        if row["kind"] != "ours" or "median" not in row:
            continue
        lines.append(
            {
                "target": f"etcd_rdzv store, {row['api']}: get after a remote set < 10 ms median",
                "measured": f"{row['median'] * 1000:.2f} ms median, p90 {row['p90'] * 1000:.2f} ms",
                "met": row["median"] < 0.010,
            }
        )
    return lines


def plot(results: dict[str, Any], path: Path) -> bool:
    """Time to rendezvous against N, one line per handler. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return False
    table = rendezvous_table(results)
    series = sorted(
        {key for key, _ in table}, key=lambda k: list(LABELS).index(k) if k in LABELS else 99
    )
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for key in series:
        points = sorted(
            (n, c) for (s, n), c in table.items() if s == key and c["median"] is not None
        )
        if not points:
            continue
        xs = [n for n, _ in points]
        ys = [c["median"] for _, c in points]
        low = [c["median"] - c["min"] for _, c in points]
        high = [c["max"] - c["median"] for _, c in points]
        style = "-" if key.startswith("ours/") else "--"
        ax.errorbar(xs, ys, yerr=[low, high], fmt=style + "o", capsize=3, label=label(key))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("nodes N (min_nodes = max_nodes = N)")
    ax.set_ylabel("seconds from go to the last node's rank (median, min-max)")
    ax.set_title("Time to rendezvous")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _large_section(results: dict[str, Any]) -> list[str]:
    """The large-N part: a row per API and layout, and each row's estimated floor."""
    args = results["args"]
    large = results["large"]
    calibration = results.get("calibration", {})
    ns = sorted({r["n"] for r in large})
    lines: list[str] = []
    add = lines.append
    add("")
    add(f"## Large N: our handler at N={', '.join(str(n) for n in ns)}")
    add("")
    # From the rows themselves: a report may merge a later run's large part.
    reps = max((int(r.get("rep", 1)) for r in large), default=args.get("large_reps", 1))
    tail = results.get("count_tail", 3)
    add(
        "Our handler on each API, `min_nodes = max_nodes = N`, nodes as processes and as "
        f"threads in a few processes; {'one run' if reps == 1 else f'{reps} runs'} each. "
        "Seconds from the go signal to the last node's rank; etcd's requests and writes "
        f"per node as above (counted to {tail:g} s after the last rank); CPU seconds the "
        "whole machine and etcd itself spent from the go signal to the last rank. The "
        "floor is explained below the table."
        + (
            " Each run starts once the machine is quiet (under a tenth of its cores busy "
            "over a second; at most 90 s of waiting): the one before leaves it busy for a "
            "while after its last rank."
            if any("settled" in row for row in results.get("large", []))
            else ""
        )
    )
    add("")
    add(
        _row(
            [
                "API",
                "layout",
                "seconds",
                "requests per node",
                "writes per node",
                "machine CPU",
                "etcd CPU",
                "estimated floor",
            ]
        )
    )
    add(_row(["---", "---", "---:", "---:", "---:", "---:", "---:", "---:"]))
    for row in large:
        est = floor(row, calibration.get(row["api"]))
        seconds = _fmt(row.get("seconds"), 2, " s")
        if row.get("error"):
            seconds += f" (failed: {row['error']})"
        add(
            _row(
                [
                    row["api"],
                    f"N={row['n']}, {_layout(row)}" + (f", run {row['rep']}" if reps > 1 else ""),
                    seconds,
                    _fmt(row.get("requests"), 2),
                    _fmt(row.get("writes"), 2),
                    _fmt(row.get("machine_cpu"), 2, " s"),
                    _fmt(row.get("etcd_cpu"), 2, " s"),
                    _fmt(None if est is None else est["seconds"], 2, " s"),
                ]
            )
        )
    add("")
    cores = {c.get("cores") for c in calibration.values()} - {None}
    count = {c.get("count") for c in calibration.values()} - {None}
    after = f"; the table's columns count {tail:g} s after it too" if tail else ""
    add(
        "**Estimated floor on this machine**: floor(N) = N x requests per node x CPU per "
        f"request / cores ({', '.join(str(c) for c in sorted(cores)) or '?'} here), what "
        "the rendezvous's requests alone would cost with every core busy. Requests per "
        "node here are those etcd counted from the go signal to the last rank (the "
        f"window of the seconds{after}). CPU per request is the client's plus etcd's CPU "
        "for one plain request, measured in this run: one client process (etcd_rdzv's "
        f"KV client) did {', '.join(str(c) for c in sorted(count)) or '?'} plain reads "
        "of a key, then as many plain writes of new keys, one at a time, against the "
        "benchmark's etcd; its `time.process_time()` and etcd's "
        "`process_cpu_seconds_total` over each phase, divided by the requests etcd "
        "counted (etcd reports its CPU time in steps of 10 ms, so its share is known to "
        "10 ms / requests). Each row mixes the read and write costs as its own writes per "
        "node (to the last rank) say. Left out: anything that is not a request (starting "
        "threads, waking up, the harness); on v3, stream messages (watch creations, lease "
        "keep-alives) are costed as plain requests."
    )
    add("")
    add(_row(["API", "requests", "read: client", "read: etcd", "write: client", "write: etcd"]))
    add(_row(["---", "---:", "---:", "---:", "---:", "---:"]))
    for api, cal in calibration.items():
        if "read" not in cal or "write" not in cal:
            add(_row([api, "", f"failed: {cal.get('error')}", "", "", ""]))
            continue
        add(
            _row(
                [
                    api,
                    f"{cal['read']['requests']:.0f} + {cal['write']['requests']:.0f}",
                    *(
                        f"{cal[kind][side] * 1000:.3f} ms"
                        for kind in ("read", "write")
                        for side in ("client", "etcd")
                    ),
                ]
            )
        )
    add("")
    for row in large:
        est = floor(row, calibration.get(row["api"]))
        where = f"{row['api']}, {_layout(row)}"
        if est is None:
            add(f"- Estimated floor, {where}: not available (no calibration or no counts)")
        else:
            add(f"- Estimated floor, {where}: {floor_formula(row, est)}")
    return lines


def markdown(results: dict[str, Any], png: Path | None, out: Path) -> str:
    table = rendezvous_table(results)
    ns = sorted({n for _, n in table})
    series = sorted(
        {s for s, _ in table}, key=lambda k: list(LABELS).index(k) if k in LABELS else 99
    )
    args = results["args"]
    m, v = results["machine"], results["versions"]
    lines: list[str] = []
    add = lines.append
    add("# Benchmarks")
    add("")
    add(
        "Generated by `python3 -m benchmarks.run` "
        f"({'quick mode, ' if args.get('quick') else ''}{results['started']}, "
        f"{results['seconds']:.0f} s). Numbers from one run on one machine; the "
        "comparisons that matter are the ratios between handlers in the same run."
    )
    add("")
    add("## Machine and versions")
    add("")
    add(
        f"- {m.get('cpu', 'unknown CPU')}, {m.get('cpus')} cores, "
        f"{m.get('memory_gib', '?')} GiB; {m.get('platform')}"
    )
    add(
        f"- Python {m.get('python')}; etcd {v.get('etcd')}; torch {v.get('torch')}; "
        f"python-etcd {v.get('python-etcd')}; urllib3 {v.get('urllib3')}; "
        f"etcd_rdzv {v.get('etcd_rdzv')}"
    )
    before = ", ".join(f"{x:.2f}" for x in results["load_before"])
    after = ", ".join(f"{x:.2f}" for x in results["load_after"])
    add(f"- load average (1, 5, 15 min) before: {before}; after: {after}")
    add(
        "- etcd: one member per API started by the benchmark (v2 runs with "
        "`--enable-v2`, v3 runs on a member without it), on loopback, data in a temp dir"
        if not args.get("endpoint")
        else f"- etcd: the given endpoint {args['endpoint']}"
    )
    add("")
    add("## Targets")
    add("")
    add(_row(["target", "measured", "met"]))
    add(_row(["---", "---", "---"]))
    for line in evaluate(results):
        met = {True: "yes", False: "**no**", None: "not run"}[line["met"]]
        add(_row([line["target"], line["measured"], met]))
    add("")
    add("## Time to rendezvous")
    add("")
    add(
        "Seconds from the go signal (every node started, imported and connected) to the "
        f"moment the last node held its rank; median (min-max) of {args.get('reps')} "
        "repetitions, `min_nodes = max_nodes = N`. Nodes are processes; cells marked "
        "† ran as threads (torch's handlers above "
        f"{args.get('threads_above')} nodes, in {args.get('torch_procs')} processes)."
    )
    add("")
    add(_row(["handler", *[f"N={n}" for n in ns]]))
    add(_row(["---", *["---:" for _ in ns]]))
    for key in series:
        cells = []
        for n in ns:
            cell = table.get((key, n))
            if cell is None:
                cells.append("")
                continue
            mark = " †" if cell["layout"].startswith("threads") else ""
            if cell["median"] is None:
                errors = cell["errors"]
                if errors and all(e.startswith("skipped") for e in errors):
                    cells.append(f"not run{mark}")
                elif any(" within " in e for e in errors):
                    cells.append(f"> {args.get('timeout', 0):.0f} s{mark}")
                else:
                    cells.append(f"failed{mark}")
                continue
            text = f"{cell['median']:.3f} ({cell['min']:.3f}-{cell['max']:.3f}){mark}"
            if cell["errors"]:
                text += f", {len(cell['errors'])} failed"
            cells.append(text)
        add(_row([label(key), *cells]))
    refs = [f"{label(s)} N={n}: {t} s" for (s, n), t in REFERENCE.items()]
    add("")
    add("The issue's reference numbers for torch's handlers: " + "; ".join(refs) + ".")
    errors = [
        (k, c["errors"][0])
        for k, c in sorted(table.items())
        if c["errors"] and not c["errors"][0].startswith("skipped")
    ]
    if errors:
        add("")
        add(
            "Failures (first of each cell; a handler that failed at some N is not run "
            "again at larger N):"
        )
        add("")
        for (key, n), error in errors:
            add(f"- {label(key)}, N={n}: {error}")
    if png is not None:
        add("")
        add(f"![time to rendezvous]({os.path.relpath(png, out.parent)})")
    add("")
    add("## etcd requests and writes per node per rendezvous")
    add("")
    add(
        "Counted by etcd (its `/metrics`, see `benchmarks/_etcd.py`) from the go signal "
        f"to {results.get('count_tail', 3):.0f} s after the last node held its rank, "
        "divided by N; medians. c10d does not use etcd."
    )
    add("")
    add(_row(["handler", *[f"N={n}" for n in ns]]))
    add(_row(["---", *["---:" for _ in ns]]))
    for key in series:
        if key == "c10d":
            continue
        cells = []
        for n in ns:
            cell = table.get((key, n))
            if cell is None or cell["requests"] is None:
                cells.append("-")
            else:
                cells.append(f"{cell['requests']:.1f} req, {cell['writes']:.2f} writes")
        add(_row([label(key), *cells]))
    if results.get("large"):
        lines += _large_section(results)
    add("")
    add("## Steady state")
    add("")
    add(
        f"etcd requests per second per member, counted over {args.get('steady_window')} s "
        f"starting {args.get('steady_settle')} s after completion, while every node calls "
        "`num_nodes_waiting()` every 0.1 s (torch's elastic agent's default "
        "`monitor_interval`) and keeps its heartbeat (default `keep_alive_interval` 5 s)."
    )
    add("")
    add(_row(["handler", "N", "requests/s per node", "writes/s per node"]))
    add(_row(["---", "---:", "---:", "---:"]))
    for row in results["steady"]:
        if "rate" in row:
            add(
                _row(
                    [
                        label(row["series"]),
                        str(row["n"]),
                        f"{row['rate']:.3f}",
                        f"{row['write_rate']:.3f}",
                    ]
                )
            )
        else:
            add(_row([label(row["series"]), str(row["n"]), f"failed: {row['error']}", ""]))
    if results["death"]:
        add("")
        add("## Member death to the next completed round")
        add("")
        d0 = results["death"][0]
        add(
            f"N={d0['n']} nodes of our handler (`keep_alive_interval="
            f"{args.get('keep_alive_interval')}`, `keep_alive_max_attempt="
            f"{args.get('keep_alive_max_attempt')}`) complete a round; one is SIGKILLed "
            "at a random phase of its heartbeat. Survivors poll `num_nodes_waiting()` "
            "every 0.1 s; once it is positive they leave and join the next round with "
            "`min_nodes = N-1` and `last_call_timeout = 0` (a last call would add its "
            "length). Seconds from the kill."
        )
        add("")
        add(_row(["handler", "run", "noticed by all", "next round complete", "bound"]))
        add(_row(["---", "---:", "---:", "---:", "---:"]))
        for row in results["death"]:
            add(
                _row(
                    [
                        label(row["series"]),
                        str(row["rep"]),
                        _fmt(row.get("detected"), 2, " s"),
                        _fmt(row.get("seconds"), 2, " s")
                        + (f" ({row['error']})" if row.get("error") else ""),
                        f"{row['bound']:.0f} s",
                    ]
                )
            )
    if results["store"]:
        add("")
        add("## Store get after a remote set")
        add("")
        add(
            "One process blocks in `store.get(key)`; 50 ms later another process sets the "
            "key. Latency = the moment `get` returned - the moment before `set` was called "
            "(one monotonic clock)."
        )
        add("")
        add(_row(["store", "samples", "median", "p90", "max"]))
        add(_row(["---", "---:", "---:", "---:", "---:"]))
        for row in results["store"]:
            name = (
                f"etcd_rdzv EtcdStore, {row['api']}"
                if row["kind"] == "ours"
                else "torch EtcdStore (etcd-v2 handler's), v2"
            )
            if "median" not in row:
                add(_row([name, "0", f"failed: {row.get('error')}", "", ""]))
                continue
            add(
                _row(
                    [
                        name,
                        str(len(row["samples"])),
                        f"{row['median'] * 1000:.2f} ms",
                        f"{row['p90'] * 1000:.2f} ms",
                        f"{row['max'] * 1000:.2f} ms",
                    ]
                )
            )
    if results["imports"]:
        add("")
        add("## Import time")
        add("")
        add(_row(["module", "runs", "median", "min"]))
        add(_row(["---", "---:", "---:", "---:"]))
        for module, times in results["imports"].items():
            add(
                _row(
                    [
                        f"`import {module}`",
                        str(len(times)),
                        f"{statistics.median(times) * 1000:.0f} ms",
                        f"{min(times) * 1000:.0f} ms",
                    ]
                )
            )
    notes = Path(__file__).with_name("NOTES.md")
    if notes.exists() and not args.get("quick"):
        add("")
        add(notes.read_text().rstrip())
    add("")
    return "\n".join(lines)
