"""Building the package's objects from validated :class:`~etcd_rdzv.params.Settings`.

Shared by :mod:`etcd_rdzv._factory` (the public factories) and :mod:`etcd_rdzv.torch`
(the torch flavours), so neither imports the other.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from typing import Any

from . import _keys
from .backend import EtcdRendezvousBackend
from .client import connect, connect_handler
from .errors import RendezvousConnectionError
from .params import Settings
from .rendezvous import EtcdRendezvousHandler
from .store import EtcdStore

__all__ = ["build_backend", "build_handler", "node_address"]

log = logging.getLogger(__name__)

_told: set[str] = set()  # explicit loopback addresses already mentioned (once each)
_told_lock = threading.Lock()


def build_backend(
    settings: Settings, backend_cls: Any = EtcdRendezvousBackend, store_cls: Any = EtcdStore
) -> tuple[EtcdRendezvousBackend, EtcdStore]:
    """The backend and store of ``settings`` (already validated), of the given classes."""
    prefix = settings.client.key_prefix
    kv = connect(settings.client)
    backend = backend_cls(kv, settings.run_id, key_prefix=prefix, name=settings.backend)
    store = store_cls(kv, _keys.store_dir(prefix, settings.run_id), ttl=settings.store_ttl)
    return backend, store


def build_handler(
    settings: Settings,
    handler_cls: type[EtcdRendezvousHandler] = EtcdRendezvousHandler,
    store_cls: type[EtcdStore] = EtcdStore,
) -> EtcdRendezvousHandler:
    """The native handler of ``settings`` (already validated), of the given classes."""
    addr = node_address(settings.local_addr, settings.handler.max_nodes, settings.run_id)
    kv, checks = connect_handler(settings.client)
    ttl = settings.store_ttl

    def store_factory(prefix: str) -> EtcdStore:
        return store_cls(kv, prefix, ttl=ttl)

    try:
        if kv.api == "v2":  # v2 prepares nothing from etcd: one read probes it
            kv.probe(settings.client.key_prefix)
        handler = handler_cls(kv, settings.handler, store_factory, local_addr=addr, checks=checks)
        # The first join is then one request (v3: its key's lease is granted and the
        # watch of its round opened here). These are the handler's first requests:
        # an etcd that does not answer them fails the build, as a probe would.
        handler.prepare_join()
    except RendezvousConnectionError as exc:
        kv.close()
        raise checks.diagnosed(exc) from exc
    except BaseException:
        kv.close()
        raise
    return handler


def node_address(local_addr: str | None, max_nodes: int, run_id: str = "") -> str:
    """The address this node publishes to the others (rank 0's is ``MASTER_ADDR``):
    ``local_addr``, or this host's fully qualified name.

    When it resolves only to loopback addresses and the job may span hosts
    (``max_nodes > 1``), peers on other hosts could not reach it: a WARNING says so and
    how to set it, when the address is the default; an address given explicitly (a
    single-host test job on ``127.0.0.1``) is mentioned once per process at INFO.
    """
    explicit = bool(local_addr)
    addr = local_addr or socket.getfqdn()
    if max_nodes <= 1 or not _loopback_only(addr):
        return addr
    if explicit:
        with _told_lock:
            if addr in _told:
                return addr
            _told.add(addr)
        log.info(
            "run %s: this node publishes the loopback address %r, given as local_addr: "
            "fine on one host; nodes on other hosts could not reach it",
            run_id,
            addr,
        )
        return addr
    log.warning(
        "run %s: this node's address %r (the default, this host's name) resolves to a "
        "loopback address: nodes on other hosts cannot reach it (rank 0's address is "
        "MASTER_ADDR). Set the address the others can reach: torchrun --local-addr, "
        "local_addr in RendezvousParameters, or etcd-rdzv join --local-addr.",
        run_id,
        addr,
    )
    return addr


def _loopback_only(addr: str) -> bool:
    """Whether ``addr`` (an IP address or a host name) resolves only to loopback
    addresses here. A name that does not resolve is not judged (``False``)."""
    text = addr.strip("[]")
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        pass
    try:
        found = {info[4][0] for info in socket.getaddrinfo(text, None)}
    except (OSError, UnicodeError):
        return False
    loopback = []
    for ip in found:
        try:
            loopback.append(ipaddress.ip_address(str(ip).split("%", 1)[0]).is_loopback)
        except ValueError:
            return False
    return bool(loopback) and all(loopback)
