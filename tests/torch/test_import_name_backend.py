"""``--rdzv-backend=etcd_rdzv`` (the package's import name, not a backend) gets the
backend's real names, not torch's bare "not registered": the ``torchrun.handlers``
entry point ``etcd_rdzv`` of pyproject.toml refuses with them.

The entry points come from pyproject.toml here, not from an installed copy's metadata
(which may be older than this tree): a distribution's metadata made from it is put
first on ``PYTHONPATH``, so the real torchrun finds exactly what this tree declares.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fleet import child_env

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[2]
HINT = "use --rdzv-backend=etcd-rdzv"


def _handlers() -> dict[str, str]:
    """pyproject.toml's ``torchrun.handlers`` entry points (tomllib is 3.11's)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split('[project.entry-points."torchrun.handlers"]\n', 1)[1].split("\n[")[0]
    return dict(re.findall(r'^([\w.-]+) = "([^"]+)"$', section, re.MULTILINE))


def test_the_import_name_is_an_entry_point_that_refuses_with_the_names(
    torch_required: None,
) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.api import RendezvousHandlerRegistry

    target = _handlers()["etcd_rdzv"]
    module, _, attr = target.partition(":")
    # What torch's registry does with an entry point: call it, register what it returns.
    registry = RendezvousHandlerRegistry()
    registry.register("etcd_rdzv", getattr(importlib.import_module(module), attr)())
    params = RendezvousParameters("etcd_rdzv", "127.0.0.1:1", "r", 1, 1)
    with pytest.raises(ValueError, match="import name") as caught:
        registry.create_handler(params)
    assert set(_handlers()) >= {"etcd-rdzv", "etcd-rdzv-dynamic", "etcd-rdzv-static"}
    for name in ("'etcd_rdzv'", "etcd-rdzv", "etcd-rdzv-dynamic", "etcd-rdzv-static", HINT):
        assert name in str(caught.value)


def test_torchrun_with_the_import_name_says_the_backend_name(
    torch_required: None, tmp_path: Path
) -> None:
    meta = tmp_path / "etcd_rdzv-0.0.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: etcd-rdzv\nVersion: 0.0.0\n")
    lines = [f"{name} = {target}" for name, target in _handlers().items()]
    (meta / "entry_points.txt").write_text("[torchrun.handlers]\n" + "\n".join(lines) + "\n")
    script = tmp_path / "train.py"
    script.write_text("print('trained')\n")
    env = child_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "1"),
            *("--rdzv-backend=etcd_rdzv", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "r"),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode != 0
    assert "trained" not in done.stdout
    assert "is the Python package's import name" in done.stderr, done.stderr
    assert HINT in done.stderr
    assert "is not registered" not in done.stderr


def test_loading_the_entry_points_imports_no_torch_integration() -> None:
    """torch loads every ``torchrun.handlers`` entry point while it imports its
    rendezvous package: none of ours may import :mod:`etcd_rdzv.torch` (or torch)."""
    targets = sorted(set(_handlers().values()))
    code = (
        "import importlib, sys\n"
        f"for target in {targets!r}:\n"
        "    module, _, attr = target.partition(':')\n"
        "    getattr(importlib.import_module(module), attr)\n"
        "print(sorted({'etcd_rdzv.torch', 'torch'} & set(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", (targets, done.stdout)
