"""The harness that runs torch's agent and launcher tests on our backends
(``benchmarks/torch_suite.py``): which tests it runs, and where its start-up hook
sends a handler that torch's tests ask for."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from types import ModuleType, SimpleNamespace

import pytest

from benchmarks.torch_suite import SITE, select

AGENT = "test/a_test.py::T::"
Hook = Callable[[str], ModuleType]


def test_each_test_runs_once_preferring_its_etcd_variant() -> None:
    nodes = [
        AGENT + "test_x_c10d",
        AGENT + "test_x_etcd",
        AGENT + "test_x_etcd_v2",
        AGENT + "test_y_etcd_v2",
        AGENT + "test_y_c10d",
        AGENT + "test_z_c10d",
        AGENT + "test_plain",
    ]
    assert select(nodes) == [
        AGENT + "test_plain",
        AGENT + "test_x_etcd",
        AGENT + "test_y_c10d",
        AGENT + "test_z_c10d",
    ]


@pytest.fixture
def load_hook(monkeypatch: pytest.MonkeyPatch) -> Iterator[Hook]:
    loaded: list[ModuleType] = []

    def load(backend: str) -> ModuleType:
        monkeypatch.setenv("ETCD_RDZV_TORCH_SUITE_BACKEND", backend)
        monkeypatch.setenv("ETCD_RDZV_TORCH_SUITE_ENDPOINT", "127.0.0.1:1234")
        spec = importlib.util.spec_from_file_location(
            f"_suite_hook_{len(loaded)}", SITE / "sitecustomize.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        loaded.append(module)
        return module

    yield load
    for module in loaded:  # this process's imports stay torch's own
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, module._Finder)]


def _params(backend: str, run_id: str = "r1") -> SimpleNamespace:
    return SimpleNamespace(backend=backend, endpoint="localhost:29400", run_id=run_id)


@pytest.mark.parametrize("backend", ["etcd-rdzv", "etcd-rdzv-dynamic"])
def test_the_hook_sends_every_asked_backend_to_ours(load_hook: Hook, backend: str) -> None:
    hook = load_hook(backend)
    for asked in ("etcd", "etcd-v2", "c10d"):
        params = _params(asked)
        hook._redirect(params)
        assert (params.backend, params.endpoint) == (backend, "127.0.0.1:1234")
    static = _params("static")
    hook._redirect(static)
    assert (static.backend, static.endpoint) == ("static", "localhost:29400")


def test_under_c10d_an_etcd_test_gets_one_port_per_run(load_hook: Hook) -> None:
    hook = load_hook("c10d")
    a, b, other = _params("etcd"), _params("etcd-v2"), _params("etcd", "r2")
    for params in (a, b, other):
        hook._redirect(params)
    assert a.backend == b.backend == "c10d"
    assert a.endpoint == b.endpoint != other.endpoint
    c10d = _params("c10d")
    hook._redirect(c10d)
    assert c10d.endpoint == "localhost:29400"
