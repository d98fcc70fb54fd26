"""The package without its ``v2`` extra: ``import etcd_rdzv`` (and its test harness),
a whole v3 job and the command line in a Python where python-etcd and urllib3 are not
installed, and ``api=v2`` there refused at once with what to install.

That Python is a plain venv (``python -m venv --without-pip``: no system
site-packages, so none of this machine's python-etcd or urllib3) whose one ``.pth``
file puts this checkout on its path, as ``pip install --no-deps -e .`` would. The job
runs against the v3-only session etcd: two handlers in threads (each its own
client) form a round, share its store, and the command line shows the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import etcd_rdzv
from etcd_rdzv.testing import EtcdServer

#: The directory that holds the ``etcd_rdzv`` under test (this checkout).
CHECKOUT = Path(etcd_rdzv.__file__).resolve().parent.parent
#: The modules of the ``v2`` extra (python-etcd pulls dnspython).
EXTRA_MODULES = ("etcd", "urllib3", "dns")

# What the bare Python runs: a v3 job of two nodes, the store, the backend and the
# api=v2 refusal; one JSON line on stdout.
JOB = r"""
import importlib.util, json, socket, sys, threading

endpoint, prefix = sys.argv[1], sys.argv[2]
out = {"importable": [m for m in ("etcd", "urllib3", "dns") if importlib.util.find_spec(m)]}

import etcd_rdzv
import etcd_rdzv.testing  # the public test harness, for users' suites on v3

out["loaded"] = sorted({m.split(".")[0] for m in sys.modules} & {"etcd", "urllib3", "dns", "torch"})


def params(endpoint=endpoint, **config):
    return etcd_rdzv.RendezvousParameters(
        "etcd-rdzv", endpoint, "bare", 2, 2, key_prefix=prefix, last_call_timeout=1, **config
    )


results, errors = [None, None], []


def node(i):
    try:
        handler = etcd_rdzv.create_handler(params())
        try:
            result = handler.next_rendezvous()
            if result.rank == 0:
                result.store.set("greeting", b"from rank 0")
            results[i] = {
                "rank": result.rank,
                "world_size": result.world_size,
                "members": list(result.members),
                "read": result.store.get("greeting").decode(),
                "type": type(handler).__name__,
            }
        finally:
            handler.shutdown()
    except BaseException as exc:
        errors.append(repr(exc))


threads = [threading.Thread(target=node, args=(i,)) for i in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join(60)
out["nodes"], out["errors"] = results, errors

backend, store = etcd_rdzv.create_backend(params())
store.set("k", b"v")
out["backend_store"] = [type(backend).__name__, type(store).__name__, store.get("k").decode()]
out["state"] = backend.set_state(b"state") is not None

# api=v2 on a listening socket: refused before anything connects to it.
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
listener.setblocking(False)
v2 = params(endpoint="127.0.0.1:%d" % listener.getsockname()[1], api="v2")
refusals = []
for make in (etcd_rdzv.create_handler, etcd_rdzv.create_client, etcd_rdzv.create_backend):
    try:
        make(v2)
        refusals.append(None)
    except Exception as exc:
        refusals.append([type(exc).__name__, str(exc)])
out["v2"] = refusals
try:
    listener.accept()
    out["v2_connected"] = True
except BlockingIOError:
    out["v2_connected"] = False
out["loaded_after"] = sorted({m.split(".")[0] for m in sys.modules} & {"etcd", "urllib3", "dns"})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv without pip, site-packages or the v2 extra, with this checkout on its path."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60
    )
    python = venv / "bin" / "python"
    purelib = sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)})
    (Path(purelib) / "etcd_rdzv_checkout.pth").write_text(f"{CHECKOUT}\n", encoding="utf-8")
    return python


def _run(python: Path, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    # Nothing of this process's path: only the venv's own and the .pth.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return subprocess.run(
        [str(python), *args], check=False, capture_output=True, text=True, timeout=timeout, env=env
    )


def test_a_v3_job_runs_without_python_etcd_and_urllib3(
    bare_python: Path, etcd_server_v3: EtcdServer, etcd_key_prefix: str
) -> None:
    endpoint = etcd_server_v3.client_url.split("://", 1)[1]
    done = _run(bare_python, "-c", JOB, endpoint, etcd_key_prefix)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    # The venv is what it claims: none of the extra's modules can be imported.
    assert out["importable"] == []
    assert out["loaded"] == []
    assert out["errors"] == []
    nodes = out["nodes"]
    assert sorted(n["rank"] for n in nodes) == [0, 1]
    assert {n["world_size"] for n in nodes} == {2}
    assert nodes[0]["members"] == nodes[1]["members"]
    assert [n["read"] for n in nodes] == ["from rank 0"] * 2
    assert {n["type"] for n in nodes} == {"EtcdRendezvousHandler"}
    assert out["backend_store"] == ["EtcdRendezvousBackend", "EtcdStore", "v"]
    assert out["state"] is True

    # api=v2: the same clear error from every factory, and nothing connected.
    for refusal in out["v2"]:
        assert refusal is not None
        kind, message = refusal
        assert kind == "ValueError"
        assert "Option 'api' is 'v2'" in message
        assert "python-etcd" in message and "urllib3" in message
        assert "pip install 'etcd-rdzv[v2]'" in message
    assert out["v2_connected"] is False
    assert out["loaded_after"] == []

    # The command line, on the default API, shows the run; with --api v2 it says what
    # to install (a usage error: exit 2).
    connection = ["--endpoint", endpoint, "--key-prefix", etcd_key_prefix]
    status = _run(
        bare_python, "-m", "etcd_rdzv", "status", "--run-id", "bare", "--json", *connection
    )
    assert status.returncode == 0, status.stderr
    shown = json.loads(status.stdout)
    assert [m["node"] for m in shown["members"]] == nodes[0]["members"], shown
    v2 = _run(
        bare_python, "-m", "etcd_rdzv", "status", "--run-id", "bare", "--api", "v2", *connection
    )
    assert v2.returncode == 2, (v2.stdout, v2.stderr)
    assert "pip install 'etcd-rdzv[v2]'" in v2.stderr
    assert "Traceback" not in v2.stderr
