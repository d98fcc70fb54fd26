"""The looping training script torchrun restarts in test_torchrun_native.py.

One worker per agent. Each iteration all-reduces ``rank + 1`` (checked against the
expected sum) and a stop flag with gloo, then writes what it saw to
``<out_dir>/ws<W>-rank<R>-pid<PID>.json``: one file per worker process, rewritten
atomically each iteration, so every restart of the worker group leaves its own file.

The job ends (exit 0) when

* it has done ``--iterations`` iterations at world size ``--finish-world-size``, or
* any worker saw ``--stop-file`` (the flag is all-reduced, so all stop together).

It exits non-zero when the sum is wrong, when its agent died (it was re-parented:
no orphan outlives its test) or after ``--max-seconds``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

EXIT_BAD_SUM = 3
EXIT_ORPHANED = 4
EXIT_TOO_LONG = 5


def _write_json(path: Path, data: dict[str, object]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)  # atomic: readers never see half a file


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--finish-world-size", type=int, default=0, help="0: never")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--stop-file", type=Path)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--max-seconds", type=float, default=150.0)
    args = parser.parse_args(argv)

    agent_pid = os.getppid()
    pid = os.getpid()
    started = time.monotonic()
    # Known before init_process_group, which may block: the test can always kill us.
    (args.out_dir / f"pid-{pid}").write_text(str(agent_pid))

    import torch
    import torch.distributed as dist

    imported_at = time.monotonic()
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    initialized_at = time.monotonic()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = args.out_dir / f"ws{world_size}-rank{rank}-pid{pid}.json"
    expected = world_size * (world_size + 1) / 2
    iteration = 0
    first_at = 0.0  # time.monotonic() (one clock for every process here) of step one
    while True:
        stop = args.stop_file is not None and args.stop_file.exists()
        tensor = torch.tensor([rank + 1.0, 1.0 if stop else 0.0])
        dist.all_reduce(tensor)
        iteration += 1
        first_at = first_at or time.monotonic()
        value = tensor[0].item()
        _write_json(
            out,
            {
                "rank": rank,
                "world_size": world_size,
                "value": value,
                "iterations": iteration,
                "pid": pid,
                "agent_pid": agent_pid,
                "group_rank": os.environ.get("GROUP_RANK"),
                "restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
                "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
                "stopped": bool(tensor[1].item()),
                "first_step_at": first_at,
                "started_at": started,
                "imported_at": imported_at,
                "initialized_at": initialized_at,
            },
        )
        if value != expected:
            print(f"rank {rank}: sum {value} != {expected}", file=sys.stderr)
            return EXIT_BAD_SUM
        if tensor[1].item() > 0:
            break
        if world_size == args.finish_world_size and iteration >= args.iterations:
            break
        if os.getppid() != agent_pid:
            print(f"rank {rank}: agent {agent_pid} is gone", file=sys.stderr)
            return EXIT_ORPHANED
        if time.monotonic() - started > args.max_seconds:
            print(f"rank {rank}: still running after {args.max_seconds}s", file=sys.stderr)
            return EXIT_TOO_LONG
        time.sleep(args.interval)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
