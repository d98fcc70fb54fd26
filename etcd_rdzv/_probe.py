"""The first requests of a new client: is etcd there, and is the run on this API?

:func:`probe` reads below the key prefix once (an unreachable cluster, a wrong CA or
wrong credentials fail here, within ``read_timeout``), then checks that the run has no
keys in the other API's keyspace (etcd keeps the v2 and v3 keyspaces apart, so nodes
of one run on different APIs would never see each other), then, on v2, sweeps the
empty directories keys leaving by TTL left behind. Every request goes over the
client's own transport.
"""

from __future__ import annotations

import base64
import http.client
import logging
import shlex
import urllib.parse
from typing import Any

from . import _keys
from ._client_build import build_v3
from ._diagnose import diagnose
from ._kv import KV
from ._kv._failover import clip
from ._kv._http import Transport
from ._kv._json import loads
from .errors import RendezvousConnectionError, RendezvousStateError
from .params import DEFAULT_KEY_PREFIX, ClientConfig

__all__ = ["RunChecks", "probe", "v2_has_keys_under"]

log = logging.getLogger(__name__)


def probe(kv: KV, config: ClientConfig, transport: Transport) -> None:
    """Probe etcd through ``kv`` (built for ``config`` over ``transport``), check the other
    keyspace, and sweep (v2).

    Raises:
        RendezvousConnectionError: etcd did not answer, refused, or answered nonsense.
        RendezvousStateError: the run has keys in the other API's keyspace.
    """
    kv.probe(config.key_prefix)
    check_one_api(kv, config, transport)
    _sweep(kv)


class RunChecks:
    """What :func:`probe` checks beside reachability, for a client whose handler does
    them once per round rather than at each node's build
    (:func:`etcd_rdzv.client.connect_handler`): the other keyspace (:meth:`other_api`,
    asked by each round's coordinator) and the v2 sweep (:meth:`sweep`, by the node
    that completed a round); and the diagnosis of a first request that failed
    (:meth:`diagnosed`)."""

    def __init__(self, kv: KV, config: ClientConfig, transport: Transport) -> None:
        self._kv, self._config, self._transport = kv, config, transport

    def other_api(self) -> str | None:
        """Why the run cannot go on (it has keys in the other API's keyspace), or
        ``None``. One request; never raises."""
        try:
            check_one_api(self._kv, self._config, self._transport)
        except RendezvousStateError as exc:
            return str(exc)
        except Exception:  # a check, not an operation
            log.debug("could not check the other keyspace", exc_info=True)
        return None

    def sweep(self) -> None:
        """On v2, the sweep of empty directories (see :func:`probe`); never raises."""
        _sweep(self._kv)

    def diagnosed(self, exc: RendezvousConnectionError) -> RendezvousConnectionError:
        """``exc`` with what to do in front of it, when a common mistake explains it."""
        hints = diagnose(self._config, self._transport)
        if not hints:
            return exc
        return RendezvousConnectionError(" ".join(f"{h}." for h in hints) + f" {exc}")


def _sweep(kv: KV) -> None:
    """On v2, remove the directories under the key prefix that keys leaving by their
    TTL left empty (at most once an hour per prefix, whichever client comes first;
    never raises). v3 has no directories."""
    if kv.api != "v2":
        return  # and python-etcd stays unimported
    from ._kv.v2 import V2KV

    if isinstance(kv, V2KV):
        kv.sweep_empty_dirs()


def check_one_api(kv: KV, config: ClientConfig, transport: Transport) -> None:
    """Refuse a run that already has keys in the other API's keyspace.

    etcd's v2 and v3 keyspaces are separate: a node on ``api=v3`` never sees the keys of
    a node on ``api=v2``, so a job whose nodes disagree would split into groups that
    wait for each other forever. One read at connect; when the other keyspace cannot be
    read (no v2 API, no permission, no answer), there is nothing to compare with.

    Raises:
        RendezvousStateError: the run has keys in the other keyspace.
    """
    if config.run_id is None:
        return
    run_dir = _keys.run_dir(config.key_prefix, config.run_id)
    found: bool | None
    if kv.api == "v3":
        other = "v2"
        found = v2_has_keys_under(transport, config, kv.endpoints[0], run_dir)
    else:
        other = "v3"
        # The same endpoints, TLS settings, credentials and transport, on the v3
        # gateway. It holds no lease and shares kv's transport: dropped, not closed.
        try:
            found = build_v3(config, transport).has_keys_under(run_dir)
        except RendezvousConnectionError as exc:
            log.debug("could not check the v3 keyspace for run %s: %s", config.run_id, exc)
            found = None
    if found:
        delete = f"etcd-rdzv delete --run-id {shlex.quote(config.run_id)} --api {other}"
        if config.key_prefix != DEFAULT_KEY_PREFIX:
            delete += f" --key-prefix {shlex.quote(config.key_prefix)}"
        raise RendezvousStateError(
            f"Run {config.run_id!r} has keys under {run_dir}/ in etcd's {other} keyspace, but "
            f"this node uses api={config.api}. Nodes on different APIs never see each other: "
            f"every node of a job must use the same 'api' option (or pick a new run id, or "
            f"delete the run's {other} keys: {delete}). See docs/api.md."
        )


def v2_has_keys_under(
    transport: Transport, config: ClientConfig, url: str, directory: str
) -> bool | None:
    """Whether etcd's v2 keyspace at ``url`` holds a key below ``directory``; ``None``
    when that cannot be told (no v2 API, no permission, no answer, not etcd's answer).
    One request, never failed over: it is a check, not an operation."""
    headers: dict[str, str] = {}
    if config.username is not None:
        secret = f"{config.username}:{config.password or ''}".encode()
        headers["Authorization"] = "Basic " + base64.b64encode(secret).decode("ascii")
    path = "/v2/keys" + urllib.parse.quote(directory, safe="/~._-") + "?recursive=true"
    try:
        resp, data = transport.request(
            url, path, b"", headers, clip(config.read_timeout), method="GET"
        )
        answer = loads(data or b"", url)
    except (http.client.HTTPException, OSError) as exc:  # BadResponse among the first
        log.debug("could not read the v2 keyspace at %s: %s", url, exc)
        return None
    if not isinstance(answer, dict):
        return None
    if resp.status != 200:
        return False if resp.status == 404 and "errorCode" in answer else None
    node = answer.get("node")
    return _has_leaf(node) if isinstance(node, dict) else None


def _has_leaf(node: dict[str, Any]) -> bool:
    """Whether the v2 ``node`` is a key or has one below it (untrusted: anything that is
    not a directory listing counts as a key). Its nesting is bounded by ``loads``."""
    if node.get("dir") is not True:
        return True
    children = node.get("nodes")
    if not isinstance(children, list):
        return False
    return any(not isinstance(child, dict) or _has_leaf(child) for child in children)
