"""PyTorch integration; the only module of etcd_rdzv that imports torch.

Importing it (``create_backend`` does when torch is installed):

* makes our exceptions also torch's: ``RendezvousConnectionError()`` then builds an
  instance of :class:`TorchRendezvousConnectionError`, which is both
  ``etcd_rdzv.RendezvousConnectionError`` and torch's class of that name; a store
  timeout is also a ``torch.distributed.DistStoreError``, like c10d's own stores';
* provides :class:`TorchEtcdStore` (a real ``torch.distributed.Store``: it works with
  ``PrefixStore`` and ``init_process_group``) and :class:`TorchEtcdRendezvousBackend`;
* provides :func:`create_dynamic_handler`, behind the ``torchrun.handlers`` entry point
  ``etcd-rdzv-dynamic``: torch's own ``DynamicRendezvousHandler`` over our backend and
  store.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.distributed_c10d import Store as TorchStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
)
from torch.distributed.elastic.rendezvous import api as torch_api
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    create_handler,
)

from . import errors
from ._factory import create_backend
from .backend import EtcdRendezvousBackend
from .handler import EtcdRendezvousHandler
from .params import ParamsLike
from .store import EtcdStore

__all__ = [
    "DYNAMIC_HANDLER_NAME",
    "TorchEtcdRendezvousBackend",
    "TorchEtcdRendezvousHandler",
    "TorchEtcdStore",
    "create_dynamic_handler",
]

DYNAMIC_HANDLER_NAME = "etcd-rdzv-dynamic"


class TorchRendezvousError(errors.RendezvousError, torch_api.RendezvousError):
    """etcd_rdzv's root error, also torch's ``RendezvousError``."""


class TorchRendezvousConnectionError(
    errors.RendezvousConnectionError, torch_api.RendezvousConnectionError
):
    """Also torch's ``RendezvousConnectionError``."""


class TorchRendezvousStateError(errors.RendezvousStateError, torch_api.RendezvousStateError):
    """Also torch's ``RendezvousStateError``."""


class TorchRendezvousTimeoutError(errors.RendezvousTimeoutError, torch_api.RendezvousTimeoutError):
    """Also torch's ``RendezvousTimeoutError``."""


class TorchRendezvousClosedError(errors.RendezvousClosedError, torch_api.RendezvousClosedError):
    """Also torch's ``RendezvousClosedError``."""


class TorchRendezvousGracefulExitError(
    errors.RendezvousGracefulExitError, torch_api.RendezvousGracefulExitError
):
    """Also torch's ``RendezvousGracefulExitError``."""


class TorchStoreTimeoutError(
    errors.StoreTimeoutError, torch_api.RendezvousTimeoutError, dist.DistStoreError
):
    """A store timeout that is also torch's ``DistStoreError`` (what c10d stores raise)."""


errors._torch_flavours.update(
    {
        errors.RendezvousError: TorchRendezvousError,
        errors.RendezvousConnectionError: TorchRendezvousConnectionError,
        errors.RendezvousStateError: TorchRendezvousStateError,
        errors.RendezvousTimeoutError: TorchRendezvousTimeoutError,
        errors.RendezvousClosedError: TorchRendezvousClosedError,
        errors.RendezvousGracefulExitError: TorchRendezvousGracefulExitError,
        errors.StoreTimeoutError: TorchStoreTimeoutError,
    }
)


class TorchEtcdStore(EtcdStore, TorchStore):
    """:class:`~etcd_rdzv.EtcdStore` that is also a ``torch.distributed.Store``."""

    # torch sets the timeout on the C++ side directly (PrefixStore.set_timeout and
    # torch.distributed's store_timeout() forward to it past Python), so the C++ value
    # is the one source of truth. ``None`` (wait forever) is stored as a century.
    # A C++ timeout of 0 keeps our meaning: do not wait.
    _FOREVER = timedelta(days=365 * 100)

    @property
    def _timeout_s(self) -> float | None:
        cpp: timedelta = TorchStore.__dict__["timeout"].__get__(self)
        return None if cpp >= self._FOREVER else cpp.total_seconds()

    @_timeout_s.setter
    def _timeout_s(self, seconds: float | None) -> None:
        cpp = self._FOREVER if seconds is None else timedelta(seconds=seconds)
        TorchStore.set_timeout(self, cpp)

    # torch's C++ side calls these names on Python stores (PrefixStore, process groups).
    def getNumKeys(self) -> int:
        return self.num_keys()

    def deleteKey(self, key: str) -> bool:
        return self.delete_key(key)

    def has_extended_api(self) -> bool:
        """We implement ``append``, ``multi_get`` and ``multi_set`` natively."""
        return True


class TorchEtcdRendezvousBackend(EtcdRendezvousBackend, RendezvousBackend):
    """:class:`~etcd_rdzv.EtcdRendezvousBackend` that is also torch's ``RendezvousBackend``."""


def create_dynamic_handler(params: ParamsLike) -> RendezvousHandler:
    """torch's ``DynamicRendezvousHandler`` over our backend and store.

    Reads torch's handler options (``join_timeout``, ``last_call_timeout``,
    ``close_timeout``, ``heartbeat_timeout``, ``keep_alive_interval``,
    ``keep_alive_max_attempt``) besides ours.
    """
    backend, store = create_backend(params)
    handler: RendezvousHandler = create_handler(store, backend, params)  # type: ignore[arg-type]
    return handler


class TorchEtcdRendezvousHandler(EtcdRendezvousHandler, RendezvousHandler):
    """The native handler as torch's ``RendezvousHandler`` (torchrun name ``etcd-rdzv``)."""

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round; torch's ``RendezvousInfo`` with bootstrap store info.

        Rank 0 picks a free port on its address and publishes ``MASTER_ADDR`` and
        ``MASTER_PORT`` in the round's store; workers bootstrap from those.
        """
        result = EtcdRendezvousHandler.next_rendezvous(self)
        bootstrap = RendezvousStoreInfo.build(result.rank, result.store, local_addr=self._addr)
        return RendezvousInfo(result.store, result.rank, result.world_size, bootstrap)
