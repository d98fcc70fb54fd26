"""Entry points torch discovers (group ``torchrun.handlers``).

torch loads these while it is still importing its rendezvous package, so this module
must not import torch (or :mod:`etcd_rdzv.torch`) at import time: the creators import
it when torch first calls them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _create_dynamic_handler(params: Any) -> Any:
    from .torch import create_dynamic_handler

    return create_dynamic_handler(params)


def dynamic_handler() -> Callable[[Any], Any]:
    """``etcd-rdzv-dynamic``: torch's ``DynamicRendezvousHandler`` over our backend and store."""
    return _create_dynamic_handler


def _create_handler(params: Any) -> Any:
    from . import create_handler

    handler = create_handler(params)
    # torch's launcher calls shutdown() when the agent is done; torch's handlers then
    # close the run, and so must we (late agents must not start the job again).
    handler.close_on_shutdown = True
    return handler


def handler() -> Callable[[Any], Any]:
    """``etcd-rdzv``: the native etcd rendezvous handler."""
    return _create_handler
