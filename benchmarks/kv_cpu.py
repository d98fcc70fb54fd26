"""Client CPU per KV read and per KV write, one tree of this package against another.

``python3 -m benchmarks.kv_cpu --api v2 /path/to/base/etcd_rdzv /path/to/ours/etcd_rdzv``
starts one etcd member (``--enable-v2``), imports each given copy of the package under
a name of its own (every module of its client path imports its siblings relatively),
and times ``get`` and ``put`` of one key through ``create_client`` with
``time.process_time``: blocks of ``--block`` requests, each tree in turn, the order
rotated every round. Other load on the machine then falls on every tree alike, which
separate processes run one after the other do not give on a shared machine. It prints
the mean and median microseconds per request and each tree's ratio to the first.

A copy of an old commit: ``git archive <commit> etcd_rdzv | tar -x -C /tmp/old``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from etcd_rdzv.testing import EtcdServer

VALUE = "v" * 40


def _load(tree: str, name: str) -> Any:
    """The package at ``tree`` (a directory named like ``etcd_rdzv``), as ``name``."""
    links = tempfile.mkdtemp(prefix="kv-cpu-")
    os.symlink(os.path.abspath(tree), os.path.join(links, name))
    sys.path.insert(0, links)
    return importlib.import_module(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", help="directories of etcd_rdzv packages")
    parser.add_argument("--api", default="v2", choices=("v2", "v3"))
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--block", type=int, default=200, help="requests per sample")
    args = parser.parse_args()
    with EtcdServer(enable_v2=True) as etcd:
        kvs = []
        for i, tree in enumerate(args.trees):
            pkg = _load(tree, f"kv_cpu_tree{i}")
            kv = pkg.create_client(
                pkg.RendezvousParameters("etcd-rdzv", etcd.endpoint, "kv-cpu", 1, 1, api=args.api)
            )
            key = f"/kv-cpu/{args.api}/{i}"
            for _ in range(300):  # warm up: connections, caches
                kv.put(key, VALUE, None)
                kv.get(key)
            kvs.append((kv, key))
        reads: list[list[float]] = [[] for _ in kvs]
        writes: list[list[float]] = [[] for _ in kvs]
        clock = time.process_time
        for r in range(args.rounds):
            order = [(i + r) % len(kvs) for i in range(len(kvs))]
            for i in order if r % 2 == 0 else order[::-1]:
                kv, key = kvs[i]
                start = clock()
                for _ in range(args.block):
                    kv.get(key)
                middle = clock()
                for _ in range(args.block):
                    kv.put(key, VALUE, None)
                end = clock()
                reads[i].append((middle - start) / args.block * 1e6)
                writes[i].append((end - middle) / args.block * 1e6)
        for kv, _ in kvs:
            kv.close()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"api {args.api}, {args.rounds * args.block} reads and writes per tree; load {load}")
    for i, tree in enumerate(args.trees):
        line = f"{tree}: read {statistics.fmean(reads[i]):.1f} us (median "
        line += f"{statistics.median(reads[i]):.1f}), write {statistics.fmean(writes[i]):.1f}"
        line += f" us (median {statistics.median(writes[i]):.1f})"
        if i:
            read_ratio = statistics.fmean(reads[i]) / statistics.fmean(reads[0])
            write_ratio = statistics.fmean(writes[i]) / statistics.fmean(writes[0])
            line += f"; to the first: read {read_ratio:.3f}, write {write_ratio:.3f}"
        print(line)


if __name__ == "__main__":
    main()
