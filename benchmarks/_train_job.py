"""The worker of the recovery benchmark (:mod:`benchmarks._recovery`): gloo training in
a loop, as torchrun starts it (one per agent).

Each step all-reduces a small tensor with gloo, then appends one line to
``<out_dir>/w-<pid>.jsonl``: ``[monotonic time, world size, rank, restart count, pid,
agent pid, group]`` (its first line, written at the worker's start, has world size 0
and rank -1). ``time.monotonic()`` is one clock for every process on Linux, so
the harness compares these times with the moment of its fault. ``group`` identifies
the worker group: every worker draws a random number after ``init_process_group`` and
the group all-reduces their sum, so the workers of one rendezvous round share it and
a restarted group has another.

A worker exits when its agent is gone (it was re-parented; a thread checks, since the
main thread may be blocked in a collective with a frozen peer), after
``--max-seconds``, or when a collective fails (the agent restarts it then).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

EXIT_ORPHANED = 4
EXIT_TOO_LONG = 5


def _watch_parent(agent_pid: int, started: float, max_seconds: float) -> None:
    """Exit the process when the agent is gone or the job ran too long."""
    while True:
        time.sleep(0.25)
        if os.getppid() != agent_pid:
            os._exit(EXIT_ORPHANED)
        if time.monotonic() - started > max_seconds:
            os._exit(EXIT_TOO_LONG)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--interval", type=float, default=0.1, help="sleep between steps")
    parser.add_argument("--timeout", type=float, default=30.0, help="process group timeout")
    parser.add_argument("--max-seconds", type=float, default=900.0)
    args = parser.parse_args(argv)

    agent_pid = os.getppid()
    pid = os.getpid()
    started = time.monotonic()
    threading.Thread(
        target=_watch_parent,
        args=(agent_pid, started, args.max_seconds),
        name="watch-agent",
        daemon=True,
    ).start()

    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    path = args.out_dir / f"w-{pid}.jsonl"
    with path.open("a", buffering=1) as out:
        # The worker's start: world size 0, rank -1 (before the process group exists).
        out.write(f"[{started:.6f},0,-1,{restarts},{pid},{agent_pid},0]\n")

        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
        rank, world_size = dist.get_rank(), dist.get_world_size()
        token = torch.tensor([float(random.randrange(1 << 20))], dtype=torch.float64)
        dist.all_reduce(token)
        group = int(token.item())
        while True:
            tensor = torch.full((1024,), float(rank + 1))
            dist.all_reduce(tensor)
            if tensor[0].item() != world_size * (world_size + 1) / 2:
                print(f"rank {rank}: wrong sum {tensor[0].item()}", file=sys.stderr)
                return 3
            now = time.monotonic()
            out.write(f"[{now:.6f},{world_size},{rank},{restarts},{pid},{agent_pid},{group}]\n")
            time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
