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


def _members(row: dict[str, Any]) -> str:
    # Rows of older runs say nothing: they ran on one member.
    size = int(row.get("etcd_members", row.get("cluster", 1)))
    return "1 member" if size == 1 else f"{size} members"


def _kill(row: dict[str, Any]) -> str:
    """The leader kill of a row in a few words, or ``""``."""
    kill = row.get("kill")
    if not kill:
        return ""
    text = f"{kill.get('member', '?')} killed"
    if kill.get("at") is not None:
        text += f" at {kill['at']:.2f} s"
    if kill.get("new_leader") is not None:
        text += f"; {kill['new_leader']} leads {kill['election']:.2f} s later"
    if kill.get("error"):
        text += f" ({kill['error']})"
    return text


def _bytes(row: dict[str, Any]) -> str:
    sent = row.get("bytes_sent")
    return "" if sent is None else f"{sent / 1024:.1f} KiB"


def _leader_cpu(row: dict[str, Any]) -> str:
    cpu = row.get("etcd_cpu_leader")
    return "" if cpu is None else f"{cpu:.2f} s ({row.get('leader', '?')})"


def cluster_text(large: list[dict[str, Any]]) -> list[str]:
    """What the cluster columns mean, where a row ran on a cluster or has them."""
    lines: list[str] = []
    if any("bytes_sent" in row for row in large) or any(
        int(row.get("etcd_members", 1)) > 1 for row in large
    ):
        lines += [
            "",
            "**etcd columns.** *etcd*: the members of each API's etcd (local processes, "
            "50 ms heartbeat, 500 ms election timeout); on a cluster, node process *i* "
            "lists the members starting from member *i* mod 3, so the nodes spread their "
            "connections over the members. Requests, writes, bytes and CPU are added up "
            "over the members, each scraped (`/metrics`) before the go signal and after "
            "(a killed member: just before its kill); on v2 the writes are the most any "
            "member counted (`etcd_debugging_store_writes_total` counts what each "
            "member's store applied, and every member applies every write). *bytes sent "
            "per node*: v3 `etcd_network_client_grpc_sent_bytes_total`, what etcd's gRPC "
            "server sent (unary answers and stream messages, as protobuf; the JSON "
            "gateway our client talks to re-encodes them as larger JSON after this "
            "count), to the end of the count window; v2: none, etcd 3.5 counts no bytes "
            "of its v2 HTTP answers. *etcd CPU*: every member's "
            "`process_cpu_seconds_total` from the go signal to the last rank, added up; "
            "*of it, the leader*: the member that led at the go signal.",
        ]
    if any(row.get("kill") for row in large):
        lines += [
            "",
            "**Leader kill.** In each such run the member that led at the go signal is "
            "SIGKILLed the given seconds after it; the new leader is the first surviving "
            "member whose `/metrics` say `etcd_server_is_leader 1`, looked for every "
            "50 ms from a thread of the benchmark (so its time is up to one look and one "
            "scrape late). The seconds are still from the go signal to the last rank, and "
            "every row is checked as always: every rank 0..N-1 once, one world size, and "
            "(our handler) one member list, read from etcd after the run, with each node "
            "at the rank it reported. The "
            "killed member's counts and CPU stop at its kill; the survivors' include the "
            "nodes' move to them (new connections and watches) within the count window, "
            "also when the kill came after the last rank. Each such run starts on a new "
            "cluster of three healthy members.",
        ]
    clustered = [row for row in large if int(row.get("etcd_members", 1)) > 1]
    if clustered:
        lines.append("")
    for row in clustered:
        where = f"{row['api']}, N={row['n']}, {_layout(row)}"
        parts = []
        if row.get("requests_members"):
            parts.append(
                "requests per node by member (to the end of the count window) "
                + ", ".join(f"{k} {v:.2f}" for k, v in sorted(row["requests_members"].items()))
            )
        if row.get("etcd_cpu_members"):
            parts.append(
                "etcd CPU by member (to the last rank) "
                + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(row["etcd_cpu_members"].items()))
                + f" (leader at the go signal: {row.get('leader', '?')})"
            )
        kill, last = row.get("kill"), row.get("seconds")
        if kill:
            when = ""
            if last is not None and kill.get("at") is not None:
                when = " (before the last rank)" if kill["at"] < last else " (after the last rank)"
            parts.append(_kill(row) + when)
        parts.append(f"last rank {fmt(last, 2, ' s')} after the go signal")
        lines.append(f"- {where}: " + "; ".join(parts))
    return lines


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
            f"over a second; at most {args.get('large_settle', 90):g} s of waiting): the "
            "one before leaves it busy for a "
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
                "etcd",
                "seconds",
                "requests per node",
                "writes per node",
                "bytes sent per node",
                "machine CPU",
                "etcd CPU",
                "of it, the leader",
                "estimated floor",
            ]
        )
    )
    add(md_row(["---"] * 3 + ["---:"] * 8))
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
                    _members(row) + (f", {_kill(row)}" if row.get("kill") else ""),
                    seconds,
                    fmt(row.get("requests"), 2),
                    fmt(row.get("writes"), 2),
                    _bytes(row),
                    fmt(row.get("machine_cpu"), 2, " s"),
                    fmt(row.get("etcd_cpu"), 2, " s"),
                    _leader_cpu(row),
                    fmt(None if est is None else est["seconds"], 2, " s"),
                ]
            )
        )
    lines += cluster_text(large)
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
        "`process_cpu_seconds_total` (on a cluster every member's, added up) over each "
        "phase, divided by the requests etcd "
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
