"""The training script torchrun starts in test_torchrun.py (one worker per agent).

Joins the default process group from torchrun's environment (``env://``), sums
``rank + 1`` over all workers with gloo, and writes what it saw to
``<out_dir>/rank<RANK>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: _allreduce_job.py OUT_DIR", file=sys.stderr)
        return 2
    out_dir = Path(argv[0])

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    tensor = torch.tensor([rank + 1.0])
    dist.all_reduce(tensor)
    dist.barrier()
    dist.destroy_process_group()

    result = {
        "rank": rank,
        "world_size": world_size,
        "value": tensor.item(),
        "env_rank": os.environ.get("RANK"),
        "group_rank": os.environ.get("GROUP_RANK"),
        "given_rank": os.environ.get("ETCD_RDZV_TEST_GIVEN_RANK"),
        "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
        "restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
    }
    tmp = out_dir / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.replace(out_dir / f"rank{rank}.json")  # atomic: never a half-written result
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
