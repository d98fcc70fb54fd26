"""How the v2 layer (:mod:`.kv`) sends one request through python-etcd, and the small
pieces of its answers it reads itself: python-etcd's failed-request log lines demoted
(this layer retries or reports them), the root cause of a transport error in this
package's types, a read, write or delete with its own timeout and its result decoded
once, the parameters of a write, and the empty directories of a listing.

urllib3's exception types stop here: python-etcd sorts errors by them (and
:class:`._pool.ReadTimedOut` is one, for that), but the failover loop both APIs share
(:mod:`.._failover`) judges only the transport's, the socket's and TLS's types, so
that neither it nor the v3 layer imports urllib3 (which only the ``v2`` extra installs).
"""

from __future__ import annotations

import logging
from typing import Any

import etcd
import urllib3.exceptions as u3exc

from .._failover import ConnectFailed, TLSFailed

__all__ = [
    "collect_empty",
    "put_params",
    "read",
    "result",
    "root_cause",
    "send",
    "transport_error",
]


class _QuietFailedRequests(logging.Filter):
    """python-etcd logs every failed request at ERROR; this layer retries or reports
    them itself, so they are demoted to DEBUG (nothing at ERROR that is retried)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and record.getMessage().startswith(
            ("Request to server", "Unexpected request failure")
        ):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


logging.getLogger("etcd.client").addFilter(_QuietFailedRequests())


def root_cause(exc: BaseException) -> BaseException:
    """The transport error under python-etcd's ``exc`` (its ``cause``), or ``exc``
    itself, as :func:`transport_error` makes it."""
    cause = getattr(exc, "cause", None) or exc.__cause__
    return transport_error(cause if cause is not None else exc)


def transport_error(exc: BaseException) -> BaseException:
    """``exc`` in the types the failover loop judges: urllib3's connection errors
    (the request never left) become :class:`~.._failover.ConnectFailed`, its TLS
    error :class:`~.._failover.TLSFailed`, its read timeout (an answer lost) a
    ``TimeoutError``, a ``MaxRetryError`` its reason; anything else stays as it is
    (the loop judges a type it does not know as a lost answer). The new error's
    ``__cause__`` is ``exc``."""
    if isinstance(exc, u3exc.MaxRetryError) and exc.reason is not None:
        return transport_error(exc.reason)
    ours: BaseException
    if isinstance(exc, u3exc.SSLError):
        ours = TLSFailed(str(exc))
    elif isinstance(exc, u3exc.NewConnectionError):  # before its base class, below
        ours = ConnectFailed(str(exc))
    elif isinstance(exc, u3exc.ConnectTimeoutError):
        ours = ConnectFailed(f"connect timed out: {exc}")
    elif isinstance(exc, u3exc.ReadTimeoutError):
        ours = TimeoutError(str(exc))
    else:
        return exc
    ours.__cause__ = exc
    return ours


def send(client: Any, method: str, key: str, params: dict[str, Any], timeout: float) -> Any:
    """One v2 request with its own timeout: python-etcd's result (``EtcdResult``).

    python-etcd's ``write()``, ``delete()`` and ``refresh()`` always wait the client's
    whole ``read_timeout``; a write that must finish by a deadline (and leave time to
    try the next endpoint) needs a shorter one, so the request is built here the way
    those methods (and ``read()``) build it. Its errors are python-etcd's.
    """
    path = client.key_endpoint + (key if key.startswith("/") else "/" + key)
    return result(client, client.api_execute(path, method, params=params, timeout=timeout))


def read(
    client: Any,
    key: str,
    timeout: float,
    *,
    recursive: bool = False,
    wait_index: int | None = None,
    quorum: bool = False,
) -> Any:
    """python-etcd's ``read(key, recursive=..., wait=..., waitIndex=..., quorum=...,
    timeout=...)`` (a long poll from ``wait_index`` if given), its result decoded once."""
    params: dict[str, Any] = {"recursive": "true"} if recursive else {}
    if quorum:  # answered as the leader has it, not from this member's copy
        params["quorum"] = "true"
    if wait_index is not None:
        params["wait"] = "true"  # python-etcd tells a quiet long poll by this parameter
        params["waitIndex"] = wait_index
    return send(client, "GET", key, params, timeout)


def result(client: Any, response: Any) -> Any:
    """python-etcd's result of a successful ``response``, as its client's
    ``_result_from_response`` makes it, built from the JSON our pool already decoded
    and checked (:attr:`._pool.Answer.parsed`) rather than decoding it again."""
    parsed = getattr(response, "parsed", None)
    if parsed is None:  # not an answer of our pool's, or not a result
        return client._result_from_response(response)
    try:
        found = etcd.EtcdResult(**parsed)
        if response.status == 201:
            found.newKey = True
        # EtcdResult.parse_headers, without decoding every header to str first.
        found.etcd_index = _index(response.header(b"x-etcd-index"))
        found.raft_index = _index(response.header(b"x-raft-index"))
    except Exception as exc:  # as python-etcd's _result_from_response reports it
        raise etcd.EtcdException(f"Unable to decode server response: {exc!r}") from exc
    return found


def _index(value: bytes | None) -> int:
    return 1 if value is None else int(value)


def collect_empty(node: Any, root: str, found: list[str]) -> bool:
    """Whether the listed ``node`` holds no key; appends its empty directories to
    ``found``, each after those below it. Untrusted input: a node that is not a dict
    with a key under ``root`` counts as a key (kept, never removed)."""
    if not isinstance(node, dict):
        return False
    key = node.get("key")
    if not isinstance(key, str) or not (key == root or key.startswith(root.rstrip("/") + "/")):
        return False
    if node.get("dir") is not True or node.get("ttl") is not None:
        return False  # a key; or a directory with a TTL (the marker): it goes by itself
    children = node.get("nodes", [])
    if not isinstance(children, list):
        return False
    empty = True
    for child in children:
        # Every child is visited, so empty directories under a kept one are found too.
        empty = collect_empty(child, root, found) and empty
    if empty:
        found.append(key)
    return empty


def put_params(value: str | None, ttl: int | None, **conditions: str) -> dict[str, Any]:
    params: dict[str, Any] = dict(conditions)
    if value is not None:
        params["value"] = value
    if ttl is not None:
        params["ttl"] = ttl
    return params
