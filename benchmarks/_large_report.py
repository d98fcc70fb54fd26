"""The report's Large N section, and the estimated floor of each large-N row."""

from __future__ import annotations

from typing import Any

from ._tables import fmt, md_row


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
    where = "processes" if row["layout"] == "processes" else f"threads ({row['procs']} processes)"
    # Rows of older runs have no clock: their handlers were built before the go signal.
    return where + (", cold" if row.get("clock") == "cold" else "")


def large_section(results: dict[str, Any]) -> list[str]:
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
        "Seconds from the go signal to the last node's rank: with each handler built "
        "before the go signal, or (*cold*) each node building its handler after it (its "
        "client, probe, lease and watch inside the clock, as an agent that builds and "
        "joins at once); etcd's requests and writes "
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
        md_row(
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
    add(md_row(["---", "---", "---:", "---:", "---:", "---:", "---:", "---:"]))
    for row in large:
        est = floor(row, calibration.get(row["api"]))
        seconds = fmt(row.get("seconds"), 2, " s")
        if row.get("error"):
            seconds += f" (failed: {row['error']})"
        add(
            md_row(
                [
                    row["api"],
                    f"N={row['n']}, {_layout(row)}" + (f", run {row['rep']}" if reps > 1 else ""),
                    seconds,
                    fmt(row.get("requests"), 2),
                    fmt(row.get("writes"), 2),
                    fmt(row.get("machine_cpu"), 2, " s"),
                    fmt(row.get("etcd_cpu"), 2, " s"),
                    fmt(None if est is None else est["seconds"], 2, " s"),
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
    add(md_row(["API", "requests", "read: client", "read: etcd", "write: client", "write: etcd"]))
    add(md_row(["---", "---:", "---:", "---:", "---:", "---:"]))
    for api, cal in calibration.items():
        if "read" not in cal or "write" not in cal:
            add(md_row([api, "", f"failed: {cal.get('error')}", "", "", ""]))
            continue
        add(
            md_row(
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
