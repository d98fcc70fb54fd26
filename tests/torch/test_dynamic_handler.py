"""torch's own DynamicRendezvousHandler over our backend and store, on a real etcd.

The nodes are separate processes (:mod:`fleet`, kind ``dynamic``),
each with its own client, backend and store, as on a real cluster: they meet only
through etcd.
"""

from __future__ import annotations

import pickle
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import etcd_rdzv
from etcd_rdzv.testing import EtcdServer
from fleet import Fleet, child_env

pytestmark = pytest.mark.torch

NODES = 4
PROCESS_TIMEOUT = 90.0  # seconds for all of it, all nodes together; they normally need ~10


def test_create_backend_gives_torch_store_and_backend(
    torch_required: None, etcd_params: Callable[..., etcd_rdzv.RendezvousParameters]
) -> None:
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

    params = etcd_params("types", backend="my-registered-name")
    backend, store = etcd_rdzv.create_backend(params)

    assert isinstance(store, dist.Store)
    assert isinstance(store, etcd_rdzv.EtcdStore)
    assert isinstance(backend, RendezvousBackend)
    assert backend.name == params.backend == "my-registered-name"

    # The store works through torch's C++ PrefixStore, i.e. as a c10d store.
    prefixed = dist.PrefixStore("pfx", store)
    prefixed.set("k", b"v")
    assert prefixed.get("k") == b"v"
    assert store.get("pfx/k") == b"v"
    assert prefixed.add("n", 2) == 2
    assert prefixed.add("n", 3) == 5

    # clone() is a torch store too, on the same keys: PrefixStore works over it.
    twin = store.clone()
    assert isinstance(twin, dist.Store) and isinstance(twin, etcd_rdzv.EtcdStore)
    over_clone = dist.PrefixStore("pfx", twin)
    assert over_clone.get("k") == b"v"
    assert over_clone.add("n", 1) == 6
    assert "pfx/k" in twin.list_keys()


def test_store_timeout_is_torch_dist_store_error(
    torch_required: None, etcd_params: Callable[..., etcd_rdzv.RendezvousParameters]
) -> None:
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import api as torch_api

    _, store = etcd_rdzv.create_backend(etcd_params("store-timeout"))
    store.set_timeout(0.5)
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError) as info:
        store.get("never-set")
    assert time.monotonic() - start < 10
    assert isinstance(info.value, etcd_rdzv.StoreTimeoutError)
    assert isinstance(info.value, torch_api.RendezvousTimeoutError)
    assert "never-set" in str(info.value)
    assert "timeout" in str(info.value).lower()


def test_timeout_set_through_prefix_store_applies(
    torch_required: None, etcd_params: Callable[..., etcd_rdzv.RendezvousParameters]
) -> None:
    """torch elastic bounds barriers with ``store_timeout(rdzv_info.store, ...)``, which
    sets the timeout on the PrefixStore; c10d forwards that to the underlying store."""
    import torch.distributed as dist
    from torch.distributed.elastic.utils.store import store_timeout

    _, store = etcd_rdzv.create_backend(etcd_params("prefix-timeout"))
    store.set_timeout(2)
    prefixed = dist.PrefixStore("pfx", store)
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError), store_timeout(prefixed, 0.2):
        prefixed.get("never-set")
    elapsed = time.monotonic() - start
    assert elapsed < 1.5, f"get waited {elapsed:.1f} s, not the 0.2 s set on the PrefixStore"


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port that refuses connections: bound (so nobody else takes it), not listening."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def test_connection_error_is_torchs_and_pickles(torch_required: None, closed_port: int) -> None:
    from torch.distributed.elastic.rendezvous import api as torch_api

    import etcd_rdzv.torch  # the torch integration is active from here on

    params = etcd_rdzv.RendezvousParameters(
        "etcd-rdzv-dynamic", f"127.0.0.1:{closed_port}", "unreachable", 1, 1, read_timeout=2
    )
    start = time.monotonic()
    with pytest.raises(etcd_rdzv.RendezvousConnectionError) as info:
        etcd_rdzv.create_backend(params)
    elapsed = time.monotonic() - start
    exc = info.value

    assert elapsed < 10, f"create_backend took {elapsed:.1f} s to fail on a closed port"
    assert isinstance(exc, torch_api.RendezvousConnectionError)
    assert isinstance(exc, torch_api.RendezvousError)
    assert isinstance(exc, etcd_rdzv.RendezvousError)
    assert str(closed_port) in str(exc)

    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert back.args == exc.args
    assert isinstance(back, torch_api.RendezvousConnectionError)
    assert isinstance(back, etcd_rdzv.RendezvousConnectionError)


def test_connection_error_unpickles_as_torchs_in_a_fresh_process(
    torch_required: None, closed_port: int
) -> None:
    """torch moves errors between processes; the receiving side must still see torch's type."""
    params = etcd_rdzv.RendezvousParameters(
        "etcd-rdzv-dynamic", f"127.0.0.1:{closed_port}", "unreachable", 1, 1, read_timeout=2
    )
    with pytest.raises(etcd_rdzv.RendezvousConnectionError) as info:
        etcd_rdzv.create_backend(params)
    payload = pickle.dumps(info.value)

    code = (
        "import pickle, sys\n"
        "from torch.distributed.elastic.rendezvous import api\n"
        "import etcd_rdzv\n"
        "exc = pickle.loads(sys.stdin.buffer.read())\n"
        "print(isinstance(exc, api.RendezvousConnectionError),"
        " isinstance(exc, etcd_rdzv.RendezvousConnectionError))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        input=payload,
        capture_output=True,
        timeout=60,
        env=child_env(),
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert done.stdout.decode().split() == ["True", "True"]


def test_four_processes_rendezvous_then_all_reduce(
    torch_required: None, etcd_server: EtcdServer, etcd_key_prefix: str, tmp_path: Path
) -> None:
    run_id = f"dyn-{uuid.uuid4().hex[:8]}"
    # Each node builds its own backend and store with create_backend, and torch's
    # DynamicRendezvousHandler over them; then runs a gloo all_reduce over the store
    # the rendezvous returned.
    params = etcd_rdzv.RendezvousParameters(
        "etcd-rdzv-dynamic",
        etcd_server.endpoint,
        run_id,
        NODES,
        NODES,
        key_prefix=etcd_key_prefix,
        read_timeout=10,
        join_timeout=60,
        last_call_timeout=1,
    )
    deadline = time.monotonic() + PROCESS_TIMEOUT
    with Fleet(tmp_path) as fleet:
        nodes = [fleet.start(f"node{i}", params, kind="dynamic") for i in range(NODES)]
        fleet.ready(timeout=PROCESS_TIMEOUT)
        for node in nodes:
            node.join()
        rounds = fleet.wait_each(nodes, "round", deadline - time.monotonic())
        for node in nodes:
            node.send("allreduce")
        sums = fleet.wait_each(nodes, "allreduce", deadline - time.monotonic())
        fleet.stop(timeout=max(deadline - time.monotonic(), 1.0))
        report = fleet.describe()
        assert [n.returncode for n in nodes] == [0] * NODES, report
        assert all(n.events("exit") for n in nodes), report
        created = [n.events("ready")[0]["details"][0] for n in nodes]

    for c in created:
        assert c["store_is_torch"] is True, report
        assert c["store_type"] == "etcd_rdzv.torch.TorchEtcdStore", report
        assert c["backend_name"] == "etcd-rdzv-dynamic", report
    for r in rounds:
        assert r["backend"] == "etcd-rdzv-dynamic", report

    ranks = sorted(r["rank"] for r in rounds)
    assert ranks == list(range(NODES)), report
    assert {r["world_size"] for r in rounds} == {NODES}, report
    for r in rounds:
        assert r["store_is_prefix"] is True, report
        assert r["store_wraps_ours"] is True, report
    # Every node got the same bootstrap store (rank 0's TCPStore), published through etcd.
    assert len({r["master_port"] for r in rounds}) == 1, report

    expected = float(sum(range(1, NODES + 1)))  # ranks 0..3 contribute 1..4
    assert [s["value"] for s in sums] == [expected] * NODES, report

    # The rendezvous store really is etcd: what the nodes wrote through info.store
    # (bootstrap info, gloo's addresses) is visible to a fresh client of the run.
    _, store = etcd_rdzv.create_backend(etcd_server.params(run_id, key_prefix=etcd_key_prefix))
    round_prefix = f"torch.rendezvous.{run_id}.0"
    assert store.check([f"{round_prefix}/MASTER_ADDR", f"{round_prefix}/MASTER_PORT"])
    assert store.get(f"{round_prefix}/MASTER_PORT").decode() == str(rounds[0]["master_port"])
    assert store.num_keys() > 2


def test_store_queues_raise_torchs_errors(
    torch_required: None, etcd_params: Callable[..., etcd_rdzv.RendezvousParameters]
) -> None:
    import torch.distributed as dist

    _, store = etcd_rdzv.create_backend(etcd_params("queues"))
    store.queue_push("q", "1")
    assert (store.queue_len("q"), store.queue_pop("q")) == (1, b"1")
    # torch's QueueEmptyError (ours is also it); on torch 2.6, which has none, ours.
    with pytest.raises(getattr(dist, "QueueEmptyError", etcd_rdzv.errors.StoreQueueEmptyError)):
        store.queue_pop("q", block=False)
    store.set_timeout(0.3)
    with pytest.raises(dist.DistStoreError, match="timeout"):
        store.queue_pop("q")
