"""The recovery part's report: its markdown section and an SVG bar chart (written by
hand: the benchmark does not depend on matplotlib for it).

:func:`splice` puts the section into an existing page between two markers (or before
the page's notes), so a run of the recovery part alone keeps every other section.
"""

from __future__ import annotations

import os
import statistics
from html import escape
from pathlib import Path
from typing import Any

from ._tables import LABELS, label, md_row

__all__ = ["BEGIN", "END", "recovery_section", "splice", "svg"]

BEGIN = "<!-- recovery: written by python3 -m benchmarks.run -->"
END = "<!-- /recovery -->"
FAULT_NAMES = {
    "frozen": "host frozen",
    "killed": "host killed",
    "rank0": "rank-0 host killed",
    "sigterm": "agent SIGTERM (scale down)",
    "scaleup": "host joins (scale up)",
    "spare": "spare replaces a killed member",
    "leader": "etcd leader killed",
}
NVRX_TEXT = (
    "NVRx rows (`--recovery-handlers nvrx-tcpstore,nvrx-etcd`): no torchrun. NVIDIA's "
    "in-process `Wrapper` (nvidia-resiliency-ext 0.4.1) runs the same training loop "
    "(`benchmarks/_nvrx_job.py`: a gloo group per call, 4 KiB all-reduced and 0.1 s "
    "slept per step) in three plain processes, one per host, each started with its "
    "`RANK`, `WORLD_SIZE` 3, `MASTER_ADDR` and `MASTER_PORT` as NVRx's example starts "
    "its ranks, NVRx's timeouts lowered so every wait is bounded (heartbeat timeout "
    "15 s). *NVRx, its TCPStores*: NVRx's default store for the Wrapper (a TCPStore "
    "hosted by rank 0 on `MASTER_PORT+1`) and, as its example, a TCPStore of rank 0 on "
    "`MASTER_PORT+2+iteration` for the process group. *NVRx, etcd_rdzv's stores*: "
    "`etcd_rdzv.inprocess.nvrx.EtcdWrapperStore` for the Wrapper and `pg_store` for "
    "the process group, on the v3 member above: no rank hosts either. NVRx has a fixed "
    "world (no scale up, no spares) and no rendezvous on etcd, so only *killed* (a "
    "process holding neither rank 0) and *rank-0* (rank 0's process) run; its other "
    "cells stay empty. The fault SIGKILLs the process; its NVRx monitor daemon, which "
    "leaves the process's session, lives on and reports the death (as when only the "
    "process dies; a whole host lost is found after the heartbeat timeout instead), "
    "and the harness kills every daemon at the end of each measurement. Restarts "
    'count new processes after the fault; "calls again": the wrapped function called '
    "again (NVRx's next restart iteration) by the processes that were there, summed. "
    "Idle etcd requests of the etcd row are NVRx's own, with its monitor intervals "
    "lowered to 0.5 s (docs/inprocess-nvrx.md)."
)
_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#7f7f7f"]


def _order(keys: set[str]) -> list[str]:
    return sorted(keys, key=lambda k: list(LABELS).index(k) if k in LABELS else 99)


def _faults(rows: list[dict[str, Any]]) -> list[str]:
    seen = {r["fault"] for r in rows}
    return [f for f in FAULT_NAMES if f in seen]


def cells(recovery: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """(series, fault) -> seconds (list), restarts (list), errors (list), recalls
    (list: in-process rows only)."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for row in recovery["rows"]:
        cell = out.setdefault(
            (row["series"], row["fault"]),
            {"seconds": [], "restarts": [], "errors": [], "recalls": []},
        )
        if row.get("error"):
            cell["errors"].append(str(row["error"]))
        else:
            cell["seconds"].append(row["seconds"])
            cell["restarts"].append(row["restarts"])
            if "recalls" in row:  # in-process: the function's calls again
                cell["recalls"].append(row["recalls"])
    return out


def _restarts(restarts: list[int]) -> str:
    return "/".join(str(r) for r in restarts) + " restart" + ("" if restarts == [1] else "s")


def _cell_text(cell: dict[str, Any], limit: float) -> str:
    """Median (min-max) seconds, a repetition that did not recover counting as more
    than the limit; the restarts of each repetition that did."""
    secs, restarts, errors = cell["seconds"], cell["restarts"], cell["errors"]
    late = sum("not within" in e for e in errors)
    failed = len(errors) - late
    if not secs and errors and all(e.startswith("n/a") for e in errors):
        return "n/a"
    if not secs and not late:
        return "failed"
    reps = len(secs) + late
    median = statistics.median(secs + [float("inf")] * late)
    if median == float("inf"):
        text = f"not within {limit:g} s"
        if secs:
            shown = ", ".join(f"{x:.1f}" for x in secs)
            text += f" ({len(secs)} of {reps} recovered: {shown} s, {_restarts(restarts)})"
    else:
        text = f"{median:.1f} s"
        if reps > 1:
            high = f"{max(secs):.1f}" if not late else f">{limit:g}"
            text += f" ({min(secs):.1f}-{high})"
        text += ", " + _restarts(restarts)
        if cell.get("recalls"):
            calls = cell["recalls"]
            text += ", " + "/".join(map(str, calls)) + (" call" if calls == [1] else " calls")
            text += " again"
        if late:
            text += f"; {late} of {reps} not within {limit:g} s"
    if failed:
        text += f"; {failed} failed"
    return text


def recovery_section(results: dict[str, Any], svg_path: Path | None, out: Path) -> list[str]:
    rec = results["recovery"]
    rows: list[dict[str, Any]] = rec["rows"]
    table = cells(rec)
    series = _order({s for s, _ in table})
    faults = _faults(rows)
    idle = {r["series"]: r for r in rec["idle"]}
    limit = float(rec["limit"])
    kinds = (
        "torchrun and in-process jobs"
        if any(k.startswith(("inprocess/", "nvrx-")) for k in series)
        else "torchrun jobs"
    )
    lines = [BEGIN, "", f"## Recovery: real {kinds}, faulted", ""]
    add = lines.append
    runs = "; ".join(
        f"{r['started']} ({r['seconds']:.0f} s, 1-min load average {r['load'][0]:.2f} before, "
        f"{r['load'][1]:.2f} after)"
        for r in rec.get("runs", [])
    )
    plural = "s" if len(rec.get("runs", [])) > 1 else ""
    add(
        f"Run{plural} {runs}. Three torchrun agents (`--nproc-per-node=1`, "
        "`--max-restarts=100`, torch's "
        "default `--monitor-interval` 0.1 s, `--local-addr=127.0.0.1`; each handler's "
        "default rendezvous settings, ours only told its `api`), each starting one gloo "
        "worker that all-reduces 4 KiB and sleeps 0.1 s per step "
        f"(`benchmarks/_train_job.py`, process group timeout {rec['worker_timeout']:g} s). "
        "Seconds from the fault to the first moment every worker of the group that "
        "trains at the end has completed a step at the new world size (median, "
        "min-max over repetitions), and the worker restarts after the fault (each "
        "repetition; the first worker of a host that had none, the joining host's or "
        f'the spare\'s, not counted). "not within {limit:g} s": '
        "the new world did not train within the limit. Each measurement is a fresh "
        "run id; our handler and torch's etcd handlers share one etcd member per API "
        "(v3: a member without `--enable-v2`), the leader kill runs on a 3-member "
        "cluster of its own (every member's endpoint given to the agents)."
    )
    add("")
    add(md_row(["handler", *[FAULT_NAMES[f] for f in faults], "idle etcd req/node/s"]))
    add(md_row(["---", *["---:" for _ in faults], "---:"]))
    for key in series:
        row_cells = [
            _cell_text(table[(key, f)], limit) if (key, f) in table else "" for f in faults
        ]
        i = idle.get(key)
        if key in ("c10d", "nvrx-tcpstore"):
            rate = "no etcd"
        elif i is None:
            rate = "-"
        elif "rate" in i:
            rate = f"{i['rate']:.2f} ({i['write_rate']:.2f} writes)"
        else:
            rate = "failed"
        add(md_row([label(key), *row_cells, rate]))
    add("")
    add(
        "Faults (the victim holds neither worker rank 0 nor c10d's TCPStore, the first "
        "agent, unless said): *frozen* SIGSTOPs the agent and every process under it "
        "(found through `/proc`; torchrun puts workers in sessions of their own), 3 -> 2; "
        "*killed* SIGKILLs them, 3 -> 2; *rank-0* kills the host of worker rank 0 (for "
        "c10d it may host the store), 3 -> 2; *SIGTERM* goes to the agent alone, 3 -> 2; "
        "*scale up* starts two agents with `--nnodes=2:3` (they wait out their handler's "
        "last call and train at 2), then a third: the time counts from that agent's "
        "start, its imports included, 2 -> 3; *spare* runs `--nnodes=2:2` with three "
        "agents and kills a member, 2 -> 2; *leader* kills the etcd leader under a job at "
        "3, the time is until every worker steps again (and 0 restarts is the goal). "
        f"After the new world first trains, the job is watched {rec['settle']:g} s more "
        "(the leader kill 20 s) so later restarts count. Idle: etcd requests (and writes) "
        f"per node per second counted by etcd over {rec['idle_window']:g} s while the "
        "first job of each handler trained undisturbed (3 nodes)."
    )
    if any(k.startswith("inprocess/") for k in series):
        add("")
        add(
            "In-process rows (`--recovery-handlers inprocess`): no torchrun. Each host "
            "is one process that runs `etcd_rdzv.inprocess.run` with the same training "
            "loop (`benchmarks/_inprocess_job.py`: the round's gloo group, 4 KiB "
            "all-reduced and 0.1 s slept per step, `Round.check()` after each step; "
            "the rendezvous's defaults but its `api`, `pg_timeout` = the process group "
            "timeout above). A fault hits that process: *killed* and *rank-0* SIGKILL "
            "it, *frozen* SIGSTOPs it, *SIGTERM* makes it leave (`run()` tears its round "
            "down and leaves the rendezvous), *scale up* starts a third process, "
            "*spare* starts three with at most 2 members; *leader* as above. So a "
            "killed host here is a killed process on one machine: a real host's loss "
            "without a closed connection (power, partition) behaves like the frozen "
            "row. Restarts count new processes after the fault (as worker restarts "
            "above: the joining process and the spare not counted); the goal is 0. "
            '"calls again": the training function called again (in a new round) by '
            "the processes that were there, summed over them."
        )
    if any(k.startswith("nvrx-") for k in series):
        add("")
        add(NVRX_TEXT)
    loads = [float(r["load"]) for r in rows if "load" in r]
    if loads:
        add("")
        add(
            f"The machine's 1-minute load average at the faults: {min(loads):.1f} to "
            f"{max(loads):.1f} (median {statistics.median(loads):.1f}) on "
            f"{results.get('machine', {}).get('cpus', '?')} cores; every row's is in "
            "the JSON."
        )
    problems = [r for r in rows if r.get("error") and not str(r["error"]).startswith("n/a")]
    if problems:
        add("")
        add("Not recovered or failed:")
        add("")
        for r in problems:
            first = str(r["error"]).splitlines()[0]
            if "restarts" in r:
                first += f" ({r['restarts']} worker restarts meanwhile)"
            add(f"- {label(r['series'])}, {FAULT_NAMES[r['fault']]}, rep {r['rep']}: {first}")
    victims = sorted(
        {
            f"{FAULT_NAMES[r['fault']]}: {r['victim']}"
            for r in rows
            if "store" in str(r.get("victim"))
        }
    )
    if victims:
        add("")
        add("c10d victims that hosted the TCPStore: " + "; ".join(victims) + ".")
    if svg_path is not None:
        add("")
        add(f"![recovery after a fault]({os.path.relpath(svg_path, out.parent)})")
    add("")
    add(END)
    return lines


def svg(results: dict[str, Any], path: Path) -> None:
    """Horizontal bars: seconds to recover per fault and handler; 'not within' bars
    run to the limit, hatched."""
    rec = results["recovery"]
    table = cells(rec)
    series = _order({s for s, _ in table})
    faults = _faults(rec["rows"])
    limit = float(rec["limit"])
    colour = {s: _COLOURS[i % len(_COLOURS)] for i, s in enumerate(series)}
    bar, gap, left, width = 14, 10, 190, 520
    y = 40
    parts: list[str] = []
    for fault in faults:
        parts.append(
            f'<text x="{left - 8}" y="{y + 10}" text-anchor="end" font-weight="bold">'
            f"{escape(FAULT_NAMES[fault])}</text>"
        )
        y += 16
        for key in series:
            cell = table.get((key, fault))
            if cell is None:
                continue
            secs = cell["seconds"]
            if secs:
                value, text, fill = statistics.median(secs), "", colour[key]
                text = f"{value:.1f} s"
            elif any("not within" in e for e in cell["errors"]):
                value, text, fill = limit, f"not within {limit:g} s", "url(#hatch)"
            else:
                value, text, fill = 0.0, "n/a" if cell["errors"] else "", colour[key]
            w = max(width * min(value, limit) / limit, 1.0)
            parts.append(
                f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar}" fill="{fill}" '
                f'stroke="{colour[key]}"/><text x="{left + w + 4:.1f}" y="{y + 11}">'
                f"{escape(text)}</text>"
            )
            y += bar + 2
        y += gap
    legend_y = y + 10
    for i, key in enumerate(series):
        x = left + (i % 3) * 180
        ly = legend_y + (i // 3) * 18
        parts.append(
            f'<rect x="{x}" y="{ly}" width="12" height="12" fill="{colour[key]}"/>'
            f'<text x="{x + 16}" y="{ly + 10}">{escape(label(key))}</text>'
        )
    height = legend_y + 18 * ((len(series) + 2) // 3) + 10
    ticks = []
    for i in range(5):
        tx = left + width * i / 4
        ticks.append(
            f'<line x1="{tx:.1f}" y1="30" x2="{tx:.1f}" y2="{y}" stroke="#ddd"/>'
            f'<text x="{tx:.1f}" y="26" text-anchor="middle">{limit * i / 4:g} s</text>'
        )
    doc = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 120}" '
        f'height="{height}" font-family="sans-serif" font-size="11">'
        '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><line x1="0" y1="0" x2="0" y2="6" stroke="#999" '
        'stroke-width="2"/></pattern></defs>'
        f'<rect width="100%" height="100%" fill="white"/>'
        f'<text x="10" y="14" font-size="13">Seconds from the fault to training at the new '
        f"world size (median; limit {limit:g} s)</text>"
        + "".join(ticks)
        + "".join(parts)
        + "</svg>\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc)


def splice(page: str, section: list[str]) -> str:
    """``page`` with its recovery section replaced by ``section`` (or inserted before
    the notes, ``## How the numbers are made``, or at the end)."""
    text = "\n".join(section)
    if BEGIN in page and END in page:
        head, rest = page.split(BEGIN, 1)
        return head + text + rest.split(END, 1)[1]
    marker = "\n## How the numbers are made"
    if marker in page:
        head, rest = page.split(marker, 1)
        return head.rstrip("\n") + "\n\n" + text + "\n" + marker + rest
    return page.rstrip("\n") + "\n\n" + text + "\n"
