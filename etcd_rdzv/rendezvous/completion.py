"""How a round's result is written, and how a node that gives up leaves its round.

The rendezvous needs one order between two writes: a coordinator creating a round's
result from its picture of the round at revision ``as_of``, and a node that gives up
(its join timed out) leaving the round. Either the node leaves before the picture
the result is made from (and is not a member), or the result comes first (and the
node, finding it, is a member and returns its rank); never a result that counts a
node that left after the picture. The coordinator's picture leaves out the nodes
whose *gone* marker it holds (:class:`~etcd_rdzv.rendezvous.watch.RoundView`), so a
marker written at or before ``as_of`` is in it.

Each API keeps that order as it can:

- **v3** (transactions): one transaction each. A node's withdrawal writes its gone
  marker and deletes its join key if the result is absent (refused, it reads the
  result); a result is created if it is absent and no gone marker was written after
  ``as_of`` (refused, it reads the result).
- **v2** (no transactions): a *seal*, a key next to the result that a coordinator
  creates (create if absent) before its result:

  - A node that gives up first writes its gone marker (index ``G``), then reads the
    seal and then the result, both as the cluster's leader has them (quorum reads).
    A result found: the node takes it (a member if the result names it). No seal, or
    a seal created after ``G``: the coordinator of that seal lists the gone markers
    after sealing and sees this one, so its result cannot count the node; the node
    deletes its join key and is out. A seal created before ``G``: its coordinator
    may have listed the markers before this one; the node waits for the result (and
    takes it) or for the seal to go, up to ``wait`` seconds.
  - A coordinator creates the seal (refused: another coordinator's seal stands, the
    caller decides again later), lists the gone markers (quorum), and if one was
    written after ``as_of`` deletes its seal and reports the refusal; else it creates
    the result and leaves the seal to expire with its TTL.

Every write here may be sent again after a lost answer: a v3 transaction resent
after its first try landed finds its own write (see :meth:`KV.txn
<etcd_rdzv._kv.KV.txn>`); the v2 steps are creates and puts that read back.
"""

from __future__ import annotations

import contextlib
import time

from .._kv import KV, Compare, Delete, Put, Quiet, Record, WatchCompacted

__all__ = ["create_unless_gone", "result_writes", "seal_key", "withdraw"]

_LOOK = 0.5  # seconds between two looks of a v2 node waiting for a sealed round's result


def result_writes(kv: KV) -> int:
    """How many writes (revisions) a successful :func:`create_unless_gone` makes:
    the result, and on v2 its seal first."""
    return 1 if kv.atomic_txn else 2


def seal_key(result_key: str) -> str:
    """The v2 seal of the result ``result_key``: beside it, in the round's directory."""
    return result_key + "-seal"


def withdraw(
    kv: KV, key: str, result_key: str, gone_key: str, gone_value: str, ttl: int, wait: float
) -> tuple[bool, Record | None]:
    """Take a node's join ``key`` out of its round, unless the round's result
    ``result_key`` exists (or, v2, is being made from a picture holding the key).

    Withdrawn, ``gone_key`` holds ``gone_value`` for ``ttl`` seconds and ``key`` is
    deleted: no result that :func:`create_unless_gone` creates later counts the node.
    Not withdrawn, the result is returned and the key stays: the caller reads whether
    the result names it. v2 waits up to ``wait`` seconds for a coordinator that
    sealed the round before the node's marker.

    Returns:
        ``(True, None)`` withdrawn, or ``(False, result)``.

    Raises:
        RendezvousConnectionError: etcd did not answer.
    """
    if kv.atomic_txn:
        done = kv.txn(
            [Compare(result_key, None)], [Put(gone_key, gone_value, ttl=ttl), Delete(key)]
        )
        return (True, None) if done.succeeded else (False, done.compared[0])
    return _withdraw_sealed(kv, key, result_key, gone_key, gone_value, ttl, wait)


def create_unless_gone(
    kv: KV, key: str, value: str, ttl: int, gone_dir: str, as_of: int, seal_ttl: int
) -> tuple[Record | None, Record | None]:
    """Create a round's result ``key`` (for ``ttl`` seconds) unless it exists or a
    node withdrew (:func:`withdraw`: a marker under ``gone_dir``) after revision
    ``as_of``, the revision of the picture the result is made from. v2 seals the
    round first, for ``seal_ttl`` seconds.

    Returns:
        ``(record, None)`` created; ``(None, existing)`` the result existed;
        ``(None, None)`` a node withdrew after ``as_of`` (or, v2, another
        coordinator's seal stands): decide again from a newer picture.

    Raises:
        RendezvousConnectionError: etcd did not answer.
    """
    if kv.atomic_txn:
        done = kv.txn(
            [Compare(key, None), Quiet(gone_dir + "/", as_of)], [Put(key, value, ttl=ttl)]
        )
        return (done.records[0], None) if done.succeeded else (None, done.compared[0])
    return _create_sealed(kv, key, value, ttl, gone_dir, as_of, seal_ttl)


# -- v2: the seal ----------------------------------------------------------------------


def _withdraw_sealed(
    kv: KV, key: str, result_key: str, gone_key: str, gone_value: str, ttl: int, wait: float
) -> tuple[bool, Record | None]:
    mark = kv.put(gone_key, gone_value, ttl)
    seal = seal_key(result_key)
    directory = result_key.rsplit("/", 1)[0]
    until = time.monotonic() + wait
    while True:
        sealed, _ = kv.get_latest(seal)
        result, revision = kv.get_latest(result_key)
        if result is not None:  # no result comes after it: the marker has no use
            kv.delete(gone_key)
            return False, result
        if (
            sealed is None
            or (sealed.created or sealed.revision) > mark.revision
            or time.monotonic() >= until
        ):
            break
        # Sealed before this node's marker: wait for that coordinator's result (or its
        # refusal, which deletes the seal).
        look = max(min(_LOOK, until - time.monotonic()), 0.0)
        with contextlib.suppress(WatchCompacted):
            kv.watch(directory, revision + 1, look, prefix=True)
    kv.delete(key)
    return True, None


def _create_sealed(
    kv: KV, key: str, value: str, ttl: int, gone_dir: str, as_of: int, seal_ttl: int
) -> tuple[Record | None, Record | None]:
    seal = seal_key(key)
    sealed = kv.create(seal, value, seal_ttl)
    if sealed is None:
        held, _ = kv.get_latest(seal)
        if held is None or held.value != value:
            # Another coordinator's seal (a dead one's expires with its TTL), or the
            # seal of a result already made.
            existing, _ = kv.get_latest(key)
            return None, existing
        # Our own, from a try that failed after it (etcd went away): carry on.
    gone, _ = kv.list_latest(gone_dir)
    if any(marker.revision > as_of for marker in gone):
        kv.delete(seal)
        return None, None
    created = kv.create(key, value, ttl)
    if created is not None:
        return created, None
    existing, _ = kv.get_latest(key)
    return None, existing
