"""A round's completion and a node's withdrawal, ordered without transactions (v2).

The rendezvous needs one order between two writes: a coordinator creating a round's
result from its picture of the round at revision ``as_of``, and a node that gives up
(its join timed out) leaving the round. Either the node leaves before the picture
the result is made from (and is not a member), or the result comes first (and the
node, finding it, is a member and returns its rank); never a result that counts a
node that left after the picture.

v3 says so in one transaction each (:meth:`V3KV.withdraw
<etcd_rdzv._kv.v3.kv.V3KV.withdraw>`). Without transactions, this module orders
them through a *seal*, a key next to the result that a coordinator creates (create
if absent) before its result:

- A node that gives up first writes its *gone* marker (index ``G``), then reads the
  seal and then the result, both as the cluster's leader has them (quorum reads).
  A result found: the node takes it (a member if the result names it). No seal, or a
  seal created after ``G``: the coordinator of that seal lists the gone markers after
  sealing and sees this one, so its result cannot count the node; the node deletes
  its join key and is out. A seal created before ``G``: its coordinator may have
  listed the markers before this one; the node waits for the result (and takes it)
  or for the seal to go, up to ``wait`` seconds.
- A coordinator creates the seal (refused: another coordinator's seal stands, the
  caller decides again later), lists the gone markers (quorum), and if one was
  written after ``as_of`` deletes its seal and reports the refusal; else it creates
  the result and leaves the seal to expire with its TTL.

The coordinator's picture leaves out the nodes whose gone marker it holds
(:class:`~etcd_rdzv.rendezvous.watch.RoundView`), so a marker written at or before
``as_of`` is in it.
"""

from __future__ import annotations

import contextlib
import time

from .._base import KV, WatchCompacted
from .._records import Record

__all__ = ["create_unless_gone", "seal_key", "withdraw"]

_LOOK = 0.5  # seconds between two looks of a node waiting for a sealed round's result


def seal_key(result_key: str) -> str:
    """The seal of the result ``result_key``: beside it, in the round's directory."""
    return result_key + "-seal"


def withdraw(
    kv: KV, key: str, result_key: str, gone_key: str, gone_value: str, ttl: int, wait: float
) -> tuple[bool, Record | None]:
    """The node of ``key`` leaves its round unless the round's result is (or is
    about to be) made from a picture holding it. See :meth:`KV.withdraw
    <etcd_rdzv._kv.KV.withdraw>`."""
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


def create_unless_gone(
    kv: KV, key: str, value: str, ttl: int, gone_dir: str, as_of: int, seal_ttl: int
) -> tuple[Record | None, Record | None]:
    """Create the result ``key`` unless it exists or a gone marker under ``gone_dir``
    is newer than ``as_of``. See :meth:`KV.create_unless_gone
    <etcd_rdzv._kv.KV.create_unless_gone>`."""
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
