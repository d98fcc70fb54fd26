"""The training script of test_torchrun_job_end.py: workers that finish apart.

Each worker joins the process group (gloo, from torchrun's environment), sums its
rank over all workers, records that it started, then works ``ETCD_RDZV_TEST_DRIFT``
seconds (its agent's environment says how long) and only then writes
``<out_dir>/done-rank<RANK>.json``: a worker stopped before its end writes nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path


def _write(path: Path, record: dict[str, object]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)  # atomic: never a half-written record


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: _drift_job.py OUT_DIR", file=sys.stderr)
        return 2
    out_dir = Path(argv[0])

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    tensor = torch.tensor([float(rank)])
    dist.all_reduce(tensor)
    dist.destroy_process_group()
    _write(out_dir / f"start-rank{rank}-pid{os.getpid()}.json", {"rank": rank})

    drift = float(os.environ.get("ETCD_RDZV_TEST_DRIFT", "0"))
    time.sleep(drift)  # the work that takes longer on this node
    record = {
        "rank": rank,
        "world_size": world_size,
        "sum": tensor.item(),
        "drift": drift,
        "pid": os.getpid(),
        "restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
    }
    _write(out_dir / f"done-rank{rank}.json", record)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
