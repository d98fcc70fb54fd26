"""The loop of :func:`run`: join a round, call the training function, and after a
failure tear the round down and call it again in the next round, in this process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar, cast

from ..config.params import ParamsLike, Settings
from ..rendezvous import EtcdRendezvousHandler
from .round import DEFAULT_PG_TIMEOUT, Regroup, Round, RoundBroken, etcd_addresses

if TYPE_CHECKING:
    from ..rendezvous import RendezvousResult
    from ..torch import TorchEtcdStore

__all__ = ["DEFAULT_MAX_FAILURES", "TooManyFailures", "run"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Failures of this process's own (a peer's never count) before :func:`run` gives up.
DEFAULT_MAX_FAILURES = 3


class TooManyFailures(RuntimeError):
    """The training function failed more often than ``max_failures`` in rounds that
    were intact when it raised; raised from its last exception."""


def _check(name: str, value: float, minimum: float, integer: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"run(): {name} must be {kind}, got {value!r}.")
    if not value >= minimum:  # NaN too
        raise ValueError(f"run(): {name} must be at least {minimum}, got {value!r}.")


def run(
    fn: Callable[[Round], T],
    params: ParamsLike,
    *,
    pg_timeout: float = DEFAULT_PG_TIMEOUT,
    max_failures: int = DEFAULT_MAX_FAILURES,
    guard: bool = True,
) -> T:
    """Run ``fn`` in rounds of the rendezvous ``params`` (ours or torch's
    ``RendezvousParameters``) until it returns, and return its value.

    Each call gets a :class:`Round` (rank, world size, the round's store; it builds
    the process group with :meth:`Round.init_process_group`). When ``fn`` raises an
    ``Exception`` (a collective failed because a peer died, froze or failed, or its
    own error), the round is torn down (its connections cut, every process group
    destroyed), this process joins the next round and ``fn`` is called again with
    the new rank and world size (:meth:`Round.check` raising ``Regroup`` at a step
    boundary takes nodes that wait to join in this way). When it returns, this node
    leaves and closes the run (a spare still waiting then ends with
    ``RendezvousGracefulExitError``).
    A node that gives up (any exception out of :func:`run`) leaves without closing
    the run: the others go on without it.

    Args:
        pg_timeout: seconds a collective of the round's group may block (> 0).
        max_failures: how many times ``fn`` may fail in a round that was intact
            (no member gone, no connection closed by a peer) before :func:`run`
            gives up (>= 0).
        guard: cut the group's connections as soon as the round breaks (a frozen
            peer then costs its lease's TTL, not ``pg_timeout``).

    Raises:
        ValueError: a bad option.
        TooManyFailures: ``fn`` failed more than ``max_failures`` times itself.
        RendezvousError: the rendezvous failed (the run closed, a join timed out);
            ``RendezvousGracefulExitError`` for a spare not needed before the end.
        KeyboardInterrupt, SystemExit: as raised, after the round was torn down and
            this node left.
    """
    _check("pg_timeout", pg_timeout, 0.001)
    _check("max_failures", max_failures, 0, integer=True)
    settings = Settings.from_params(params)
    from .. import torch as torch_integration

    etcd = etcd_addresses((e.host, e.port) for e in settings.client.endpoints)
    handler = EtcdRendezvousHandler.from_settings(settings, torch_integration.TorchEtcdStore)
    failures = 0
    call = 0
    try:
        while True:
            joined: RendezvousResult = handler.next_rendezvous()
            # from_settings(..., TorchEtcdStore) makes every round's store one.
            store = cast("TorchEtcdStore", joined.store)
            rnd = Round(
                handler,
                rank=joined.rank,
                world_size=joined.world_size,
                round_no=joined.round,
                call=call,
                failures=failures,
                store=store,
                members=joined.members,
                pg_timeout=float(pg_timeout),
                etcd=etcd,
                guard=guard,
            )
            call += 1
            try:
                result = fn(rnd)
            except Exception as exc:
                # Not this process's fault: the round broke or others want in (check()
                # said so), a peer closed a connection, or a member is gone by now.
                peer = (
                    isinstance(exc, (RoundBroken, Regroup))
                    or rnd.guard_fired
                    or rnd.closed_by_peer()
                    or rnd.broken
                )
                rnd.teardown()
                if not peer:
                    failures += 1
                if isinstance(exc, Regroup):
                    why, level = "nodes wait to join", logging.INFO
                elif peer:
                    why, level = "a peer failed or left", logging.WARNING
                else:
                    why = f"failure {failures} of this node (max_failures={max_failures})"
                    level = logging.WARNING
                log.log(
                    level,
                    "run %s: round %d (rank %d of %d) ended (%s: %s): %s",
                    settings.run_id,
                    rnd.round,
                    rnd.rank,
                    rnd.world_size,
                    type(exc).__name__,
                    exc,
                    why,
                )
                if failures > max_failures:
                    raise TooManyFailures(
                        f"run {settings.run_id}: the training function failed {failures} "
                        f"times in intact rounds (max_failures={max_failures}); last: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                del rnd, joined, store
                continue
            except BaseException:
                rnd.teardown()
                raise
            rnd.teardown()
            # The job is done: late nodes and spares get a closed run, not a new one.
            handler.close_on_shutdown = True
            return result
    finally:
        handler.shutdown()
