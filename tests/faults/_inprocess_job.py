"""A training process of tests/faults/test_inprocess.py: ``run(train, params)``.

Configured by ``JOB_CONFIG`` (JSON: endpoint, run_id, min_nodes, max_nodes, options
(every other rendezvous option), steps, sleep, raise_rank, raise_step, pg_timeout,
guard). Each completed step appends one JSON line to ``JOB_OUT``: pid, call, rank,
world size, round, step, the failures so far, the wall time (the test compares it
with the time of its kill, on the same host), and at step 0 the members.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from etcd_rdzv import RendezvousGracefulExitError, RendezvousParameters
from etcd_rdzv.inprocess import Round, run


def main() -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(process)d %(name)s %(levelname)s: %(message)s"
    )
    cfg = json.loads(os.environ["JOB_CONFIG"])
    out = os.environ["JOB_OUT"]
    params = RendezvousParameters(
        "etcd-rdzv",
        cfg["endpoint"],
        cfg["run_id"],
        cfg["min_nodes"],
        cfg["max_nodes"],
        **cfg["options"],
    )
    raised: list[int] = []

    def train(rnd: Round) -> int:
        rnd.init_process_group("gloo")
        total = 0
        for step in range(cfg["steps"]):
            t = torch.ones(4)
            dist.all_reduce(t)
            assert int(t[0]) == rnd.world_size, (t, rnd)
            total += int(t[0])
            with open(out, "a") as f:
                line = {
                    "pid": os.getpid(),
                    "call": rnd.call,
                    "rank": rnd.rank,
                    "world": rnd.world_size,
                    "round": rnd.round,
                    "step": step,
                    "failures": rnd.failures,
                    "t": time.time(),
                }
                if step == 0:  # for the history checker
                    line["members"] = list(rnd.members)
                f.write(json.dumps(line) + "\n")
            if (rnd.rank, step) == (cfg.get("raise_rank"), cfg.get("raise_step")) and not raised:
                raised.append(step)
                raise ValueError("the training function's own error")
            rnd.check()
            time.sleep(cfg["sleep"])
        return total

    try:
        run(train, params, pg_timeout=cfg["pg_timeout"], guard=cfg["guard"])
    except RendezvousGracefulExitError:  # a spare the job did not need
        print("not needed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
