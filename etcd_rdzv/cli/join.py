"""``etcd-rdzv join``: join a run's rendezvous, print the result, leave.

Also the steps the demo's nodes share with it: :func:`rendezvous` and :func:`barrier`.
"""

from __future__ import annotations

import argparse
import shlex
import time
from datetime import timedelta

from ..errors import RendezvousError
from ..rendezvous import EtcdRendezvousHandler, Listener, RendezvousResult
from ._common import EXIT_OK, Out, handler, one_line, parameters

__all__ = ["barrier", "cmd_join", "export_lines", "rendezvous"]

# How long `join` waits for its peers to have read the round before it leaves (a
# member that leaves deletes its join key, which holds its address).
_JOIN_BARRIER = timedelta(seconds=30)


def export_lines(
    run_id: str, result: RendezvousResult, master_port: int | None = None
) -> list[str]:
    """``export NAME=value`` lines (shell-quoted) describing ``result``."""
    values = {
        "RANK": str(result.rank),
        "WORLD_SIZE": str(result.world_size),
        "MASTER_ADDR": result.addrs[0] if result.addrs else "",
    }
    if master_port is not None:
        values["MASTER_PORT"] = str(master_port)
    values["ETCD_RDZV_ROUND"] = str(result.round)
    values["ETCD_RDZV_RUN_ID"] = run_id
    values["ETCD_RDZV_PEERS"] = ",".join(result.addrs)
    return [f"export {name}={shlex.quote(value)}" for name, value in values.items()]


def rendezvous(rdzv: EtcdRendezvousHandler) -> RendezvousResult:
    """The next round of ``rdzv`` as etcd_rdzv's own result, whatever its flavour."""
    # The base method on purpose: torch's flavour returns torch's RendezvousInfo, which
    # has neither the round nor the peers' addresses.
    result: RendezvousResult = EtcdRendezvousHandler.next_rendezvous(rdzv)
    return result


def barrier(result: RendezvousResult, name: str, out: Out) -> None:
    """Wait until every member of the round got past its rendezvous.

    A member that leaves deletes its join key, and with it the address its peers read
    right after the round completes; without this, a fast member could leave before a
    slow one read its address. A member that does not confirm within 30 s is warned
    about, not an error.
    """
    store = result.store
    store.set(f"etcd-rdzv-cli/{name}/{result.rank}", "1")
    try:
        store.wait([f"etcd-rdzv-cli/{name}/{r}" for r in range(result.world_size)], _JOIN_BARRIER)
    except RendezvousError as exc:
        out.warning(f"not every member confirmed the round: {one_line(exc)}")


class _Progress(Listener):
    """Prints what the join waits for, every few seconds and when it changes."""

    def __init__(self, out: Out) -> None:
        self._out = out

    def on_progress(self, text: str) -> None:
        self._out.progress(text)


def cmd_join(args: argparse.Namespace, out: Out) -> int:
    """Join ``--run-id``, wait for the round, print it (``--export``: shell lines), leave."""
    params, settings = parameters(
        args,
        min_nodes=args.min_nodes,
        max_nodes=args.max_nodes or args.min_nodes,
        local_addr=args.local_addr,
    )
    rdzv = handler(settings)
    # What the join waits for, every few seconds and when it changes, on stderr.
    rdzv.add_listener(_Progress(out))
    h = settings.handler
    shape = (
        f"static rank {h.rank} of {h.max_nodes}"
        if h.rank is not None
        else f"min {h.min_nodes}, max {h.max_nodes} nodes"
    )
    out.progress(
        f"joining run {settings.run_id!r} as node {rdzv.node_id} at {params.endpoint} ({shape})"
    )
    started = time.monotonic()
    try:
        result = rendezvous(rdzv)
        barrier(result, "join", out)
    finally:
        rdzv.shutdown()
    out.progress(
        f"round {result.round} complete in {time.monotonic() - started:.2f}s: rank "
        f"{result.rank} of {result.world_size}; left the run"
    )
    if args.export:
        for line in export_lines(settings.run_id, result, args.master_port):
            out.result(line)
    else:
        out.result(f"rank: {result.rank}")
        out.result(f"world size: {result.world_size}")
        out.result(f"round: {result.round}")
        out.result(f"peers: {' '.join(a or '?' for a in result.addrs)}")
        out.result(f"nodes: {' '.join(result.members)}")
    return EXIT_OK
