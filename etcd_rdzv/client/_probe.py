"""The first requests of a new client: is etcd there, and is the run on this API?

:func:`probe` reads below the key prefix once (an unreachable cluster, a wrong CA or
wrong credentials fail here, within ``read_timeout``), then checks the other API's
keyspace (etcd keeps the v2 and v3 keyspaces apart, so nodes of one run on different
APIs would never see each other: :func:`check_one_api` refuses a node whose run lives
in the other keyspace, and only warns of keys there when the run lives in this one),
then, on v2, sweeps the empty directories keys leaving by TTL left behind. Every
request goes over the client's own transport. :func:`other_keys` tells what the run
has in the other keyspace (``etcd-rdzv status`` may show it).
"""

from __future__ import annotations

import base64
import http.client
import logging
import shlex
import urllib.parse
from dataclasses import dataclass
from typing import Any

from .. import _keys
from .._kv import KV
from .._kv._failover import clip
from .._kv._http import Transport
from .._kv._json import loads
from ..config.params import DEFAULT_KEY_PREFIX, ClientConfig
from ..errors import RendezvousConnectionError, RendezvousStateError
from ._build import build_v3
from ._diagnose import diagnose

__all__ = [
    "OtherKeys",
    "RunChecks",
    "check_one_api",
    "established_here",
    "other_keys",
    "probe",
    "refusal_text",
    "stray_text",
    "v2_keys_under",
]

log = logging.getLogger(__name__)

#: Keys of the other keyspace a message names (the rest are counted).
SHOWN = 5


def probe(kv: KV, config: ClientConfig, transport: Transport) -> None:
    """Probe etcd through ``kv`` (built for ``config`` over ``transport``), check the other
    keyspace, and sweep (v2).

    Raises:
        RendezvousConnectionError: etcd did not answer, refused, or answered nonsense.
        RendezvousStateError: the run has keys in the other API's keyspace and is not
            established in this one.
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

    def other_api(self, established: bool) -> str | None:
        """Why this node cannot join the run (it has keys in the other API's keyspace
        and is not ``established`` in this one: see :func:`check_one_api`), or
        ``None``; keys in the other keyspace of a run ``established`` here are logged
        (WARNING). One request when they are none; never raises."""
        try:
            check_one_api(self._kv, self._config, self._transport, established)
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
    from .._kv.v2.kv import V2KV

    if isinstance(kv, V2KV):
        kv.sweep_empty_dirs()


def check_one_api(
    kv: KV, config: ClientConfig, transport: Transport, established: bool | None = None
) -> None:
    """Refuse a node on the wrong API: the run has keys in the other API's keyspace and
    is not established in this one.

    etcd's v2 and v3 keyspaces are separate: a node on ``api=v3`` never sees the keys of
    a node on ``api=v2``, so a job whose nodes disagree would split into groups that
    wait for each other forever. The node refused is the one whose keyspace holds no
    run yet: a run established in this keyspace goes on, and the keys in the other
    (a mis-configured agent's, an old tool's) only get a WARNING that names them and
    says how to remove them. When the other keyspace cannot be read (no v2 API, no
    permission, no answer), there is nothing to compare with.

    Args:
        established: whether the run is established in ``kv``'s keyspace (a round's
            coordinator tells from its listing); ``None``: read it
            (:func:`established_here`, only when the other keyspace has keys).

    Raises:
        RendezvousStateError: the run has keys in the other keyspace and is not
            established in this one.
    """
    found = other_keys(kv, config, transport)
    if found is None:
        return
    if established is None:
        established = established_here(kv, config)
    if established:
        log.warning("%s", stray_text(config, found))
        return
    raise RendezvousStateError(refusal_text(config, found))


@dataclass(frozen=True)
class OtherKeys:
    """Keys of a run in the other API's keyspace: keys that none of the run's nodes
    on this API ever sees."""

    api: str  #: the other keyspace's API (``v2`` or ``v3``)
    directory: str  #: the run's directory (the same in both keyspaces)
    keys: tuple[str, ...]  #: the first :data:`SHOWN` of them, whole, in key order
    count: int  #: how many there are in all

    def shown(self) -> str:
        """The keys as a message names them (below :attr:`directory`)."""
        names = [
            k[len(self.directory) + 1 :] if k.startswith(self.directory + "/") else k
            for k in self.keys
        ]
        more = self.count - len(names)
        return ", ".join(names) + (f" and {more} more" if more > 0 else "")


def other_keys(kv: KV, config: ClientConfig, transport: Transport) -> OtherKeys | None:
    """The run's keys in the other API's keyspace, over ``transport`` (``kv``'s, built
    for ``config``); ``None`` when it has none, when ``config`` names no run, or when
    that keyspace cannot be read (no v2 API, no permission, no answer): one request,
    a check rather than an operation, so it never raises."""
    if config.run_id is None:
        return None
    run_dir = _keys.run_dir(config.key_prefix, config.run_id)
    found: tuple[tuple[str, ...], int] | None
    if kv.api == "v3":
        other = "v2"
        found = v2_keys_under(transport, config, kv.endpoints[0], run_dir)
    else:
        other = "v3"
        # The same endpoints, TLS settings, credentials and transport, on the v3
        # gateway, from the endpoint kv uses now (not a member it left: a frozen one
        # would hold the check until it counts as lost). It holds no lease and shares
        # kv's transport: dropped, not closed.
        try:
            found = build_v3(config, transport, kv.endpoints).keys_under(run_dir, SHOWN)
        except RendezvousConnectionError as exc:
            log.debug("could not check the v3 keyspace for run %s: %s", config.run_id, exc)
            found = None
    if found is None or found[1] == 0:
        return None
    return OtherKeys(other, run_dir, found[0], found[1])


def established_here(kv: KV, config: ClientConfig) -> bool:
    """Whether ``config``'s run is established in ``kv``'s keyspace: it holds the
    run's round hint (a round of the native handler formed there) or its state key
    (torch's dynamic handler). Join keys do not count: nodes on the wrong API write
    those too. Two reads.

    Raises:
        RendezvousConnectionError: etcd did not answer.
    """
    assert config.run_id is not None
    prefix, run_id = config.key_prefix, config.run_id
    for key in (_keys.hint_key(prefix, run_id), _keys.state_key(prefix, run_id)):
        if kv.get(key)[0] is not None:
            return True
    return False


def _delete_command(config: ClientConfig, api: str) -> str:
    assert config.run_id is not None
    delete = f"etcd-rdzv delete --run-id {shlex.quote(config.run_id)} --api {api}"
    if config.key_prefix != DEFAULT_KEY_PREFIX:
        delete += f" --key-prefix {shlex.quote(config.key_prefix)}"
    return delete


def refusal_text(config: ClientConfig, found: OtherKeys) -> str:
    """Why a node on ``config.api`` is refused: the run lives in the other keyspace."""
    other = found.api
    return (
        f"Run {config.run_id!r} has keys under {found.directory}/ in etcd's {other} keyspace "
        f"({found.shown()}), but this node uses api={config.api}, where the run has not "
        f"started. Nodes on different APIs never see each other: every node of a job must "
        f"use the same 'api' option (or pick a new run id, or delete the run's {other} "
        f"keys: {_delete_command(config, other)}). See docs/api.md."
    )


def stray_text(config: ClientConfig, found: OtherKeys) -> str:
    """What a run established on ``config.api`` says of its keys in the other keyspace."""
    other = found.api
    return (
        f"run {config.run_id}: etcd's {other} keyspace holds {found.count} key(s) of this "
        f"run under {found.directory}/ ({found.shown()}), which its nodes on "
        f"api={config.api} never see: a node or a tool on api={other} wrote them. The run "
        f"continues on api={config.api}, where it runs; a node on api={other} is refused. "
        f"Once no node uses api={other}, remove them: {_delete_command(config, other)}"
    )


def v2_keys_under(
    transport: Transport, config: ClientConfig, url: str, directory: str
) -> tuple[tuple[str, ...], int] | None:
    """The first :data:`SHOWN` keys below ``directory`` in etcd's v2 keyspace at ``url``
    (in key order) and how many there are; ``None`` when that cannot be told (no v2
    API, no permission, no answer, not etcd's answer). One request, never failed over:
    it is a check, not an operation."""
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
        return ((), 0) if resp.status == 404 and "errorCode" in answer else None
    node = answer.get("node")
    if not isinstance(node, dict):
        return None
    leaves: list[str] = []
    _collect_leaves(node, leaves)
    return tuple(sorted(leaves)[:SHOWN]), len(leaves)


def _collect_leaves(node: dict[str, Any], into: list[str]) -> None:
    """The keys at or below the v2 ``node`` (untrusted: anything that is not a
    directory listing counts as a key, named ``?`` when it names none). Its nesting
    is bounded by ``loads``."""
    if node.get("dir") is not True:
        key = node.get("key")
        into.append(key if isinstance(key, str) else "?")
        return
    children = node.get("nodes")
    if not isinstance(children, list):
        return
    for child in children:
        if isinstance(child, dict):
            _collect_leaves(child, into)
        else:
            into.append("?")
