"""Our errors are torch's types wherever torch is loaded, however the object was built.

The processes here control their import order: torch's rendezvous package first or
etcd_rdzv first, ``etcd_rdzv.torch`` never imported, objects built by hand (a backend
over ``create_client``, a plain ``EtcdStore``) or by ``create_handler``. And a process
that never imports torch never loads it, whatever errors it raises and pickles.
"""

from __future__ import annotations

import json
import logging
import pickle
import subprocess
import sys
import threading
import types
import uuid
from collections.abc import Callable
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv import errors
from etcd_rdzv.testing import EtcdServer
from fleet import child_env

pytestmark = pytest.mark.torch

Params = Callable[..., etcd_rdzv.RendezvousParameters]

ALL_ERRORS = [getattr(errors, name) for name in errors.__all__]

# Builds the objects by hand, raises through each, prints what it caught as JSON.
# argv: the import order ("torch-first" or "etcd-first") and the parameters.
_BY_HAND = """
import json, pickle, sys

order, spec = sys.argv[1], json.loads(sys.argv[2])
if order == "torch-first":
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import api

import etcd_rdzv
from etcd_rdzv.backend import EtcdRendezvousBackend
from etcd_rdzv.store import EtcdStore

config = spec["config"]
params = etcd_rdzv.RendezvousParameters(
    "etcd-rdzv", spec["endpoint"], spec["run_id"], 1, 1, **config
)
kv = etcd_rdzv.create_client(params)
backend = EtcdRendezvousBackend(kv, spec["run_id"], key_prefix=config["key_prefix"])
store = EtcdStore(kv, config["key_prefix"] + "/by-hand-store", timeout=0.5)
handler = etcd_rdzv.create_handler(params)
handler.set_closed()
kv.put(backend.key, "this is not base64!", None)

if order == "etcd-first":
    # Everything above was built before torch was loaded.
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import api

seen = {}
try:
    backend.get_state()
except api.RendezvousStateError as exc:
    back = pickle.loads(pickle.dumps(exc))
    seen["state"] = {
        "ours": isinstance(exc, etcd_rdzv.RendezvousStateError),
        "torch_root": isinstance(exc, api.RendezvousError),
        "pickled": type(back) is type(exc) and back.args == exc.args,
        "message": str(exc),
    }
try:
    store.get("never-set")
except dist.DistStoreError as exc:
    seen["store"] = {
        "ours": isinstance(exc, etcd_rdzv.StoreTimeoutError),
        "torch_timeout": isinstance(exc, api.RendezvousTimeoutError),
        "lookup": isinstance(exc, LookupError),
        "message": str(exc),
    }
try:
    handler.next_rendezvous()
except api.RendezvousClosedError as exc:
    seen["closed"] = {"ours": isinstance(exc, etcd_rdzv.RendezvousClosedError)}
seen["etcd_rdzv.torch imported"] = "etcd_rdzv.torch" in sys.modules
handler.shutdown()
kv.close()
print(json.dumps(seen))
"""

# Raises, catches and pickles each of our errors, and a real store timeout, without
# importing torch; prints what it saw.
_NO_TORCH = """
import json, pickle, sys

import etcd_rdzv
from etcd_rdzv import errors
from etcd_rdzv.store import EtcdStore

spec = json.loads(sys.argv[1])
plain = []
for name in errors.__all__:
    cls = getattr(errors, name)
    try:
        raise cls("no torch here")
    except etcd_rdzv.RendezvousError as exc:
        back = pickle.loads(pickle.dumps(exc))
        plain.append(type(exc) is cls and type(back) is cls)
params = etcd_rdzv.RendezvousParameters(
    "etcd-rdzv", spec["endpoint"], spec["run_id"], 1, 1, **spec["config"]
)
kv = etcd_rdzv.create_client(params)
store = EtcdStore(kv, spec["config"]["key_prefix"] + "/no-torch-store", timeout=0.2)
try:
    store.get("never-set")
except etcd_rdzv.StoreTimeoutError as exc:
    plain.append(type(exc) is errors.StoreTimeoutError)
kv.close()
print(json.dumps({
    "plain": plain,
    "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
}))
"""


def _spec(params: etcd_rdzv.RendezvousParameters) -> str:
    return json.dumps(
        {"endpoint": params.endpoint, "run_id": params.run_id, "config": dict(params.config)}
    )


def _run(code: str, *args: str) -> Any:
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("order", ["torch-first", "etcd-first"])
def test_objects_built_by_hand_raise_torchs_types(
    torch_required: None, etcd_params: Params, order: str
) -> None:
    params = etcd_params(f"by-hand-{uuid.uuid4().hex[:8]}", join_timeout=10)
    seen = _run(_BY_HAND, order, _spec(params))

    assert seen["state"] == {
        "ours": True,
        "torch_root": True,
        "pickled": True,
        "message": seen["state"]["message"],
    }
    assert "not valid base64" in seen["state"]["message"]
    assert seen["store"]["ours"] and seen["store"]["torch_timeout"] and seen["store"]["lookup"]
    assert "timeout" in seen["store"]["message"].lower()
    assert "never-set" in seen["store"]["message"]
    assert seen["closed"] == {"ours": True}
    # The flavours came without the torch integration module.
    assert seen["etcd_rdzv.torch imported"] is False


def test_a_process_without_torch_never_loads_it(torch_required: None, etcd_params: Params) -> None:
    # torch is installed (torch_required): a process that does not import it must
    # still never get it, whatever errors it raises, catches and pickles.
    seen = _run(_NO_TORCH, _spec(etcd_params("no-torch")))
    assert seen["plain"] == [True] * (len(ALL_ERRORS) + 1)
    assert seen["torch"] == []


# -- in this process (torch's classes are loaded here) ----------------------------------


def test_every_error_is_torchs_here(torch_required: None) -> None:
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import api

    queue_empty = getattr(dist, "QueueEmptyError", None)
    expected: dict[type[Exception], tuple[type[BaseException], ...]] = {
        errors.RendezvousError: (api.RendezvousError,),
        errors.RendezvousConnectionError: (api.RendezvousConnectionError,),
        errors.RendezvousStateError: (api.RendezvousStateError,),
        errors.RendezvousTimeoutError: (api.RendezvousTimeoutError,),
        errors.RendezvousClosedError: (api.RendezvousClosedError,),
        errors.RendezvousGracefulExitError: (api.RendezvousGracefulExitError,),
        errors.StoreTimeoutError: (api.RendezvousTimeoutError, dist.DistStoreError, LookupError),
        # torch 2.6 has no QueueEmptyError: there the error stays ours alone.
        errors.StoreQueueEmptyError: (queue_empty, LookupError) if queue_empty else (LookupError,),
    }
    assert set(expected) == set(ALL_ERRORS)
    for cls, theirs in expected.items():
        exc = cls("message")
        assert isinstance(exc, cls) and isinstance(exc, theirs), (cls, type(exc).__mro__)
        assert exc.args == ("message",)
        flavoured = cls is not errors.StoreQueueEmptyError or queue_empty is not None
        assert type(exc).__name__ == (f"Torch{cls.__name__}" if flavoured else cls.__name__)
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and back.args == exc.args


def test_one_flavour_per_class_across_threads(torch_required: None) -> None:
    from torch.distributed.elastic.rendezvous import api

    # A subclass nobody registered stands for what its parent stands for.
    class Mine(errors.RendezvousStateError):
        pass

    classes = [*ALL_ERRORS, Mine]
    built: list[Exception] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def build() -> None:
        start.wait()
        mine = [cls(f"from {threading.get_ident()}") for cls in classes for _ in range(50)]
        with lock:
            built.extend(mine)

    threads = [threading.Thread(target=build) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for cls in classes:
        # One class per kind: its torch flavour, or (no torch twin) the class itself.
        kinds = {
            type(e) for e in built if getattr(type(e), "_etcd_rdzv_flavour_of", type(e)) is cls
        }
        assert len(kinds) == 1, (cls, kinds)
    mine = Mine("x")
    assert isinstance(mine, api.RendezvousStateError) and isinstance(mine, Mine)


def test_pickle_keeps_attributes(torch_required: None) -> None:
    exc = errors.RendezvousConnectionError("etcd at http://h:1 said no")
    exc.endpoint = "http://h:1"  # type: ignore[attr-defined]
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert vars(back) == {"endpoint": "http://h:1"}


def test_a_half_loaded_torch_module_gives_what_is_there(
    torch_required: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch module still being imported may lack its classes: whatever is there is
    used, nothing raises."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import api

    half = types.ModuleType("torch.distributed.elastic.rendezvous.api")
    monkeypatch.setitem(sys.modules, "torch.distributed.elastic.rendezvous.api", half)
    state = errors.RendezvousStateError("x")
    assert type(state) is errors.RendezvousStateError
    timeout = errors.StoreTimeoutError("x")
    assert isinstance(timeout, dist.DistStoreError)
    assert not isinstance(timeout, api.RendezvousTimeoutError)


def test_a_torch_class_that_cannot_be_combined_gives_ours(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Should torch's classes ever clash with ours (two C layouts), building an error
    still works: it is our plain class, and a warning says why."""

    class A(OSError):
        pass

    class B(SyntaxError):
        pass

    caplog.set_level(logging.WARNING, logger="etcd_rdzv.errors")
    assert errors._make_flavour(errors.StoreTimeoutError, (A, B)) is errors.StoreTimeoutError
    assert "cannot also be torch's" in caplog.text


def test_the_handler_raises_torchs_closed_error(
    torch_required: None, etcd_server: EtcdServer, etcd_params: Params
) -> None:
    """create_handler (not the torch flavour) in a process with torch loaded."""
    from torch.distributed.elastic.rendezvous import api

    handler = etcd_rdzv.create_handler(etcd_params("closed-native", join_timeout=10))
    try:
        handler.set_closed()
        with pytest.raises(api.RendezvousClosedError) as info:
            handler.next_rendezvous()
        assert isinstance(info.value, etcd_rdzv.RendezvousClosedError)
    finally:
        handler.shutdown()
