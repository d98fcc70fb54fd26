"""The ``train.py`` of the deployment guides' tests (test_deploy_*.py).

Joins the default process group from torchrun's environment, sums ``rank + 1`` over
all workers with gloo, and writes what the worker saw of its launcher (the run id,
``MASTER_ADDR``, the restarts it was given) to ``<out_dir>/rank<RANK>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

#: The variables of torchrun's that the guides' settings end up in.
SEEN = (
    "RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RESTART_COUNT",
)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: _deploy_job.py OUT_DIR", file=sys.stderr)
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

    result = {"rank": rank, "world_size": world_size, "value": tensor.item()}
    result.update({name: os.environ.get(name) for name in SEEN})
    tmp = out_dir / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.replace(out_dir / f"rank{rank}.json")  # atomic: never a half-written result
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
