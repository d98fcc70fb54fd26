"""etcd_rdzv: rendezvous for elastic distributed jobs over etcd.

Public names are listed in ``__all__``; modules starting with ``_`` are private.
``import etcd_rdzv`` never imports torch (:mod:`etcd_rdzv.torch` does, on demand).
"""

from __future__ import annotations

import logging

from ._factory import create_backend, create_handler
from .backend import EtcdRendezvousBackend
from .client import create_client
from .config.params import ClientConfig, RendezvousParameters, Settings
from .errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    RendezvousTimeoutError,
    StoreQueueEmptyError,
    StoreTimeoutError,
)
from .rendezvous import EtcdRendezvousHandler, RendezvousResult
from .store import EtcdStore

__all__ = [
    "ClientConfig",
    "EtcdRendezvousBackend",
    "EtcdRendezvousHandler",
    "EtcdStore",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousParameters",
    "RendezvousResult",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "Settings",
    "StoreQueueEmptyError",
    "StoreTimeoutError",
    "__version__",
    "create_backend",
    "create_client",
    "create_handler",
]

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())
