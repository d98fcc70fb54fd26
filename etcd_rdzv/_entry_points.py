"""Entry points torch discovers (group ``torchrun.handlers``).

torch loads these while it is still importing its rendezvous package, so this module
must not import torch (or :mod:`etcd_rdzv.torch`) at import time: the creators import
it when torch first calls them.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

_PACKAGE_LOGGER = "etcd_rdzv"


def show_logs_under_torchrun() -> None:
    """Make etcd_rdzv's log lines visible in the agent's log, as torch's own are.

    The package logs through a ``NullHandler`` and torch's launcher configures only
    its own ``torch`` logger, so without this a closed run's ERROR, the join's
    progress and every warning would be lost under torchrun. Adds one stderr handler
    at ``$LOGLEVEL`` (torch's variable; default WARNING), unless the application
    configured logging itself (a handler on our logger or on the root).
    """
    logger = logging.getLogger(_PACKAGE_LOGGER)
    own = [h for h in logger.handlers if not isinstance(h, logging.NullHandler)]
    if own or logging.getLogger().handlers:
        return
    level = logging.getLevelName(os.environ.get("LOGLEVEL", "WARNING").strip().upper())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level if isinstance(level, int) else logging.WARNING)


def _create_dynamic_handler(params: Any) -> Any:
    from .torch import create_dynamic_handler

    show_logs_under_torchrun()
    return create_dynamic_handler(params)


def dynamic_handler() -> Callable[[Any], Any]:
    """``etcd-rdzv-dynamic``: torch's ``DynamicRendezvousHandler`` over our backend and store."""
    return _create_dynamic_handler


def _create_handler(params: Any, static: bool = False) -> Any:
    from .torch import create_native_handler, create_static_handler

    show_logs_under_torchrun()
    handler = create_static_handler(params) if static else create_native_handler(params)
    # torch's launcher calls shutdown() when the agent is done; torch's handlers then
    # close the run, and so must we (late agents must not start the job again).
    handler.close_on_shutdown = True
    return handler


def handler() -> Callable[[Any], Any]:
    """``etcd-rdzv``: the native etcd rendezvous handler."""
    return _create_handler


def _create_static_handler(params: Any) -> Any:
    return _create_handler(params, static=True)


def static_handler() -> Callable[[Any], Any]:
    """``etcd-rdzv-static``: the static handler (each node's rank given, world = max_nodes)."""
    return _create_static_handler
