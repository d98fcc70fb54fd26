"""``create_backend``: the backend and store of one run, from rendezvous parameters."""

from __future__ import annotations

import importlib.util
from typing import Any

from . import _keys
from .backend import EtcdRendezvousBackend
from .client import connect
from .handler import EtcdRendezvousHandler, HandlerSettings
from .params import ClientConfig, ParamsLike, int_option
from .store import DEFAULT_STORE_TTL, EtcdStore

__all__ = ["create_backend", "create_handler", "torch_available"]


def torch_available() -> bool:
    """Whether torch can be imported (checked without importing it)."""
    return importlib.util.find_spec("torch") is not None


def create_backend(params: ParamsLike) -> tuple[EtcdRendezvousBackend, EtcdStore]:
    """The rendezvous backend and the store of ``params.run_id``.

    With torch installed the store is also a ``torch.distributed.Store`` and the
    backend a torch ``RendezvousBackend`` (see :mod:`etcd_rdzv.torch`). The backend's
    ``name`` is ``params.backend``, as torch's handler registry requires.

    Options read besides the client's: ``store_ttl`` (seconds a store key lives after
    its last write, default 7200, ``0`` for no expiry).

    Raises:
        ValueError: a bad option or run id, before any network call.
        RendezvousConnectionError: etcd is unreachable or refused us.
    """
    config = ClientConfig.from_params(params)
    store_ttl = int_option(params, "store_ttl", DEFAULT_STORE_TTL, 0)
    store_prefix = _keys.store_dir(config.key_prefix, params.run_id)  # validates run_id

    backend_cls: Any = EtcdRendezvousBackend
    store_cls: Any = EtcdStore
    if torch_available():
        from . import torch as torch_integration

        backend_cls = torch_integration.TorchEtcdRendezvousBackend
        store_cls = torch_integration.TorchEtcdStore

    kv = connect(config)
    backend = backend_cls(kv, params.run_id, key_prefix=config.key_prefix, name=params.backend)
    store = store_cls(kv, store_prefix, ttl=store_ttl)
    return backend, store


def create_handler(params: ParamsLike, *, use_torch: bool | None = None) -> EtcdRendezvousHandler:
    """The native rendezvous handler for ``params`` (backend name ``etcd-rdzv``).

    With torch (``use_torch=None``: when it is installed) it is also torch's
    ``RendezvousHandler`` and ``next_rendezvous()`` returns torch's ``RendezvousInfo``;
    without, it returns :class:`etcd_rdzv.handler.RendezvousResult` and torch is not
    imported (``use_torch=False`` saves its import time in tools that do not need it).

    Raises:
        ValueError: a bad option, before any network call.
        RendezvousConnectionError: etcd is unreachable or refused us.
    """
    config = ClientConfig.from_params(params)
    settings = HandlerSettings.from_params(params, config.key_prefix)
    store_ttl = int_option(params, "store_ttl", DEFAULT_STORE_TTL, 0)

    handler_cls: Any = EtcdRendezvousHandler
    store_cls: Any = EtcdStore
    if use_torch is None:
        use_torch = torch_available()
    if use_torch:
        from . import torch as torch_integration

        handler_cls = torch_integration.TorchEtcdRendezvousHandler
        store_cls = torch_integration.TorchEtcdStore

    kv = connect(config)

    def store_factory(prefix: str) -> EtcdStore:
        store: EtcdStore = store_cls(kv, prefix, ttl=store_ttl)
        return store

    handler: EtcdRendezvousHandler = handler_cls(
        kv, settings, store_factory, local_addr=params.local_addr
    )
    return handler
