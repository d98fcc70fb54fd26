"""``etcd-rdzv demo``: local node processes through one rendezvous, on an embedded etcd
unless one is given; and ``_node``, the hidden command each of those processes runs.

A node prints one JSON line (its report) on stdout; the demo collects the reports,
checks that they agree (:func:`check_demo`) and prints them as a table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import IO, Any

from .. import _keys
from ..config._options import OPTIONS
from ..config.params import Settings, parse_endpoints
from ..errors import RendezvousError
from ._common import (
    DEFAULT_ENDPOINT,
    ENV_ENDPOINT,
    ENV_PASSWORD,
    EXIT_OK,
    PROG,
    Out,
    client,
    endpoint_of,
    handler,
    one_line,
    parameters,
    usage_error,
)
from .join import barrier, rendezvous

__all__ = ["NodeReport", "check_demo", "cmd_demo", "cmd_node"]

_DEMO_STORE_TIMEOUT = timedelta(seconds=30)
_DEMO_KEY = "demo/greeting"


@dataclass(frozen=True)
class NodeReport:
    """What demo node ``index`` printed: ``admitted``, ``node`` and, for a member,
    ``rank``, ``world_size``, ``round``, ``seconds``, ``torch`` and ``value``."""

    index: int
    data: dict[str, Any]


def cmd_node(args: argparse.Namespace, out: Out) -> int:
    """One demo node: rendezvous, store round-trip, barrier, leave; one JSON line."""
    _, settings = parameters(
        args, min_nodes=args.min_nodes, max_nodes=args.max_nodes, local_addr="127.0.0.1"
    )
    rdzv = handler(settings, use_torch=args.torch)
    report: dict[str, Any] = {"index": args.index, "node": rdzv.node_id}
    try:
        started = time.monotonic()
        try:
            result = rendezvous(rdzv)
        except RendezvousError as exc:
            if rdzv.is_closed():  # not admitted before rank 0 closed the run
                report.update(admitted=False, reason=one_line(exc))
                out.result(json.dumps(report))
                return EXIT_OK
            raise
        report.update(
            admitted=True,
            rank=result.rank,
            world_size=result.world_size,
            round=result.round,
            seconds=round(time.monotonic() - started, 3),
            torch="torch" in sys.modules,
        )
        store = result.store
        store.set_timeout(_DEMO_STORE_TIMEOUT)
        if result.rank == 0:
            store.set(_DEMO_KEY, f"hello from rank 0 ({rdzv.node_id})")
        report["value"] = store.get(_DEMO_KEY).decode("utf-8")
        barrier(result, "demo", out)
        if result.rank == 0:
            rdzv.set_closed()  # nodes still waiting for a next round give up now
    finally:
        rdzv.shutdown()
    out.result(json.dumps(report))
    return EXIT_OK


def _node_command(
    settings: Settings, endpoint: str, index: int, *, debug: bool, use_torch: bool
) -> list[str]:
    """The command line of demo node ``index``, from the demo's validated settings:
    every connection and rendezvous option, as a flag of ``_node``."""
    handler = settings.handler
    command = [sys.executable, "-m", "etcd_rdzv", "_node", "--quiet"]
    if debug:
        command.append("--debug")
    command += [
        f"--run-id={settings.run_id}",
        f"--min-nodes={handler.min_nodes}",
        f"--max-nodes={handler.max_nodes}",
        f"--index={index}",
        f"--endpoint={endpoint}",
    ]
    for opt in OPTIONS:
        # The password goes in the environment, not where `ps` shows it.
        if opt.cli not in ("etcd", "rendezvous") or opt.name in _NOT_FORWARDED:
            continue
        value = settings.value(opt.name)
        if opt.kind == "bool":
            command += [opt.flag] if value else []
        elif value is not None:
            command.append(f"{opt.flag}={value}")
    if use_torch:
        command.append("--torch")
    return command


_NOT_FORWARDED = ("password", "password_file")


@contextlib.contextmanager
def _embedded_etcd(out: Out) -> Iterator[str]:
    from ..testing import EtcdServer

    started = time.monotonic()
    out.progress("starting an embedded etcd on free loopback ports")
    # v3 only, as etcd 3.6 serves: the demo's nodes use the default api=v3.
    server = EtcdServer("etcd-rdzv-demo", enable_v2=False)
    try:
        server.start()
        took = time.monotonic() - started
        out.progress(f"embedded etcd ready at {server.endpoint} ({took:.2f}s)")
        yield server.endpoint
    finally:
        server.close()
        out.progress("embedded etcd stopped")


def _run_nodes(
    args: argparse.Namespace, settings: Settings, endpoint: str, out: Out
) -> list[NodeReport]:
    """Run ``--nodes`` node processes to their end; their reports, members first."""
    env = dict(os.environ)
    if settings.client.password is not None:
        # Not on the command line, where `ps` shows it.
        env[ENV_PASSWORD] = settings.client.password
    env.pop(ENV_ENDPOINT, None)
    procs: list[subprocess.Popen[str]] = []
    logs: list[IO[str] | None] = []
    done: queue.Queue[tuple[int, int, str]] = queue.Queue()

    def collect(i: int, proc: subprocess.Popen[str]) -> None:
        stdout, _ = proc.communicate()
        done.put((i, proc.returncode, stdout))

    with contextlib.ExitStack() as stack:
        stack.callback(_reap, procs)
        for i in range(args.nodes):
            errlog: IO[str] | None = None
            if not args.debug:  # with --debug the nodes' logs go straight to our stderr
                errlog = stack.enter_context(tempfile.TemporaryFile("w+", encoding="utf-8"))
            logs.append(errlog)
            proc = subprocess.Popen(
                _node_command(settings, endpoint, i, debug=args.debug, use_torch=args.torch),
                stdout=subprocess.PIPE,
                stderr=errlog,
                stdin=subprocess.DEVNULL,
                env=env,
                text=True,
            )
            procs.append(proc)
            threading.Thread(
                target=collect, args=(i, proc), name=f"etcd-rdzv-demo-node-{i}", daemon=True
            ).start()
        rdzv = settings.handler
        out.progress(
            f"started {args.nodes} node processes for run {settings.run_id!r} (min "
            f"{rdzv.min_nodes}, max {rdzv.max_nodes}, last call {rdzv.last_call_timeout}s)"
        )
        deadline = time.monotonic() + rdzv.join_timeout + 2 * settings.client.read_timeout + 30
        reports: list[NodeReport] = []
        for _ in procs:
            try:
                i, code, stdout = done.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                raise RendezvousError("demo nodes did not finish in time") from None
            if code != 0:
                raise RendezvousError(f"demo node {i} failed: {_node_error(logs[i], code)}")
            lines = stdout.strip().splitlines()
            try:
                reports.append(NodeReport(i, json.loads(lines[-1])))
            except (IndexError, ValueError):
                raise RendezvousError(f"demo node {i} printed no report: {stdout!r}") from None
        return sorted(reports, key=lambda r: (not r.data["admitted"], r.data.get("rank", 0)))


def _reap(procs: list[subprocess.Popen[str]]) -> None:
    """Kill node processes still running (after a failure) and wait for all."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


def _node_error(errlog: IO[str] | None, code: int) -> str:
    if errlog is None:
        return f"exit status {code} (its errors are above)"
    errlog.seek(0)
    lines = [line.strip() for line in errlog.read().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(f"{PROG}: error:")]
    if errors:
        return errors[-1][len(f"{PROG}: error: ") :]
    return lines[-1] if lines else f"exit status {code}"


def check_demo(reports: list[NodeReport]) -> list[str]:
    """What is wrong with the nodes' reports (empty: all agree)."""
    members = [r.data for r in reports if r.data["admitted"]]
    if not members:
        return ["no node was admitted"]
    problems = []
    size = members[0]["world_size"]
    if sorted(m["rank"] for m in members) != list(range(size)):
        problems.append(f"ranks {sorted(m['rank'] for m in members)} are not 0..{size - 1}")
    if len({(m["world_size"], m["round"]) for m in members}) != 1:
        problems.append("members disagree on world size or round")
    if len({m["value"] for m in members}) != 1:
        problems.append("members read different store values")
    return problems


def cmd_demo(args: argparse.Namespace, out: Out) -> int:
    """Run the demo: nodes through one rendezvous, their table, a check that they agree."""
    started = time.monotonic()
    min_nodes = args.min_nodes or min(args.nodes, args.max_nodes or args.nodes)
    max_nodes = args.max_nodes or max(args.nodes, min_nodes)
    if min_nodes > args.nodes:
        usage_error(
            args, f"argument --min-nodes: must be at most --nodes ({args.nodes}), got {min_nodes}"
        )
    args.run_id = args.run_id or f"demo-{uuid.uuid4().hex[:8]}"
    given = endpoint_of(args) if args.endpoint or os.environ.get(ENV_ENDPOINT, "").strip() else None
    # Validate everything before starting anything.
    _, settings = parameters(
        args, endpoint=given or DEFAULT_ENDPOINT, min_nodes=min_nodes, max_nodes=max_nodes
    )
    config = settings.client
    with contextlib.ExitStack() as stack:
        if given is None:
            endpoint = stack.enter_context(_embedded_etcd(out))
            config = dataclasses.replace(config, endpoints=parse_endpoints(endpoint))
        else:
            endpoint = given
        kv = client(config)  # fail here, once, if etcd does not answer
        stack.callback(kv.close)
        run_dir = _keys.run_dir(config.key_prefix, settings.run_id)
        if given is not None:
            stack.callback(kv.delete_prefix, run_dir)  # leave no keys in a shared etcd
        reports = _run_nodes(args, settings, endpoint, out)
        problems = check_demo(reports)
        _print_demo(reports, out)
        if problems:
            raise RendezvousError("demo failed: " + "; ".join(problems))
        out.progress("handlers shut down; run closed by rank 0")
    out.progress(f"demo finished in {time.monotonic() - started:.2f}s")
    return EXIT_OK


def _print_demo(reports: list[NodeReport], out: Out) -> None:
    rows = [("proc", "node", "rank", "world size", "round", "rendezvous (s)")]
    for r in reports:
        d = r.data
        if d["admitted"]:
            rows.append(
                (
                    str(r.index),
                    d["node"],
                    str(d["rank"]),
                    str(d["world_size"]),
                    str(d["round"]),
                    f"{d['seconds']:.2f}",
                )
            )
        else:
            rows.append((str(r.index), d["node"], "-", "-", "-", "not admitted"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [row[0].rjust(widths[0]), row[1].ljust(widths[1])]
        cells += [cell.rjust(w) for cell, w in zip(row[2:], widths[2:], strict=True)]
        out.result("  ".join(cells))
    members = [r.data for r in reports if r.data["admitted"]]
    if members:
        value = members[0]["value"]
        flavour = "torch" if any(m["torch"] for m in members) else "native (torch not imported)"
        out.result(
            f"store round-trip: rank 0 set {_DEMO_KEY!r}, {len(members)} of "
            f"{len(members)} members read {value!r}: ok"
        )
        out.result(f"handler: {flavour}")
    late = len(reports) - len(members)
    if late:
        out.result(f"{late} node(s) were not admitted (round full) and gave up when it closed")
