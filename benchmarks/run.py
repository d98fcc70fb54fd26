"""Benchmark etcd_rdzv's rendezvous beside PyTorch's own handlers: one command.

    python3 -m benchmarks.run                       # everything; writes docs/benchmarks.md
    python3 -m benchmarks.run --quick --out /tmp/b.md   # a smoke run in well under a minute

What it measures (see ``docs/benchmarks.md`` for a run's results):

* **time to rendezvous**: N nodes are started and build their handler (imports,
  connection) first; then one "go" byte per process is written to a pipe they all
  block on, and each node records ``time.monotonic()`` (one clock for all processes on
  Linux) when ``next_rendezvous()`` returned. Time = last node's moment - go. Every
  handler gets ``min_nodes = max_nodes = N``, so none waits for a last call;
* **etcd requests and writes per node** during that (from the go signal to
  ``--count-tail`` seconds after the last node held its rank), counted by etcd itself
  (:mod:`benchmarks._etcd`), and the CPU seconds the machine and etcd spent from go to
  the last rank;
* **steady state**: etcd requests per second per member after completion, while each
  node calls ``num_nodes_waiting()`` every 0.1 s (torch's elastic agent's default
  ``monitor_interval``) and keeps its heartbeats;
* **member death to the survivors' next completed round** (our handler): a member is
  SIGKILLed; the survivors notice through ``num_nodes_waiting()`` and join the next
  round with a handler of ``min_nodes = N - 1`` and no last call;
* **store get latency** when another process sets the key;
* **import time** of ``etcd_rdzv``;
* **recovery** (:mod:`benchmarks._recovery`): real torchrun jobs (3 agents, one gloo
  worker each, training in a loop) of each of ``--recovery-handlers`` (on each
  ``--api`` where it speaks etcd) under each of ``--recovery-faults``: a host frozen,
  killed, the rank-0 host killed, an agent stopped by SIGTERM, a host joining, a spare
  replacing a member, the etcd leader killed; seconds from the fault to the survivors
  training at the new world size (or "not within" ``--recovery-limit``), worker
  restarts, and idle etcd requests per node per second. ``inprocess`` runs the same
  faults on :func:`etcd_rdzv.inprocess.run` in plain processes (one per host, no
  torchrun), counting new processes as restarts and the function's calls again;
  ``nvrx-tcpstore`` and ``nvrx-etcd`` run NVRx's in-process ``Wrapper``
  (:mod:`benchmarks._nvrx_job`) on its TCPStores or on ours, killed and rank0 only. Run
  alone (every other part skipped), it replaces only its own section of an existing
  report;
* **large N** (our handler, on each API): ``--large-nodes`` nodes as processes, and as
  threads in ``--large-procs`` processes, with the same figures as the rendezvous part;
  beside each, an **estimated floor** for this machine. A client process first does
  ``--floor-requests`` plain reads and as many plain writes on each API
  (:func:`benchmarks._etcd.calibrate`), which gives the client's and etcd's CPU time
  per read and per write; then floor(N) = N x requests per node (as measured in the
  large run, from go to the last rank) x CPU per request (read and write costs, in
  the run's mix) / cores. ``--large-cluster 3`` runs it on a 3-member etcd cluster per
  API (every member's counts and CPU added up, the leader's CPU on its own, the bytes
  etcd sent to clients on v3); ``--large-kill-leader`` SIGKILLs the leader
  ``--large-kill-after`` seconds after the go signal in each run.

Handlers: ``ours`` (etcd_rdzv's handler, per ``--api``), ``ours-dynamic`` (torch's
``DynamicRendezvousHandler`` over etcd_rdzv's backend and store, per ``--api``),
``etcd-v2`` (torch's, python-etcd backend), ``etcd`` (torch's legacy
``EtcdRendezvousHandler``), ``c10d`` (torch's, a ``TCPStore`` hosted by one node).
torch's handlers speak the v2 API only, so they run on the v2 member. Nodes are
processes, except that torch's handlers run as threads (``--torch-procs`` processes)
above ``--threads-above`` nodes: 256 torch processes do not fit in memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from . import _report
from ._harness import (
    HANDLERS,
    REPO_ROOT,
    TORCH_KINDS,
    nvrx_available,
    torch_available,
    v2_available,
)
from ._large import run_large
from ._machine import machine, versions
from ._measure import Bench
from ._recovery import FAULTS
from ._recovery_part import recovery_plot, run_recovery, write_recovery_alone
from ._recovery_report import svg

PARTS = ("rendezvous", "steady", "death", "store", "imports", "large", "recovery")


def _csv(kind: type, allowed: tuple[str, ...] | None = None) -> Any:
    def parse(text: str) -> list[Any]:
        items = [kind(x.strip()) for x in text.split(",") if x.strip()]
        if allowed is not None:
            bad = [x for x in items if x not in allowed]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {allowed}")
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        return items

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 -m benchmarks.run",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("--nodes", type=_csv(int), help="node counts (default 2,8,32,128,256)")
    parser.add_argument("--reps", type=int, help="repetitions of each rendezvous (default 3)")
    parser.add_argument(
        "--handlers",
        type=_csv(str, HANDLERS),
        help=f"handlers (default {','.join(HANDLERS)}; --quick: ours)",
    )
    parser.add_argument(
        "--api",
        type=_csv(str, ("v2", "v3")),
        help="etcd APIs for our handler and backend (default v2,v3 when v3 is available)",
    )
    parser.add_argument(
        "--endpoint", help="host:port of an etcd to use (http, both APIs); default: start our own"
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="markdown report (default: docs/benchmarks.md for a whole run or the recovery part "
        "alone; the run's work directory for a partial or quick run)",
    )
    parser.add_argument("--plot", type=Path, help="PNG plot (default: the report's name with .png)")
    parser.add_argument("--json", type=Path, help="raw results (default: the report's name .json)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: small N, short waits")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per rendezvous")
    parser.add_argument("--threads-above", type=int, default=32)
    parser.add_argument("--torch-procs", type=int, default=8)
    parser.add_argument(
        "--ours-procs",
        type=int,
        default=0,
        help="our handler's nodes as threads in this many processes (default 0: one each)",
    )
    parser.add_argument("--steady-nodes", type=int, help="N of the steady-state run (default 8)")
    parser.add_argument("--steady-window", type=float, help="seconds counted (default 60)")
    parser.add_argument("--steady-settle", type=float, help="seconds before counting (default 10)")
    parser.add_argument("--death-nodes", type=int, help="N of the member-death run (default 8)")
    parser.add_argument("--keep-alive-interval", type=int, help="(default 5, torch's default)")
    parser.add_argument("--keep-alive-max-attempt", type=int, help="(default 3)")
    parser.add_argument("--store-samples", type=int, help="store latency samples (default 50)")
    parser.add_argument("--import-reps", type=int, help="(default 7)")
    parser.add_argument(
        "--count-tail",
        type=float,
        help="seconds after the last rank that etcd's requests are still counted "
        "(default 3; --quick: 0)",
    )
    parser.add_argument(
        "--large-nodes",
        type=int,
        help="N of the large part, our handler (default 1024; --quick: 16)",
    )
    parser.add_argument(
        "--large-procs",
        type=int,
        help="the large part's nodes as threads in this many processes, besides the "
        "run with one process each (default 32; --quick: 2; 0: processes only)",
    )
    parser.add_argument(
        "--large-layouts",
        type=_csv(str, ("threads", "processes")),
        default=["threads", "processes"],
        help="the large part's layouts: threads (in --large-procs processes), "
        "processes (one each); default both",
    )
    parser.add_argument(
        "--large-clocks",
        type=_csv(str, ("built", "cold")),
        default=["built", "cold"],
        help="the large part's clocks: built (each handler built before the go signal) "
        "and cold (each node builds its handler after it, as an agent that builds and "
        "joins at once); default both",
    )
    parser.add_argument("--large-reps", type=int, help="repetitions of the large part (default 1)")
    parser.add_argument(
        "--large-settle",
        type=float,
        help="seconds each large run may wait for a quiet machine first (default 90; "
        "--quick: 5; 0: none)",
    )
    parser.add_argument(
        "--large-cluster",
        type=int,
        choices=(1, 3),
        default=1,
        help="etcd members per API of the large part: 1 (default) or a 3-member cluster "
        "(each node process lists the members in its own order)",
    )
    parser.add_argument(
        "--large-kill-leader",
        action="store_true",
        help="with --large-cluster 3: SIGKILL the etcd leader in each large run, "
        "--large-kill-after seconds after the go signal (a new cluster for each run)",
    )
    parser.add_argument(
        "--large-kill-after",
        type=float,
        default=1.0,
        help="seconds from the go signal to the leader kill (default 1.0)",
    )
    parser.add_argument(
        "--large-config",
        type=_csv(str),
        default=[],
        help="options of our handler in the large part, as key=value[,key=value] "
        "(e.g. keep_alive_interval=10); integers are passed as integers",
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        help="the GIL switch interval (seconds) of every node process (default: "
        "Python's 0.005; 0.1 lets thousands of node threads in a process hand over less)",
    )
    parser.add_argument(
        "--floor-requests",
        type=int,
        help="plain reads, and as many writes, of the floor's calibration "
        "(default 300; --quick: 100)",
    )
    parser.add_argument(
        "--recovery-handlers",
        type=_csv(str, (*HANDLERS, "ours-fast", "inprocess", "nvrx-tcpstore", "nvrx-etcd")),
        help="handlers of the recovery part (default ours,ours-dynamic,etcd-v2,c10d; "
        "--quick: ours); ours, ours-dynamic and inprocess run on each --api; ours-fast is "
        "ours with the faster detection setting (keep_alive_interval=1,"
        "keep_alive_max_attempt=2); inprocess is etcd_rdzv.inprocess.run in plain "
        "processes (no torchrun, one process per host); nvrx-tcpstore and nvrx-etcd are "
        "NVRx's in-process Wrapper (the nvrx extra) on its own TCPStores or on ours "
        "(nvrx-etcd: v3 only), for the killed and rank0 faults",
    )
    parser.add_argument(
        "--recovery-faults",
        type=_csv(str, FAULTS),
        help=f"faults of the recovery part (default {','.join(FAULTS)}; --quick: killed)",
    )
    parser.add_argument(
        "--recovery-limit",
        type=float,
        help="seconds a recovery may take before it counts as 'not within' (default 60)",
    )
    parser.add_argument("--recovery-reps", type=int, help="repetitions of each (default 1)")
    parser.add_argument(
        "--recovery-settle",
        type=float,
        help="seconds the new world is watched for later restarts (default 3)",
    )
    parser.add_argument(
        "--recovery-idle",
        type=float,
        help="seconds the idle etcd requests are counted (default 10; --quick 2; 0: not)",
    )
    parser.add_argument(
        "--recovery-worker-timeout",
        type=float,
        default=30.0,
        help="the workers' gloo process group timeout in seconds (default 30)",
    )
    parser.add_argument(
        "--skip",
        type=_csv(str, PARTS),
        default=[],
        help="parts to skip: " + ",".join(PARTS),
    )
    args = parser.parse_args(argv)
    quick = args.quick
    defaults: dict[str, Any] = {
        "nodes": [2, 4] if quick else [2, 8, 32, 128, 256],
        "reps": 1 if quick else 3,
        "handlers": ["ours"] if quick else list(HANDLERS),
        "api": ["v2", "v3"] if v2_available() else ["v3"],
        "steady_nodes": 4 if quick else 8,
        "steady_window": 3.0 if quick else 60.0,
        "steady_settle": 1.0 if quick else 10.0,
        "death_nodes": 4 if quick else 8,
        "keep_alive_interval": 1 if quick else 5,
        "keep_alive_max_attempt": 2 if quick else 3,
        "store_samples": 10 if quick else 50,
        "import_reps": 3 if quick else 7,
        "count_tail": 0.0 if quick else 3.0,
        "large_nodes": 16 if quick else 1024,
        "large_procs": 2 if quick else 32,
        "large_reps": 1,
        "large_settle": 5.0 if quick else 90.0,
        "floor_requests": 100 if quick else 300,
        "recovery_handlers": ["ours"] if quick else ["ours", "ours-dynamic", "etcd-v2", "c10d"],
        "recovery_faults": ["killed"] if quick else list(FAULTS),
        "recovery_limit": 30.0 if quick else 60.0,
        "recovery_reps": 1,
        "recovery_settle": 1.0 if quick else 3.0,
        "recovery_idle": 5.0 if quick else 10.0,  # past one renewal (4.5 s)
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name, least in (
        ("large_nodes", 1),
        ("large_procs", 0),
        ("large_reps", 1),
        ("floor_requests", 1),
        ("count_tail", 0),
        ("large_kill_after", 0),
        ("large_settle", 0),
        ("recovery_reps", 1),
        ("recovery_limit", 1),
        ("recovery_settle", 0),
        ("recovery_idle", 0),
    ):
        if getattr(args, name) < least:
            option = "--" + name.replace("_", "-")
            parser.error(f"{option} {getattr(args, name)}: must be at least {least}")
    # Only a whole run (or the recovery part alone, which replaces its own section)
    # writes docs/benchmarks.md by default: a partial or quick run would replace every
    # section of the page with its own few, so it writes into its work directory
    # (main names it) unless --out says where.
    if args.out is None and not quick and (whole_run(args) or recovery_alone(args)):
        args.out = REPO_ROOT / "docs" / "benchmarks.md"
    if args.out is not None:
        report_paths(args, args.out)
    if args.large_kill_leader and args.large_cluster < 3:
        parser.error("--large-kill-leader needs --large-cluster 3")
    if args.large_cluster > 1 and args.endpoint:
        parser.error("--large-cluster 3 starts its own members: not with --endpoint")
    if "v2" in args.api and not v2_available():
        parser.error("--api v2 needs the v2 extra: pip install 'etcd-rdzv[v2]' (or '.[bench]')")
    if set(args.handlers) & TORCH_KINDS and not torch_available():
        parser.error(f"handlers {sorted(set(args.handlers) & TORCH_KINDS)} need torch")
    if "recovery" not in args.skip and not torch_available():
        parser.error("the recovery part runs torchrun and needs torch (or --skip recovery)")
    nvrx = [h for h in args.recovery_handlers if h.startswith("nvrx-")]
    if "recovery" not in args.skip and "nvrx-etcd" in nvrx and "v3" not in args.api:
        parser.error("--recovery-handlers nvrx-etcd runs on the v3 API only: add --api v3")
    if "recovery" not in args.skip and nvrx and not nvrx_available():
        parser.error(
            f"--recovery-handlers {','.join(nvrx)} need NVRx: pip install -c constraints.txt "
            "-e '.[nvrx]' (nvidia-resiliency-ext)"
        )
    return args


def whole_run(args: argparse.Namespace) -> bool:
    """Every part runs: the run writes the whole page."""
    return not args.skip


def recovery_alone(args: argparse.Namespace) -> bool:
    """Only the recovery part runs: it replaces its own section of the page."""
    return set(args.skip) >= set(PARTS) - {"recovery"} and "recovery" not in args.skip


def report_paths(args: argparse.Namespace, out: Path) -> None:
    """The report at ``out``; the plot and the raw results beside it unless given."""
    args.out = out
    if args.plot is None:
        args.plot = out.with_suffix(".png")
    if args.json is None:
        args.json = out.with_suffix(".json")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.switch_interval is not None:
        if not 0 < args.switch_interval <= 1:
            raise SystemExit(f"--switch-interval: {args.switch_interval} is not in (0, 1]")
        os.environ["FLEET_SWITCH_INTERVAL"] = str(args.switch_interval)
    started = time.time()
    workdir = Path(tempfile.mkdtemp(prefix="etcd-rdzv-bench-"))
    if args.out is None:
        report_paths(args, workdir / "benchmarks.md")
    bench = Bench(args, workdir)
    results = bench.results
    results.update(
        count_tail=args.count_tail,
        started=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        load_before=os.getloadavg(),
        machine=machine(),
        versions=versions(),
        args={
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("out", "plot", "json")
        },
    )
    bench.log(f"load average before: {results['load_before']}; work dir {workdir}")
    try:
        series = bench.series()
        ours = [s for s in series if s.handler == "ours"]
        if "imports" not in args.skip:
            bench.imports()
        if "store" not in args.skip:
            for api in args.api:
                bench.store("ours", api)
            if "etcd-v2" in args.handlers:
                bench.store("torch-etcd", "v2")
        if "rendezvous" not in args.skip:
            for n in args.nodes:
                bench.log(f"rendezvous, N={n}")
                for rep in range(1, args.reps + 1):
                    for s in series:
                        bench.rendezvous(s, n, rep)
        if "steady" not in args.skip:
            for s in series:
                if s.api is not None:
                    bench.steady(s, args.steady_nodes)
        if "death" not in args.skip:
            for s in ours:
                for rep in range(1, args.reps + 1):
                    bench.death(s, args.death_nodes, rep)
        if "large" not in args.skip:
            if ours:
                run_large(bench, ours)
            else:
                bench.log("large N: skipped (it runs our handler only: --handlers ours)")
        if "recovery" not in args.skip:
            results["recovery"] = run_recovery(bench, args)
    finally:
        bench.close()
    results["load_after"] = os.getloadavg()
    results["seconds"] = time.time() - started
    bench.log(f"load average after: {results['load_after']}; took {results['seconds']:.0f}s")
    if recovery_alone(args):
        write_recovery_alone(results, args)
        bench.log(f"wrote the recovery section of {args.out}, {args.json}")
        return 0
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    plotted = _report.plot(results, args.plot)
    recovery_svg = None
    if results.get("recovery"):
        recovery_svg = recovery_plot(args)
        svg(results, recovery_svg)
    args.out.write_text(
        _report.markdown(results, args.plot if plotted else None, args.out, recovery_svg)
    )
    bench.log(f"wrote {args.out}, {args.json}" + (f", {args.plot}" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
