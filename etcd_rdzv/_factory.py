"""The ways in: the factories (the backend and store of a run, the native handler,
from rendezvous parameters) and the ``torchrun.handlers`` entry points.

Options are parsed once (:class:`etcd_rdzv.config.params.Settings`), before any network call;
then one client is connected and the objects are built over it. torch is imported
only when asked for: by ``create_backend`` where torch is installed (its objects are
then torch's types too), by ``create_handler(params, use_torch=True)``, and by the
entry points' creators when torch calls them. torch loads the entry points while it is
still importing its rendezvous package, so this module must not import torch (or
:mod:`etcd_rdzv.torch`) at import time.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from .backend import EtcdRendezvousBackend
from .config.params import ParamsLike, Settings
from .rendezvous import EtcdRendezvousHandler
from .rendezvous.listener import EVENTS
from .store import EtcdStore

__all__ = [
    "create_backend",
    "create_handler",
    "dynamic_handler",
    "handler",
    "handler_from_settings",
    "import_name_handler",
    "show_logs_under_torchrun",
    "static_handler",
    "torch_available",
]


def torch_available() -> bool:
    """Whether torch can be imported (checked without importing it)."""
    return importlib.util.find_spec("torch") is not None


def create_backend(params: ParamsLike) -> tuple[EtcdRendezvousBackend, EtcdStore]:
    """The rendezvous backend and the store of ``params.run_id``.

    With torch installed the store is also a ``torch.distributed.Store`` and the
    backend a torch ``RendezvousBackend`` (see :mod:`etcd_rdzv.torch`). The backend's
    ``name`` is ``params.backend``, as torch's handler registry requires.

    Options read besides the client's: ``store_ttl`` (seconds a store key lives after
    its last write, ``0`` for no expiry; the default is in docs/configuration.md).

    Raises:
        ValueError: a bad option or run id, before any network call.
        RendezvousConnectionError: etcd is unreachable or refused us.
    """
    settings = Settings.from_params(params)
    backend_cls: Any = EtcdRendezvousBackend
    store_cls: Any = EtcdStore
    if torch_available():
        from . import torch as torch_integration

        backend_cls = torch_integration.TorchEtcdRendezvousBackend
        store_cls = torch_integration.TorchEtcdStore
    return backend_cls.from_settings(settings, store_cls)  # type: ignore[no-any-return]


def create_handler(params: ParamsLike, *, use_torch: bool = False) -> EtcdRendezvousHandler:
    """The native rendezvous handler for ``params`` (backend name ``etcd-rdzv``), or
    the static one when ``params.backend`` is ``etcd-rdzv-static`` (each node's rank
    from the ``rank`` option or the scheduler's variables; the world is ``max_nodes``).

    ``next_rendezvous()`` returns :class:`etcd_rdzv.RendezvousResult`, and torch is
    not imported, whether or not it is installed. ``use_torch=True`` builds the torch
    flavour instead (what ``torchrun --rdzv-backend=etcd-rdzv`` runs): also torch's
    ``RendezvousHandler``, returning torch's ``RendezvousInfo``, with stores that are
    ``torch.distributed.Store`` s (see :func:`etcd_rdzv.torch.create_native_handler`).

    Raises:
        ValueError: a bad option, before any network call.
        RendezvousConnectionError: etcd is unreachable or refused us.
    """
    return handler_from_settings(Settings.from_params(params), use_torch=use_torch)


def handler_from_settings(settings: Settings, *, use_torch: bool = False) -> EtcdRendezvousHandler:
    """The handler of :func:`create_handler` for options already parsed (the command
    line parses them once, for its own checks and the handler).

    Raises:
        RendezvousConnectionError: etcd is unreachable or refused us.
    """
    if use_torch:
        from . import torch as torch_integration

        return torch_integration.build_native_handler(settings)
    return EtcdRendezvousHandler.from_settings(settings)


# -- the torchrun.handlers entry points ------------------------------------------------

_PACKAGE_LOGGER = "etcd_rdzv"


def show_logs_under_torchrun() -> None:
    """Make etcd_rdzv's log lines visible in the agent's log, as torch's own are.

    The package logs through a ``NullHandler`` and torch's launcher configures only
    its own ``torch`` logger, so without this a closed run's ERROR, the join's
    progress and every warning would be lost under torchrun. Adds one stderr handler
    to the package's logger at ``$LOGLEVEL`` (torch's variable; default WARNING), and
    shows the events a person follows a job by (``etcd_rdzv.events``: a round formed,
    a member gone, a join still waiting) at INFO while ``$LOGLEVEL`` is unset (at
    ``$LOGLEVEL`` when it is set). Nothing, unless the application configured logging
    itself (a handler on our logger or on the root): its configuration decides.
    """
    logger = logging.getLogger(_PACKAGE_LOGGER)
    own = [h for h in logger.handlers if not isinstance(h, logging.NullHandler)]
    if own or logging.getLogger().handlers:
        return
    chosen = os.environ.get("LOGLEVEL", "").strip().upper()
    level = logging.getLevelName(chosen or "WARNING")
    level = level if isinstance(level, int) else logging.WARNING
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logging.getLogger(EVENTS).setLevel(level if chosen else logging.INFO)


def _create_dynamic_handler(params: Any) -> Any:
    from .torch import create_dynamic_handler, exit_gracefully, warn_without_restarts

    show_logs_under_torchrun()
    handler = create_dynamic_handler(params)
    warn_without_restarts(handler.get_run_id(), params.max_nodes)
    # A spare whose job ended must end its torchrun with status 0: torch's launcher
    # fails on the None its agent returns after a RendezvousGracefulExitError.
    return exit_gracefully(handler)


def dynamic_handler() -> Callable[[Any], Any]:
    """``etcd-rdzv-dynamic``: torch's ``DynamicRendezvousHandler`` over our backend and store."""
    return _create_dynamic_handler


def _create_handler(params: Any, static: bool = False) -> Any:
    from .torch import (
        create_native_handler,
        create_static_handler,
        exit_gracefully,
        warn_without_restarts,
    )

    show_logs_under_torchrun()
    handler = create_static_handler(params) if static else create_native_handler(params)
    handler.launcher_restarts = warn_without_restarts(params.run_id, handler.settings.max_nodes)
    # torch's launcher calls shutdown() when the agent is done; torch's handlers then
    # close the run, and so must we (late agents must not start the job again).
    handler.close_on_shutdown = True
    # A spare whose job ended must end its torchrun with status 0 (as above).
    return exit_gracefully(handler)


def handler() -> Callable[[Any], Any]:
    """``etcd-rdzv``: the native etcd rendezvous handler."""
    return _create_handler


def _create_static_handler(params: Any) -> Any:
    return _create_handler(params, static=True)


def static_handler() -> Callable[[Any], Any]:
    """``etcd-rdzv-static``: the static handler (each node's rank given, world = max_nodes)."""
    return _create_static_handler


# -- the import name given as a backend (torchrun entry point ``etcd_rdzv``) -------------


def _refuse_import_name(params: Any) -> Any:
    backend = getattr(params, "backend", "etcd_rdzv")
    raise ValueError(
        f"The rendezvous backend {backend!r} is the Python package's import name; the "
        "backend is named etcd-rdzv (or etcd-rdzv-dynamic, torch's dynamic handler over "
        "etcd, or etcd-rdzv-static, fixed ranks): use --rdzv-backend=etcd-rdzv."
    )


def import_name_handler() -> Any:
    """The ``torchrun.handlers`` entry point ``etcd_rdzv``: a creator that refuses with
    the backend's real names, so ``--rdzv-backend=etcd_rdzv`` (the import name) gets
    a hint instead of torch's bare "not registered". Here, not in :mod:`etcd_rdzv.torch`:
    torch loads every entry point while it imports its rendezvous package."""
    return _refuse_import_name
