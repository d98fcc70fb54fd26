"""Points torch's own agent and launcher tests at one rendezvous backend.

``python -m benchmarks.torch_suite`` puts this directory first on ``PYTHONPATH``, so
every Python process of a run (pytest, the agents it forks or spawns, their workers)
loads this module at start-up. With ``ETCD_RDZV_TORCH_SUITE_BACKEND`` set, it waits for
torch's ``torch.distributed.elastic.rendezvous.api`` to be imported (nothing is
imported here before) and wraps ``RendezvousHandlerRegistry.create_handler``: a
handler asked for under ``etcd``, ``etcd-v2`` or ``c10d`` is built by the backend
under test instead, on the run's etcd (``ETCD_RDZV_TORCH_SUITE_ENDPOINT``). Under
``c10d`` itself, a test that asked for an etcd handler gets a c10d store at a port
derived from its run id (every agent of the test derives the same one). Torch's test
files are run unchanged.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import zlib
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

_BACKEND = os.environ.get("ETCD_RDZV_TORCH_SUITE_BACKEND", "")
_API = "torch.distributed.elastic.rendezvous.api"
_ASKED = ("etcd", "etcd-v2", "c10d")  # the backends torch's tests ask for


def _redirect(params: Any) -> None:
    asked = params.backend
    if asked not in _ASKED:
        return  # "static" and the like: not a rendezvous backend under test
    if _BACKEND == "c10d":
        if asked != "c10d":
            port = 20000 + zlib.crc32(str(params.run_id).encode()) % 20000
            params.backend, params.endpoint = "c10d", f"localhost:{port}"
        return
    params.backend = _BACKEND
    params.endpoint = os.environ["ETCD_RDZV_TORCH_SUITE_ENDPOINT"]


def _patch(module: ModuleType) -> None:
    registry = module.RendezvousHandlerRegistry
    create = registry.create_handler

    def create_handler(self: Any, params: Any) -> Any:
        _redirect(params)
        return create(self, params)

    registry.create_handler = create_handler


class _Finder(importlib.abc.MetaPathFinder):
    """Finds torch's rendezvous API module as usual, and patches it once loaded."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != _API:
            return None
        sys.meta_path.remove(self)  # once
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            _patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if _BACKEND:
    sys.meta_path.insert(0, _Finder())
