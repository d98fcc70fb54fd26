"""Deleting a run: every key of it, so that its id can be used again, checked first
for live nodes (``etcd-rdzv delete``; :func:`delete_run`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .. import _keys
from .._commands import delete_command
from .._kv import KV, Record, WatchCompacted
from ..config._options import option
from ..errors import RendezvousError, RendezvousStateError
from ..rendezvous import records

__all__ = ["DEFAULT_NODE_TTL", "DYNAMIC_KEEP_ALIVE", "DeletedRun", "RunInUseError", "delete_run"]


#: torch's default keep-alive interval (seconds), which ``etcd-rdzv-dynamic`` runs use
#: unless the job sets ``keep_alive_interval``.
DYNAMIC_KEEP_ALIVE = 5.0

#: The TTL of a native node's keys with the options' defaults (seconds): how long a
#: killed node's join key outlives it unless its job set other keep-alive options.
DEFAULT_NODE_TTL: int = (
    option("keep_alive_interval").default * option("keep_alive_max_attempt").default
)


class RunInUseError(RendezvousError):
    """:func:`delete_run` refused: the run has live nodes (the message names them)."""


@dataclass(frozen=True)
class DeletedRun:
    """What :func:`delete_run` removed."""

    run_id: str
    directory: str  # the run's directory, ``<key_prefix>/<run>``
    keys: int  # keys found under it (0: there was nothing to delete)


def _live_nodes(found: Sequence[Record], rdzv: str) -> list[str]:
    """The native handler's live join keys that belong to a running or forming
    group: those in the latest completed round and in any later round (every round,
    when none completed). Keys that do not parse count too, named by their key."""
    completed = 0
    for record in found:
        where = _keys.round_of(rdzv, record.key)
        if where is not None and where[1] == "result" and where[0] > completed:
            try:
                if records.parse_result(record).error is None:
                    completed = where[0]
            except RendezvousStateError:
                pass  # not a result: it completes nothing
    return [
        f"{records.named(node, key)} (round {n}, {'member' if n == completed else 'joining'})"
        for n, node, key in records.join_keys(found, rdzv)
        if n >= completed
    ]


def _state_written(kv: KV, key: str, window: float) -> bool:
    """Whether ``key`` (a run's ``state``) is written within ``window`` seconds.

    torch's dynamic handler writes the state on every keep-alive of every live node,
    so a quiet window means nobody is there. Waits on a watch, never on polling.
    """
    record, revision = kv.get(key)
    if record is None:
        return False
    try:
        event = kv.watch(key, revision + 1, window)
    except WatchCompacted:  # history gone already: compare with a fresh read
        again, _ = kv.get(key)
        return again is not None and again.revision != record.revision
    return event is not None and event.kind == "put"


def delete_run(
    kv: KV,
    key_prefix: str,
    run_id: str,
    *,
    force: bool = False,
    keep_alive_interval: float = DYNAMIC_KEEP_ALIVE,
    on_wait: Callable[[str], None] | None = None,
) -> DeletedRun:
    """Delete every key of ``run_id`` (its whole directory), so the id can be used again.

    Unless ``force``, it first makes sure no node is alive in the run:

    * the native handler (``rdzv/``): no join key exists in the latest completed round
      or in a later (forming) round. A node that was killed keeps its key until the
      key's TTL runs out (``keep_alive_interval x keep_alive_max_attempt``,
      :data:`DEFAULT_NODE_TTL` seconds by default);
    * ``etcd-rdzv-dynamic`` (torch's handler; its ``state`` key): the state is not
      written for ``2 x keep_alive_interval + 1`` seconds (torch writes it on each
      node's keep-alive, every ``keep_alive_interval``; a beat may skip one period).
      This waits for that long on a watch of the key; ``on_wait`` is told so first.

    The checks and the delete are separate requests: a node that joins in between
    loses its keys (close the run first so that none does). The delete itself is one
    request: on v3 every key under the directory, on v2 the directory with everything
    in it (empty directories included). It touches only the keyspace of ``kv``'s API.

    Returns:
        What was deleted (``keys == 0``: the run had no keys in this keyspace).

    Raises:
        RunInUseError: ``force`` is off and the run has live nodes (named).
        RendezvousConnectionError: etcd could not be reached.
    """
    directory = _keys.run_dir(key_prefix, run_id)
    found, _ = kv.list_tree(directory)
    found = [r for r in found if r.key.startswith(directory + "/")]
    if not force and found:
        live = _live_nodes(found, _keys.rdzv_dir(key_prefix, run_id))
        if live:
            shown = ", ".join(live[:10]) + (f" and {len(live) - 10} more" if len(live) > 10 else "")
            raise RunInUseError(
                f"Run {run_id!r} has {len(live)} live node(s): {shown}. Deleting its keys "
                "would make them re-join. Stop them first (a killed node's key expires "
                "within its TTL, keep_alive_interval x keep_alive_max_attempt: "
                f"{DEFAULT_NODE_TTL} s by default), or force it "
                f"({delete_command(run_id, key_prefix, kv.api, force=True)})."
            )
        state = _keys.state_key(key_prefix, run_id)
        if any(r.key == state for r in found):
            window = 2 * keep_alive_interval + 1
            if on_wait is not None:
                on_wait(
                    f"run {run_id!r} has torch's rendezvous state (etcd-rdzv-dynamic): "
                    f"waiting {window:g}s for a keep-alive of a live node"
                )
            if _state_written(kv, state, window):
                raise RunInUseError(
                    f"Run {run_id!r} is in use: its rendezvous state ({state}) was written "
                    f"within {window:g}s, so nodes of etcd-rdzv-dynamic are alive. Stop them "
                    "first, or force it "
                    f"({delete_command(run_id, key_prefix, kv.api, force=True)})."
                )
    # Even with no keys: on v2, empty directories of the run may be left (they have
    # no TTL), and they go with it.
    kv.delete_prefix(directory)
    return DeletedRun(run_id, directory, len(found))
