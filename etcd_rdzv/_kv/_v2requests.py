"""How the v2 layer (:mod:`.v2`) sends one request through python-etcd, and the small
pieces of its answers it reads itself: python-etcd's failed-request log lines demoted
(this layer retries or reports them), the root cause of a transport error, a write or
delete with its own timeout, the parameters of a write, and the empty directories of a
listing.
"""

from __future__ import annotations

import logging
from typing import Any

import urllib3.exceptions as u3exc

__all__ = ["collect_empty", "put_params", "root_cause", "send"]


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

logging.getLogger("etcd.client").addFilter(_QuietFailedRequests())


def root_cause(exc: BaseException) -> BaseException:
    cause = getattr(exc, "cause", None) or exc.__cause__
    if isinstance(cause, u3exc.MaxRetryError) and cause.reason is not None:
        return cause.reason
    return cause if cause is not None else exc


def send(client: Any, method: str, key: str, params: dict[str, Any], timeout: float) -> Any:
    """One v2 write or delete with its own timeout.

    python-etcd's ``write()``, ``delete()`` and ``refresh()`` always wait the client's
    whole ``read_timeout``; a write that must finish by a deadline (and leave time to
    try the next endpoint) needs a shorter one, so the request is built here the way
    those methods build it.
    """
    path = client.key_endpoint + (key if key.startswith("/") else "/" + key)
    return client._result_from_response(
        client.api_execute(path, method, params=params, timeout=timeout)
    )


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
