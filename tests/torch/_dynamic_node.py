"""One node of the multi-process DynamicRendezvousHandler test (run as a script).

Creates its own backend and store with ``etcd_rdzv.create_backend``, joins torch's
``DynamicRendezvousHandler`` built with ``from_backend``, then runs a gloo
``all_reduce`` over the store the rendezvous returned. After each stage it prints one
line ``RESULT <json>`` to stdout so the test can tell how far every node got.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta
from typing import Any

RESULT_MARK = "RESULT "


def emit(stage: str, **fields: Any) -> None:
    print(RESULT_MARK + json.dumps({"stage": stage, **fields}), flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--key-prefix", required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--join-timeout", type=int, default=60)
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    import etcd_rdzv

    params = etcd_rdzv.RendezvousParameters(
        "etcd-rdzv-dynamic",
        args.endpoint,
        args.run_id,
        args.nodes,
        args.nodes,
        key_prefix=args.key_prefix,
        read_timeout=10,
    )
    backend, store = etcd_rdzv.create_backend(params)
    emit(
        "created",
        store_type=type(store).__module__ + "." + type(store).__qualname__,
        store_is_torch_store=isinstance(store, dist.Store),
        backend_name=backend.name,
    )

    handler = DynamicRendezvousHandler.from_backend(
        args.run_id,
        store,
        backend,
        min_nodes=args.nodes,
        max_nodes=args.nodes,
        timeout=RendezvousTimeout(
            join=timedelta(seconds=args.join_timeout), last_call=timedelta(seconds=1)
        ),
    )
    info = handler.next_rendezvous()
    bootstrap = info.bootstrap_store_info
    emit(
        "rendezvous",
        rank=info.rank,
        world_size=info.world_size,
        backend=handler.get_backend(),
        rdzv_store_is_prefix_store=isinstance(info.store, dist.PrefixStore),
        rdzv_store_wraps_ours=isinstance(info.store, dist.PrefixStore)
        and info.store.underlying_store is store,
        master_port=None if bootstrap is None else bootstrap.master_port,
    )

    dist.init_process_group(
        "gloo",
        store=info.store,
        rank=info.rank,
        world_size=info.world_size,
        timeout=timedelta(seconds=60),
    )
    tensor = torch.tensor([info.rank + 1.0])
    dist.all_reduce(tensor)
    emit("all_reduce", rank=info.rank, value=tensor.item())

    dist.destroy_process_group()
    handler.shutdown()
    emit("done", rank=info.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
