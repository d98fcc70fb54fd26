"""The in-process worker of the recovery benchmark (:mod:`benchmarks._recovery`): the
training loop of :mod:`benchmarks._train_job` run by :func:`etcd_rdzv.inprocess.run`
in a process of its own, started by the harness (no launcher: one process is one host).

``python3 -m benchmarks._inprocess_job OUT_DIR --endpoint E --run-id R --nnodes 2:3
--api v3``: every call of the training function builds the round's gloo group, draws the
group's token as :mod:`benchmarks._train_job` does, then all-reduces 4 KiB, sleeps
``--interval`` and calls ``Round.check()`` per step. The lines in
``<out_dir>/w-<pid>.jsonl`` are the same: ``[monotonic time, world size, rank, call,
pid, pid, group]``, where the restart-count field holds the function's call in this
process (0 first) and the agent field the process itself (the host). The first line,
at the process's start, has world size 0 and rank -1; a process writes it once, so a
new pid is a new process.

The rendezvous has its defaults (``api`` aside), as the torchrun rows' handler;
``--timeout`` is ``run()``'s ``pg_timeout``. SIGTERM leaves the job (``run()`` tears the
round down and leaves the rendezvous): the scale down. The process exits when the
harness is gone or after ``--max-seconds``.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from ._train_job import _watch_parent


def _leave(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks._inprocess_job")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--nnodes", required=True, help="MIN:MAX")
    parser.add_argument("--api", choices=("v2", "v3"), default="v3")
    parser.add_argument("--interval", type=float, default=0.1, help="sleep between steps")
    parser.add_argument("--timeout", type=float, default=30.0, help="pg_timeout of run()")
    parser.add_argument("--max-seconds", type=float, default=900.0)
    args = parser.parse_args(argv)
    low, _, high = args.nnodes.partition(":")

    harness_pid = os.getppid()
    pid = os.getpid()
    started = time.monotonic()
    threading.Thread(
        target=_watch_parent,
        args=(harness_pid, started, args.max_seconds),
        name="watch-harness",
        daemon=True,
    ).start()
    signal.signal(signal.SIGTERM, _leave)

    path = args.out_dir / f"w-{pid}.jsonl"
    with path.open("a", buffering=1) as out:
        out.write(f"[{started:.6f},0,-1,0,{pid},{pid},0]\n")

        import torch
        import torch.distributed as dist

        from etcd_rdzv import RendezvousGracefulExitError, RendezvousParameters
        from etcd_rdzv.inprocess import Round, run

        def train(rnd: Round) -> None:
            rnd.init_process_group("gloo")
            rank, world_size = rnd.rank, rnd.world_size
            token = torch.tensor([float(random.randrange(1 << 20))], dtype=torch.float64)
            dist.all_reduce(token)
            group = int(token.item())
            while True:
                tensor = torch.full((1024,), float(rank + 1))
                dist.all_reduce(tensor)
                if tensor[0].item() != world_size * (world_size + 1) / 2:
                    raise RuntimeError(f"rank {rank}: wrong sum {tensor[0].item()}")
                now = time.monotonic()
                out.write(f"[{now:.6f},{world_size},{rank},{rnd.call},{pid},{pid},{group}]\n")
                rnd.check()
                time.sleep(args.interval)

        params = RendezvousParameters(
            "etcd-rdzv", args.endpoint, args.run_id, int(low), int(high or low), api=args.api
        )
        try:
            run(train, params, pg_timeout=args.timeout)
        except RendezvousGracefulExitError:  # a spare the job did not need
            return 0
    return 0


if __name__ == "__main__":
    import logging

    logging.basicConfig(
        level=os.environ.get("LOGLEVEL", "INFO"),
        format="%(asctime)s %(process)d %(name)s %(levelname)s: %(message)s",
    )
    sys.exit(main(sys.argv[1:]))
