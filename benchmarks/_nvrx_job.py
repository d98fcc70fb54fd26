"""The NVRx worker of the recovery benchmark (:mod:`benchmarks._recovery`): the
training loop of :mod:`benchmarks._inprocess_job` run by NVIDIA's in-process
``Wrapper`` (nvidia-resiliency-ext 0.4.1) in a process of its own, started by the
harness as NVRx's basic example starts its ranks (one process is one host).

``python3 -m benchmarks._nvrx_job OUT_DIR --store tcp|etcd --rank R --world 3
--master-port P [--endpoint E --run-id R --api v3]``: the process sets ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` (loopback) and ``MASTER_PORT`` as the example's launcher
would, and every call of the wrapped function reads its rank and world size from
them (NVRx rewrites them when it assigns new ranks). The stores:

* ``tcp``: NVRx's default, its ``TCPStore`` hosted by rank 0 on ``MASTER_PORT + 1``
  for the Wrapper, and as its example a TCPStore of rank 0 on
  ``MASTER_PORT + 2 + iteration`` for the process group;
* ``etcd``: :class:`etcd_rdzv.inprocess.nvrx.EtcdWrapperStore` (the run id as the
  job) and :func:`etcd_rdzv.inprocess.nvrx.pg_store`.

Each call builds the gloo group, draws the group's token, then all-reduces 4 KiB and
sleeps ``--interval`` per step. The lines in ``<out_dir>/w-<pid>.jsonl`` are those of
:mod:`benchmarks._inprocess_job`: ``[monotonic time, world size, rank, iteration, pid,
pid, group]``, where the restart-count field holds NVRx's restart iteration (0 first).
NVRx's monitor daemon logs to ``<out_dir>/monitor-<rank>.log``, with its pid
(:func:`daemon_pids`): it leaves the process's session, and the harness kills it.

NVRx's timeouts are lowered (as tests/torch/_nvrx_job.py does) so every wait is
bounded; ``--heartbeat-timeout`` is NVRx's ``heartbeat_timeout``. The process exits
when the harness is gone or after ``--max-seconds``.
"""

# No ``from __future__ import annotations``: NVRx finds the CallWrapper parameter by
# its annotation (issubclass), which a string is not.
import argparse
import datetime
import os
import random
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ._train_job import _watch_parent

MODULE = "benchmarks._nvrx_job"
STORES = ("tcp", "etcd")
_DAEMON = re.compile(r"daemon_pid=(\d+)")


def daemon_pids(out_dir: Path) -> list[int]:
    """NVRx's monitor daemons of the workers writing to ``out_dir``, from their logs
    (each logs ``daemon_pid=<pid>`` when it starts)."""
    pids = []
    for log in sorted(out_dir.glob("monitor-*.log")):
        try:
            found = _DAEMON.search(log.read_text(errors="replace"))
        except OSError:
            continue
        if found:
            pids.append(int(found.group(1)))
    return pids


def is_worker(pid: int) -> bool:
    """Whether ``pid`` is a live process of this worker program (a daemon forked from
    it included; not a recycled pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return MODULE.encode() in cmdline and state != "Z"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks._nvrx_job")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--store", choices=STORES, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--endpoint", help="etcd's endpoint (--store etcd)")
    parser.add_argument("--run-id", help="the run, and NVRx's job (--store etcd)")
    parser.add_argument("--api", choices=("v2", "v3"), default="v3")
    parser.add_argument("--interval", type=float, default=0.1, help="sleep between steps")
    parser.add_argument("--timeout", type=float, default=30.0, help="process group timeout")
    parser.add_argument("--heartbeat-timeout", type=float, default=15.0)
    parser.add_argument("--max-seconds", type=float, default=900.0)
    args = parser.parse_args(argv)
    if args.store == "etcd" and not (args.endpoint and args.run_id):
        parser.error("--store etcd needs --endpoint and --run-id")
    if not 0 <= args.rank < args.world:
        parser.error(f"--rank {args.rank}: must be in 0..{args.world - 1} (--world)")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    harness_pid = os.getppid()
    pid = os.getpid()
    started = time.monotonic()
    threading.Thread(
        target=_watch_parent,
        args=(harness_pid, started, args.max_seconds),
        name="watch-harness",
        daemon=True,
    ).start()
    os.environ.update(
        RANK=str(args.rank),
        WORLD_SIZE=str(args.world),
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(args.master_port),
    )
    out = (args.out_dir / f"w-{pid}.jsonl").open("a", buffering=1)
    out.write(f"[{started:.6f},0,-1,0,{pid},{pid},0]\n")

    import torch
    import torch.distributed as dist
    from nvidia_resiliency_ext import inprocess

    def pg_store(call_wrapper: Any) -> Any:
        if args.store == "etcd":
            from etcd_rdzv.inprocess.nvrx import pg_store

            return pg_store(call_wrapper)
        return dist.TCPStore(  # type: ignore[attr-defined]  # torch: not re-exported in stubs
            host_name="127.0.0.1",
            port=args.master_port + 2 + call_wrapper.iteration,
            world_size=int(os.environ["WORLD_SIZE"]),
            is_master=int(os.environ["RANK"]) == 0,
            multi_tenant=True,
            wait_for_workers=True,
            use_libuv=True,
        )

    def train(call_wrapper: inprocess.CallWrapper | None = None) -> None:
        assert call_wrapper is not None
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(
            "gloo",
            store=pg_store(call_wrapper),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=args.timeout),
        )
        token = torch.tensor([float(random.randrange(1 << 20))], dtype=torch.float64)
        dist.all_reduce(token)
        group = int(token.item())
        while True:
            tensor = torch.full((1024,), float(rank + 1))
            dist.all_reduce(tensor)
            if tensor[0].item() != world_size * (world_size + 1) / 2:
                raise RuntimeError(f"rank {rank}: wrong sum {tensor[0].item()}")
            now = time.monotonic()
            it = call_wrapper.iteration
            out.write(f"[{now:.6f},{world_size},{rank},{it},{pid},{pid},{group}]\n")
            time.sleep(args.interval)

    if args.store == "etcd":
        from etcd_rdzv.inprocess.nvrx import EtcdWrapperStore

        factory: Any = EtcdWrapperStore
        kwargs: dict[str, Any] = {
            "endpoint": args.endpoint,
            "run_id": args.run_id,
            "job": args.run_id,
            "api": args.api,
        }
    else:
        factory, kwargs = inprocess.store.TCPStore, {"port": args.master_port + 1}
    seconds = datetime.timedelta
    wrapped = inprocess.Wrapper(
        store_factory=factory,
        store_kwargs=kwargs,
        health_check=None,
        monitor_thread_interval=seconds(seconds=0.5),
        monitor_process_interval=seconds(seconds=0.5),
        progress_watchdog_interval=seconds(seconds=0.5),
        heartbeat_interval=seconds(seconds=1),
        heartbeat_timeout=seconds(seconds=args.heartbeat_timeout),
        soft_timeout=seconds(seconds=20),
        hard_timeout=seconds(seconds=25),
        barrier_timeout=seconds(seconds=30),
        completion_timeout=seconds(seconds=30),
        last_call_wait=seconds(seconds=0.3),
        termination_grace_time=seconds(seconds=2),
        monitor_process_logfile=str(args.out_dir / "monitor-{rank}.log"),
    )(train)
    wrapped()
    return 0


if __name__ == "__main__":
    import logging

    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "error")
    logging.basicConfig(
        level=os.environ.get("LOGLEVEL", "INFO"),
        format="%(asctime)s %(process)d %(name)s %(levelname)s: %(message)s",
    )
    sys.exit(main(sys.argv[1:]))
