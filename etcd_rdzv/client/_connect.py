"""The client factory: builds the KV client for an etcd cluster from rendezvous parameters.

``create_client`` validates every option first (``ValueError`` naming the option, no
network I/O), then builds the client (:mod:`._build`: one HTTP transport, TLS
verifying by default), then probes etcd once (:mod:`._probe`) so that an unreachable
cluster, a wrong CA or wrong credentials fail here, within ``read_timeout``, with a
:class:`~etcd_rdzv.errors.RendezvousConnectionError`; when that fails, the diagnosis
(:mod:`._diagnose`) puts what to do in front of the error, if it finds something.

The ``api`` option picks the KV implementation: ``v2`` (python-etcd, imported only
then) or ``v3`` (etcd's JSON gateway). Both go over this package's own transport.
There is no automatic switching: etcd keeps the two keyspaces apart, so nodes of one
run on different APIs would never see each other. At connect, a client built for a
run reads the other API's keyspace once: if the run has keys there and is not
established in this one (no round formed, no state), it refuses to start (this node
is on the wrong API); if it is established here, it goes on, and the keys in the
other keyspace are logged (WARNING). :func:`other_keyspace_keys` tells what is there.
"""

from __future__ import annotations

import logging

from .._kv import KV
from ..config.params import ClientConfig, ParamsLike
from ..errors import RendezvousConnectionError
from ._build import build, ssl_context, transport
from ._probe import OtherKeys, RunChecks, other_keys, probe

__all__ = [
    "OtherKeys",
    "build_kv",
    "connect",
    "connect_handler",
    "create_client",
    "other_keyspace_keys",
    "ssl_context",
]

log = logging.getLogger(__name__)


def build_kv(config: ClientConfig) -> KV:
    """Build the KV client for ``config`` (``config.api`` picks v2 or v3) without any
    network I/O.

    Raises:
        ValueError: a CA or client certificate file cannot be loaded.
    """
    return build(config, transport(config))


def create_client(params: ParamsLike) -> KV:
    """Build and probe an etcd client from rendezvous parameters.

    Args:
        params: ours or torch's ``RendezvousParameters``; options as in
            ``docs/configuration.md``.

    Returns:
        The KV client; one per process is plenty (it is thread-safe and pools
        connections).

    Raises:
        ValueError: a bad option, before any network call.
        RendezvousConnectionError: etcd did not answer within ``read_timeout``, TLS
            verification failed, the credentials were refused, or what answered is
            not etcd (a malformed, oversized or endless answer).
        RendezvousStateError: the run has keys in the other API's keyspace and is not
            established in this one (this node is on the wrong API).
    """
    return connect(ClientConfig.from_params(params))


def connect(config: ClientConfig) -> KV:
    """Build the KV client for a validated ``config`` and probe etcd once.

    Raises:
        RendezvousConnectionError: as :func:`create_client`; when a common mistake
            explains it (a plain-HTTP etcd with ``protocol=https``, a TLS handshake
            that fails, etcd's peer port as the endpoint, nothing listening), the
            message starts with what to do.
        RendezvousStateError: as :func:`create_client`.
    """
    http = transport(config)
    kv = build(config, http)
    try:
        probe(kv, config, http)
    except RendezvousConnectionError as exc:
        kv.close()
        diagnosed = RunChecks(kv, config, http).diagnosed(exc)
        http.close()
        if diagnosed is exc:
            raise
        raise diagnosed from exc
    except BaseException:
        kv.close()
        raise
    log.debug("etcd client ready: %r", config)
    return kv


def connect_handler(config: ClientConfig) -> tuple[KV, RunChecks]:
    """The KV client of a rendezvous handler, and the checks its rounds make once; no
    network I/O.

    A handler's build requests its join's lease and watch at once (v3), which reach
    etcd as a probe would (v2 needs its probe read: the caller makes it). The other
    keyspace and the v2 sweep, which :func:`connect` does for every client, are the
    coordinator's, once per round (:class:`~._probe.RunChecks`): at N agents that is
    N requests fewer. A failed first request is diagnosed by the caller
    (:meth:`RunChecks.diagnosed`).
    """
    http = transport(config)
    kv = build(config, http)
    return kv, RunChecks(kv, config, http)


def other_keyspace_keys(kv: KV, config: ClientConfig) -> OtherKeys | None:
    """The keys of ``config``'s run in the other API's keyspace (the first few, and how
    many), which none of the run's nodes on ``kv``'s API sees: ``None`` when there are
    none, when ``config`` names no run, or when that keyspace cannot be read (no v2
    API, no permission). ``kv`` is a client built for ``config``. One request over a
    transport of its own; never raises."""
    try:
        http = transport(config)
        try:
            return other_keys(kv, config, http)
        finally:
            http.close()
    except Exception:  # a check, not an operation
        log.debug("could not read the other keyspace", exc_info=True)
        return None
