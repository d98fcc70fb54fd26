"""One rank of an NVRx in-process job (tests/torch/test_nvrx.py), as NVRx's basic
example starts its ranks: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set.

``NVRX_STORE`` chooses both stores: ``tcp`` (NVRx's default TCPStore on
``MASTER_PORT + 1`` for the Wrapper, and, as its example, a TCPStore of rank 0 on
``MASTER_PORT + 2 + iteration`` for the process group: rank 0 hosts both) or ``etcd``
(:class:`etcd_rdzv.inprocess.nvrx.EtcdWrapperStore` and ``pg_store``; the etcd
endpoint, run and job from ``ETCD_RDZV_ENDPOINT``, ``ETCD_RDZV_RUN_ID``,
``NVRX_KEY_PREFIX`` and ``NVRX_JOB``).

``NVRX_HEARTBEAT_TIMEOUT`` sets NVRx's ``heartbeat_timeout`` (default 15 s).

Each completed step is one line on stdout, ``STEP <json>`` (the Wrapper's iteration,
rank, world size, step, ``time.monotonic()``: one clock for all processes on Linux).
In the first iteration the function steps until the test kills a rank (at most
``NVRX_MAX_STEPS``); ``NVRX_RAISE_AT=<rank>:<step>`` makes that rank raise there in
iteration 0. Any later call steps ``NVRX_STEPS_AFTER`` times and returns: the Wrapper then completes
and the process exits 0 with ``DONE <json>``.
"""

# No ``from __future__ import annotations``: NVRx finds the CallWrapper parameter by
# its annotation (``CallWrapper | None``: issubclass), which a string is not.
import datetime
import faulthandler
import json
import logging
import os
import signal
import sys
import time
from typing import Any

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "error")

import torch
import torch.distributed as dist
from nvidia_resiliency_ext import inprocess

STORE = os.environ["NVRX_STORE"]
FULL_WORLD = int(os.environ["WORLD_SIZE"])
MAX_STEPS = int(os.environ.get("NVRX_MAX_STEPS", "600"))
STEPS_AFTER = int(os.environ.get("NVRX_STEPS_AFTER", "5"))
STEP_SLEEP = 0.1
RAISE_AT = os.environ.get("NVRX_RAISE_AT", "")


def emit(kind: str, **fields: Any) -> None:
    print(f"{kind} {json.dumps(fields)}", flush=True)


def process_group_store(call_wrapper: Any) -> Any:
    if STORE == "etcd":
        from etcd_rdzv.inprocess.nvrx import pg_store

        return pg_store(call_wrapper)
    return dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]) + 2 + call_wrapper.iteration,
        world_size=int(os.environ["WORLD_SIZE"]),
        is_master=int(os.environ["RANK"]) == 0,
        multi_tenant=True,
        wait_for_workers=True,
        use_libuv=True,
    )


def train(call_wrapper: inprocess.CallWrapper | None = None) -> int:
    assert call_wrapper is not None
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    iteration = call_wrapper.iteration
    emit("CALL", iteration=iteration, rank=rank, world=world, pid=os.getpid(), t=time.monotonic())
    dist.init_process_group(
        "gloo",
        store=process_group_store(call_wrapper),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=10),
    )
    raise_rank, _, raise_step = RAISE_AT.partition(":")
    steps = MAX_STEPS if iteration == 0 else STEPS_AFTER
    for step in range(steps):
        if iteration == 0 and raise_rank and rank == int(raise_rank) and step == int(raise_step):
            emit("RAISE", step=step, t=time.monotonic())
            raise RuntimeError(f"injected fault at step {step} on rank {rank}")
        value = torch.ones(1)
        dist.all_reduce(value)
        assert int(value.item()) == world, (value, world)
        emit("STEP", iteration=iteration, rank=rank, world=world, step=step, t=time.monotonic())
        time.sleep(STEP_SLEEP)
    return world


def wrapper_store() -> tuple[Any, dict[str, Any]]:
    if STORE == "etcd":
        from etcd_rdzv.inprocess.nvrx import EtcdWrapperStore

        return EtcdWrapperStore, {
            "job": os.environ["NVRX_JOB"],
            "key_prefix": os.environ["NVRX_KEY_PREFIX"],
        }
    return inprocess.store.TCPStore, {"port": int(os.environ["MASTER_PORT"]) + 1}


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # the test dumps a stuck rank's stacks
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
    )
    factory, kwargs = wrapper_store()
    seconds = datetime.timedelta
    wrapped = inprocess.Wrapper(
        store_factory=factory,
        store_kwargs=kwargs,
        health_check=None,
        monitor_thread_interval=seconds(seconds=0.5),
        monitor_process_interval=seconds(seconds=0.5),
        progress_watchdog_interval=seconds(seconds=0.5),
        heartbeat_interval=seconds(seconds=1),
        heartbeat_timeout=seconds(seconds=float(os.environ.get("NVRX_HEARTBEAT_TIMEOUT", "15"))),
        soft_timeout=seconds(seconds=20),
        hard_timeout=seconds(seconds=25),
        barrier_timeout=seconds(seconds=30),
        completion_timeout=seconds(seconds=30),
        last_call_wait=seconds(seconds=0.3),
        termination_grace_time=seconds(seconds=2),
        monitor_process_logfile=os.path.join(os.environ["NVRX_OUT"], "monitor-{rank}.log"),
    )(train)
    result = wrapped()
    emit("DONE", world=result, pid=os.getpid())


if __name__ == "__main__":
    main()
