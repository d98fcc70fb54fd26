"""docker-compose.yml: the 3-member cluster operators start to try the package.

Brought up with docker-compose (v1, as Debian packages it) under a project name and
host ports of its own, used for a rendezvous of 3 processes (``etcd-rdzv demo``) and
a store round trip across members, and always taken down again (``down -v``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import etcd_rdzv
from etcd_rdzv.testing import EtcdRdzvCli
from etcd_rdzv.testing.pytest_plugin import skip_or_fail

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "docker-compose.yml"
TIMEOUT = 120  # seconds any one docker-compose or CLI call may take


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _healthy(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=1) as resp:
            return bool(json.loads(resp.read()).get("health") == "true")
    except (OSError, ValueError):
        return False


def _compose_tool() -> str:
    tool = shutil.which("docker-compose")
    if tool:
        return tool
    skip_or_fail(
        "docker-compose is not installed (Debian: apt-get install docker-compose)",
        require="ETCD_RDZV_REQUIRE_DOCKER",
    )


@pytest.fixture
def compose_endpoints(etcd_container_image: str) -> Iterator[list[str]]:
    """The client endpoints of the compose cluster, up and healthy."""
    project = f"etcdrdzvtest{uuid.uuid4().hex[:10]}"
    ports = _free_ports(3)
    env = dict(os.environ)
    env["ETCD_IMAGE"] = etcd_container_image
    env.update({f"ETCD{i + 1}_PORT": str(port) for i, port in enumerate(ports)})
    base = [_compose_tool(), "-p", project, "-f", str(COMPOSE_FILE)]

    def compose(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*base, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
            stdin=subprocess.DEVNULL,
        )

    try:
        up = compose("up", "-d")
        assert up.returncode == 0, up.stdout + up.stderr
        endpoints = [f"127.0.0.1:{port}" for port in ports]
        deadline = time.monotonic() + 60
        while not all(_healthy(e) for e in endpoints):
            assert time.monotonic() < deadline, compose("logs", "--tail=30").stdout
            time.sleep(0.1)
        yield endpoints
    finally:
        down = compose("down", "-v", "--remove-orphans", "-t", "0")
        assert down.returncode == 0, down.stdout + down.stderr


def _table(stdout: str) -> list[tuple[int, int, int]]:
    """(rank, world size, round) of each row of the demo's table."""
    rows = re.findall(r"^\s*\d+\s+\S+\s+(\d+)\s+(\d+)\s+(\d+)\s+[\d.]+\s*$", stdout, re.MULTILINE)
    return [(int(rank), int(size), int(rnd)) for rank, size, rnd in rows]


def test_compose_cluster_runs_a_rendezvous(
    etcd_rdzv_cli: EtcdRdzvCli, compose_endpoints: list[str], etcd_key_prefix: str
) -> None:
    first, second, third = compose_endpoints

    # One cluster of three, not three single members.
    # (the v3 gateway: the cluster serves v3 only by default, like etcd 3.6)
    request = urllib.request.Request(
        f"http://{second}/v3/cluster/member/list", data=b"{}", method="POST"
    )
    with urllib.request.urlopen(request, timeout=5) as resp:
        members = json.loads(resp.read())["members"]
    assert sorted(m["name"] for m in members) == ["etcd1", "etcd2", "etcd3"]
    assert sorted(url for m in members for url in m["clientURLs"]) == sorted(
        f"http://{e}" for e in compose_endpoints
    )

    # A write through one member is read through another.
    _, store_1 = etcd_rdzv.create_backend(
        etcd_rdzv.RendezvousParameters(
            "etcd-rdzv-dynamic", first, "store", 1, 1, key_prefix=etcd_key_prefix
        )
    )
    _, store_3 = etcd_rdzv.create_backend(
        etcd_rdzv.RendezvousParameters(
            "etcd-rdzv-dynamic", third, "store", 1, 1, key_prefix=etcd_key_prefix
        )
    )
    store_1.set("greeting", "hello")
    assert store_3.get("greeting") == b"hello"

    # 3 node processes through one rendezvous of the native handler, on all endpoints.
    done = etcd_rdzv_cli.run(
        *("demo", "--nodes", "3", "--run-id", "compose-demo"),
        *("--endpoint", ",".join(compose_endpoints), "--key-prefix", etcd_key_prefix),
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _table(done.stdout)
    assert sorted(rank for rank, _, _ in rows) == [0, 1, 2], done.stdout
    assert {(size, rnd) for _, size, rnd in rows} == {(3, 1)}
    assert re.search(r"store round-trip: .*3 of 3 members read .*: ok", done.stdout), done.stdout
