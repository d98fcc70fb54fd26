"""The KV layer on etcd's v2 API, through python-etcd.

This package (:mod:`etcd_rdzv._kv.v2`) and :mod:`etcd_rdzv.client` are the only places
that touch python-etcd and urllib3 (the ``v2`` extra installs them);
their exceptions (and the transport's beneath them) become ours here, with the endpoint
and key in the message. python-etcd's requests go over this package's own transport
(:mod:`._pool`), not urllib3.

Failover: one python-etcd client per endpoint, all sharing one connection pool, and
our own rotation between them. python-etcd's built-in reconnection is not used: it
drops every endpoint it failed on for good, asks the cluster for advertised URLs that
may not be reachable from here, and silently re-sends writes whose response was lost.
Here a request that failed before it was sent (connection refused, connect timeout)
moves to the next endpoint; a write whose response was lost is resolved by reading
the key back (see :class:`~etcd_rdzv._kv.KV`). The loop is :mod:`._failover`'s; this
module says how python-etcd's errors are judged.

Directories: v2 creates the directories above a key when the key is written, without
a TTL, and etcd 3.5 cannot give an existing directory one (it refuses to update a
directory's TTL: etcd-io/etcd#13589). So directories are removed when empty instead:
every delete removes the directories it left empty, bottom-up, and
:meth:`V2KV.sweep_empty_dirs` (run by :func:`etcd_rdzv.client.connect`, at most once
an hour per key prefix) removes those that keys leaving by TTL emptied. Only empty
directories are removed (a non-recursive delete, which etcd refuses for a directory
with anything in it), so a key written meanwhile is never lost: a write into a removed
directory creates it again. The key prefix itself is never removed.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import etcd
import urllib3.exceptions as u3exc

from ...errors import RendezvousConnectionError, RendezvousStateError
from .._base import Event, Landed, Record, WatchCompacted
from .._failover import FailoverKV, Failure, Verdict, describe, not_sent
from .._lease import Lease
from .._stall import Stalled
from ._pool import Pool
from ._requests import collect_empty, put_params, read, root_cause, send, transport_error

__all__ = ["V2KV"]

log = logging.getLogger(__name__)

T = TypeVar("T")


_PUT_ACTIONS = frozenset({"set", "create", "update", "compareAndSwap"})
_RAFT_INTERNAL = 300  # v2 errorCode: the proposal timed out (often a leader change)
_INVALID_FORM = 210  # v2 errorCode: the request form could not be parsed

#: The directory under the key prefix whose TTL says that someone swept it lately: its
#: TTL is how often empty directories are swept. ``~`` and 5 characters: never a run's
#: directory (a run id that needs encoding is ``~`` and base64 without padding, never
#: 4k+1 characters long).
SWEEP_MARKER = "~swept"
#: Seconds between two sweeps of one key prefix, whichever client does them.
SWEEP_EVERY = 3600
#: At most this many directories are removed per sweep (the rest the next time).
SWEEP_MAX_DIRS = 1000


def _error_index(exc: Exception) -> int | None:
    """The etcd index a v2 error answer carries (``index``), if it is a plain count."""
    payload = getattr(exc, "payload", None)
    value = payload.get("index") if isinstance(payload, dict) else None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63:
        return value
    return None


class V2KV(FailoverKV):
    """:class:`~etcd_rdzv._kv.KV` on the etcd v2 API.

    Args:
        clients: one python-etcd client per endpoint, preferred first.
        urls: the base URL of each client, for messages.
        read_timeout: seconds one request may take.
        username: for messages about rejected credentials.
        dir_root: the key prefix: directories below it that a delete leaves empty are
            removed (the prefix itself never is); ``None`` removes none.
    """

    api = "v2"

    def __init__(
        self,
        clients: list[Any],
        urls: list[str],
        read_timeout: float,
        pool: Pool,
        username: str | None = None,
        dir_root: str | None = None,
    ) -> None:
        if not clients or len(clients) != len(urls):
            raise ValueError("V2KV needs one client per endpoint URL.")
        super().__init__(urls, read_timeout)
        self._clients = clients
        self._pool = pool
        self._username = username
        self._root = None if dir_root is None else "/" + dir_root.strip("/")

    @property
    def answer_time(self) -> float:
        return self._pool.terms.answer_time

    # -- how python-etcd's errors are judged -------------------------------------------

    def _classify(
        self, exc: Exception, url: str, what: str, key: str, resent: bool
    ) -> Failure | None:
        if isinstance(exc, etcd.EtcdWatchTimedOut):
            return None  # a quiet key: the watch loop asks again
        if isinstance(exc, etcd.EtcdConnectionFailed):
            cause = root_cause(exc)
            if isinstance(cause, Stalled):  # stuck behind a dead leader: send it again
                return Failure(Verdict.TRANSIENT, str(cause))
            return Failure(Verdict.NOT_SENT if not_sent(cause) else Verdict.LOST, describe(cause))
        if isinstance(exc, (etcd.EtcdLeaderElectionInProgress, etcd.EtcdWatcherCleared)):
            return Failure(Verdict.TRANSIENT, str(exc))
        if isinstance(exc, etcd.EtcdInsufficientPermissions):
            who = f"user {self._username!r}" if self._username else "anonymous access"
            raise RendezvousConnectionError(
                f"etcd at {url} refused {what} of {key!r} for {who}: wrong username or "
                f"password, or no permission on that key ({exc})."
            ) from exc
        if isinstance(exc, etcd.EtcdClusterIdChanged):
            raise RendezvousConnectionError(
                f"The etcd cluster behind {url} changed its cluster id during {what} of "
                f"{key!r}; the endpoints may point at different clusters ({exc})."
            ) from exc
        if isinstance(exc, etcd.EtcdException):
            if "404 page not found" in str(exc):
                raise RendezvousConnectionError(
                    f"etcd at {url} does not serve the v2 API ({what} of {key!r}): use "
                    "api=v3, or start etcd with --enable-v2."
                ) from exc
            payload = exc.payload if isinstance(exc.payload, dict) else {}
            if payload.get("errorCode") == _INVALID_FORM and "too large" in str(
                payload.get("cause")
            ):
                # A bad input, not a connection problem: no endpoint would take it.
                raise ValueError(
                    f"etcd at {url} refused {what} of {key!r}: the request is too large "
                    f"({payload.get('cause')}); etcd's v2 API parses request bodies of "
                    "up to 10 MiB, and values travel form-encoded."
                ) from exc
            if payload.get("errorCode") == _RAFT_INTERNAL:
                return Failure(Verdict.TRANSIENT, str(exc))
            raise RendezvousConnectionError(
                f"etcd at {url} failed {what} of {key!r}: {exc}"
            ) from exc
        if isinstance(exc, (u3exc.HTTPError, http.client.HTTPException, OSError)):
            # python-etcd leaves some body-read errors unwrapped: the request was sent.
            return Failure(Verdict.LOST, describe(transport_error(exc)))
        return None

    def _on(self, fn: Callable[[Any, float], T]) -> Callable[[int, float], T]:
        """``fn(client, timeout)`` as the failover loop calls it: by endpoint index."""
        return lambda index, timeout: fn(self._clients[index], timeout)

    # -- KV ---------------------------------------------------------------------------

    @staticmethod
    def _record(result: Any) -> Record:
        return Record(
            str(result.key),
            result.value or "",
            int(result.modifiedIndex),
            int(result.createdIndex or 0),
        )

    def get(self, key: str) -> tuple[Record | None, int]:
        return self._get(key, None, quorum=False)

    def get_latest(self, key: str) -> tuple[Record | None, int]:
        return self._get(key, None, quorum=True)

    def _get(
        self, key: str, deadline: float | None, quorum: bool = True
    ) -> tuple[Record | None, int]:
        # A write's read-back (the failover loop's, after a lost answer) is a quorum
        # read: a follower that has not applied the write yet would have it sent again.
        def fn(client: Any, timeout: float) -> tuple[Record | None, int]:
            try:
                result = read(client, key, timeout, quorum=quorum)
            except etcd.EtcdKeyNotFound as exc:
                payload = exc.payload if isinstance(exc.payload, dict) else {}
                return None, int(payload.get("index") or 0)
            if result.dir:
                return None, int(result.etcd_index)
            return self._record(result), int(result.etcd_index)

        return self._call("read", key, self._on(fn), idempotent=True, deadline=deadline)

    def time_left(self, key: str) -> int | None:
        def fn(client: Any, timeout: float) -> int | None:
            try:
                result = read(client, key, timeout)
            except etcd.EtcdKeyNotFound:
                return None
            ttl = getattr(result, "ttl", None)
            if result.dir or isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 0:
                return None
            return ttl

        return self._call("read", key, self._on(fn), idempotent=True)

    def list_prefix(self, prefix: str) -> tuple[list[Record], int]:
        return self._list(prefix, recursive=False)

    def list_latest(self, prefix: str) -> tuple[list[Record], int]:
        return self._list(prefix, recursive=False, quorum=True)

    def list_tree(self, prefix: str) -> tuple[list[Record], int]:
        return self._list(prefix, recursive=True)

    def _list(self, prefix: str, recursive: bool, quorum: bool = False) -> tuple[list[Record], int]:
        def fn(client: Any, timeout: float) -> tuple[list[Record], int]:
            try:
                result = read(client, prefix, timeout, recursive=recursive, quorum=quorum)
            except etcd.EtcdKeyNotFound as exc:
                payload = exc.payload if isinstance(exc.payload, dict) else {}
                return [], int(payload.get("index") or 0)
            records = [self._record(r) for r in result.leaves if not r.dir]
            return records, int(result.etcd_index)

        return self._call("list", prefix, self._on(fn), idempotent=True)

    def create(
        self,
        key: str,
        value: str,
        ttl: int | None,
        landed: Landed | None = None,
        *,
        lease: Lease | None = None,
    ) -> Record | None:
        if lease is not None:  # a liveness key: the lease's TTL, refreshed with it
            ttl = lease.ttl

        def fn(client: Any, timeout: float) -> Record | None:
            try:
                return self._record(
                    send(client, "PUT", key, put_params(value, ttl, prevExist="false"), timeout)
                )
            except etcd.EtcdAlreadyExist:
                return None

        result: Record | None = self._resolve(
            "create", key, value, self._on(fn), lambda current: current is None, landed
        )
        if result is not None and lease is not None:
            lease.wrote(key, 0)
        return result

    def compare_and_set(
        self, key: str, value: str, revision: int, ttl: int | None, landed: Landed | None = None
    ) -> Record | None:
        def fn(client: Any, timeout: float) -> Record | None:
            try:
                params = put_params(value, ttl, prevIndex=str(revision))
                return self._record(send(client, "PUT", key, params, timeout))
            except (etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound):
                return None

        result: Record | None = self._resolve(
            "compare-and-set",
            key,
            value,
            self._on(fn),
            lambda current: current is not None and current.revision == revision,
            landed,
        )
        return result

    def put(self, key: str, value: str, ttl: int | None) -> Record:
        def fn(client: Any, timeout: float) -> Record:
            return self._record(send(client, "PUT", key, put_params(value, ttl), timeout))

        # An unconditional write may simply be sent again.
        return self._call("write", key, self._on(fn), idempotent=True)

    def delete(self, key: str) -> bool:
        def fn(client: Any, timeout: float) -> bool:
            try:
                send(client, "DELETE", key, {}, timeout)
            except etcd.EtcdKeyNotFound:
                return False
            return True

        existed = self._call("delete", key, self._on(fn), idempotent=True)
        # Also when the key was gone already: its TTL may have emptied the directory.
        self._remove_empty_parents(key)
        return existed

    def delete_prefix(self, prefix: str) -> None:
        def fn(client: Any, timeout: float) -> None:
            with contextlib.suppress(etcd.EtcdKeyNotFound):
                send(client, "DELETE", prefix, {"recursive": "true", "dir": "true"}, timeout)

        self._call("delete", prefix, self._on(fn), idempotent=True)
        self._remove_empty_parents(prefix)

    # -- directories ------------------------------------------------------------------

    def _parents(self, key: str) -> list[str]:
        """The directories above ``key`` strictly below the root, deepest first."""
        root = self._root
        if root is None:
            return []
        base = "" if root == "/" else root
        if not key.startswith(base + "/"):
            return []
        parts = key[len(base) + 1 :].strip("/").split("/")[:-1]
        return [base + "/" + "/".join(parts[:n]) for n in range(len(parts), 0, -1)]

    def _rmdir(self, directory: str) -> bool:
        """Remove ``directory`` if it is empty: ``True`` if it is gone now (removed
        here, or already gone), ``False`` if it holds something."""

        def fn(client: Any, timeout: float) -> bool:
            try:
                # Not recursive: etcd refuses to remove a directory with anything in it.
                send(client, "DELETE", directory, {"dir": "true"}, timeout)
            except etcd.EtcdKeyNotFound:
                return True
            except (etcd.EtcdDirNotEmpty, etcd.EtcdNotDir):
                return False
            return True

        return self._call("remove empty directory", directory, self._on(fn), idempotent=True)

    def _remove_empty_parents(self, key: str) -> None:
        """Remove the directories above ``key`` that are empty, bottom-up, up to the
        first one that is not. Housekeeping: a failure is logged, never raised (the
        directory stays until the next sweep)."""
        try:
            for directory in self._parents(key):
                if not self._rmdir(directory):
                    return
        except RendezvousConnectionError as exc:
            log.debug("left empty directories above %s: %s", key, exc)

    def sweep_empty_dirs(self, every: int = SWEEP_EVERY) -> int | None:
        """Remove the empty directories under the root (the key prefix), if no client
        has done so in the last ``every`` seconds.

        Keys that leave by their TTL leave their directories behind, empty, and v2
        directories cannot be given a TTL afterwards (see the module docstring). The
        first client to create the marker ``<root>/~swept`` (an empty directory with TTL
        ``every``) lists
        the tree once and removes each directory that holds no key, deepest first, at
        most :data:`SWEEP_MAX_DIRS`, within ``read_timeout``. A directory written into
        since the listing is refused by etcd and stays.

        Housekeeping: never raises. Returns:
            The number of directories removed, or ``None`` when no sweep ran (another
            client swept recently, no root, or etcd refused or failed).
        """
        root = self._root
        if root is None or root == "/":
            return None  # never sweep a whole keyspace that others may share
        deadline = time.monotonic() + self._read_timeout
        try:
            with self.bounded(deadline):
                if not self._claim_sweep(f"{root}/{SWEEP_MARKER}", every):
                    return None
                empty = self._empty_dirs(root)
                removed = 0
                for directory in empty[:SWEEP_MAX_DIRS]:
                    if time.monotonic() >= deadline:
                        break
                    if self._rmdir(directory):
                        removed += 1
        except (RendezvousConnectionError, RendezvousStateError) as exc:
            log.debug("no sweep of empty directories under %s: %s", root, exc)
            return None
        if removed:
            log.info("removed %d empty etcd directories under %s", removed, root)
        return removed

    def _claim_sweep(self, marker: str, every: int) -> bool:
        """Create the marker, an empty directory with TTL ``every``: ``True`` if this
        call created it. A directory, not a key, so that listings of keys (``etcdctl
        ls`` aside) never show it; etcd can give a directory a TTL when it creates it."""

        def fn(client: Any, timeout: float) -> bool:
            try:
                params = {"dir": "true", "ttl": every, "prevExist": "false"}
                send(client, "PUT", marker, params, timeout)
            except (etcd.EtcdAlreadyExist, etcd.EtcdNotFile):
                return False
            return True

        # A create whose answer was lost and is sent again finds the marker and skips
        # this sweep: the next one does the work.
        return self._call("create", marker, self._on(fn), idempotent=True)

    def _empty_dirs(self, root: str) -> list[str]:
        """The directories under ``root`` with no key anywhere below them, deepest
        first (each after everything under it), ``root`` itself excluded.

        Raises:
            RendezvousStateError: etcd's answer is not a v2 listing.
        """

        def fn(client: Any, timeout: float) -> Any:
            path = client.key_endpoint + root
            try:
                response = client.api_execute(
                    path, "GET", params={"recursive": "true"}, timeout=timeout
                )
            except etcd.EtcdKeyNotFound:
                return None
            return response.data

        raw = self._call("list", root, self._on(fn), idempotent=True)
        if raw is None:
            return []
        try:
            node = json.loads(raw.decode("utf-8"))["node"]
        except (ValueError, KeyError, TypeError, UnicodeError) as exc:
            raise RendezvousStateError(f"etcd's listing of {root!r} is not v2 JSON: {exc}") from exc
        found: list[str] = []
        collect_empty(node, root, found)
        return [d for d in found if d != root]

    def refresh(self, key: str, ttl: int) -> bool:
        def fn(client: Any, timeout: float) -> bool:
            try:
                params = put_params(None, ttl, prevExist="true", refresh="true")
                send(client, "PUT", key, params, timeout)
            except etcd.EtcdKeyNotFound:
                return False
            return True

        return self._call("refresh", key, self._on(fn), idempotent=True)

    def watch(
        self, key: str, from_revision: int, timeout: float | None, *, prefix: bool = False
    ) -> Event | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # Each request is capped at read_timeout so a frozen member cannot hold a
            # watch forever; the loop carries on to the caller's deadline.
            step = self._read_timeout
            if deadline is not None:
                step = min(step, deadline - time.monotonic())
                if step <= 0:
                    return None
            step = max(self._wait_bound(step, "watch", key), 0.001)

            def fn(client: Any, timeout: float, step: float = step) -> Any:
                try:
                    return read(
                        client,
                        key,
                        min(step, timeout),
                        recursive=prefix,
                        wait_index=from_revision,
                    )
                except etcd.EtcdEventIndexCleared as exc:
                    raise WatchCompacted(
                        f"{key}: history from {from_revision} is gone",
                        current=_error_index(exc),
                    ) from exc
                except etcd.EtcdConnectionFailed as exc:
                    # No answer at all says a member is frozen only after a whole
                    # read_timeout: a long poll the caller's deadline cut shorter (its
                    # last moments, on a loaded etcd) found nothing yet.
                    cut = min(step, timeout) < self._read_timeout
                    if cut and isinstance(root_cause(exc), TimeoutError):
                        raise etcd.EtcdWatchTimedOut("the caller's wait ended") from exc
                    raise

            try:
                result = self._call("watch", key, self._on(fn), idempotent=True)
            except etcd.EtcdWatchTimedOut:
                continue
            revision = int(result.modifiedIndex)
            current = int(result.etcd_index or 0)
            if result.action in _PUT_ACTIONS:
                record = Record(
                    str(result.key), result.value or "", revision, int(result.createdIndex or 0)
                )
                return Event("put", record, current)
            return Event("delete", Record(str(result.key), "", revision), current)

    def probe(self, key: str = "/") -> None:
        deadline = time.monotonic() + self._read_timeout

        def fn(client: Any, timeout: float) -> None:
            with contextlib.suppress(etcd.EtcdKeyNotFound):
                read(client, key, timeout)

        self._call("probe read", key, self._on(fn), idempotent=True, deadline=deadline)

    def close(self) -> None:
        self._closed = True
        self._pool.clear()
