"""The public surface, pickling of errors, key layout, and that torch stays optional."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

import etcd_rdzv
from etcd_rdzv import _keys, errors


def test_all_is_exactly_the_public_api() -> None:
    public = {
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
    }
    assert set(etcd_rdzv.__all__) == public
    assert len(etcd_rdzv.__all__) == len(public), "a name is listed twice"
    for name in etcd_rdzv.__all__:
        assert hasattr(etcd_rdzv, name), name


def test_import_does_not_import_torch_or_python_etcd() -> None:
    code = "import sys, etcd_rdzv; print([m in sys.modules for m in ('torch', 'etcd', 'urllib3')])"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[False, False, False]"


@pytest.mark.parametrize(
    "cls",
    [
        errors.RendezvousError,
        errors.RendezvousConnectionError,
        errors.RendezvousStateError,
        errors.RendezvousTimeoutError,
        errors.RendezvousClosedError,
        errors.RendezvousGracefulExitError,
        errors.StoreTimeoutError,
        errors.StoreQueueEmptyError,
    ],
)
def test_errors_pickle(cls: type[Exception]) -> None:
    exc = cls("etcd at http://h:1 said no")
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert back.args == exc.args
    assert isinstance(back, errors.RendezvousError)


def test_store_timeout_is_a_lookup_error() -> None:
    assert issubclass(errors.StoreTimeoutError, LookupError)
    assert issubclass(errors.StoreTimeoutError, errors.RendezvousTimeoutError)


@pytest.mark.parametrize(
    ("run_id", "segment"),
    [
        ("job-1.a_b", "job-1.a_b"),
        ("a/b", "~YS9i"),
        ("with space", "~d2l0aCBzcGFjZQ"),
        ("naïve", "~bmHDr3Zl"),
        ("..", "~Li4"),
    ],
)
def test_run_ids_map_to_one_safe_segment(run_id: str, segment: str) -> None:
    assert _keys.run_dir("/p", run_id) == f"/p/{segment}"


def test_run_id_mapping_is_injective_for_tricky_ids() -> None:
    ids = ["a/b", "a_b", "~YS9i", "a b", "a%20b", "A/B", "a//b"]
    dirs = {_keys.run_dir("/p", i) for i in ids}
    assert len(dirs) == len(ids)


def test_empty_run_id_rejected() -> None:
    with pytest.raises(ValueError, match="run id"):
        _keys.run_dir("/p", "")
