"""Fixtures of the torchrun tests, and what CI leaves out on the torch edges."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from etcd_rdzv.testing.pytest_plugin import skip_or_fail

from ._agents import is_job

#: ``ETCD_RDZV_TORCH_EDGE=1`` (``.ci/torch-edges``: tests/torch on the oldest supported
#: and the newest tested torch, besides every test on the pinned one) deselects these,
#: to keep CI within its time; why, in docs/testing.md ("torch releases"). The modules
#: left out whole: the recovery timings under host and etcd faults.
EDGE_LEFT_OUT_MODULES = (
    "test_torchrun_recovery.py",  # recovery timings under faults
    "test_deploy_slurm.py",  # a whole Slurm: it tries the script, not torch's release
    "test_nvrx.py",  # NVRx (the nvrx extra) is installed with the pinned torch only
    "test_inprocess_slurm.py",  # the same, for docs/inprocess.md's script
    "test_nvrx_guide.py",  # NVRx too: docs/inprocess-nvrx.md's example
)
#: And the runs on this etcd variant of the torchrun tests that run on both APIs: the
#: etcd API is below torch; each scenario still runs on the edges, on v3.
EDGE_LEFT_OUT_VARIANT = "v2"


def left_out_on_an_edge(item: pytest.Item) -> bool:
    """Whether ``.ci/torch-edges`` deselects ``item`` (a test of tests/torch)."""
    name = item.path.name
    if name in EDGE_LEFT_OUT_MODULES:
        return True
    callspec = getattr(item, "callspec", None)
    variant = None if callspec is None else callspec.params.get("etcd_variant")
    return name.startswith("test_torchrun") and variant == EDGE_LEFT_OUT_VARIANT


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("ETCD_RDZV_TORCH_EDGE") != "1":
        return
    here = Path(__file__).parent
    left_out = [i for i in items if here in i.path.parents and left_out_on_an_edge(i)]
    if left_out:  # deselected (an xdist run's summary omits them: .ci/torch-edges names them)
        config.hook.pytest_deselected(items=left_out)
        items[:] = [i for i in items if i not in left_out]


@pytest.fixture
def job_dir(tmp_path: Path) -> Iterator[Path]:
    """The job's output directory; afterwards, no worker of the job is left running.

    torch starts each worker in its own session, so killing an agent's process group
    does not reach its worker: the worker notices its agent is gone and exits by
    itself, and this kills whatever is still running anyway.
    """
    out_dir = tmp_path / "results"
    out_dir.mkdir()
    yield out_dir
    for marker in out_dir.glob("pid-*"):
        pid = int(marker.name[len("pid-") :])
        if is_job(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def nvrx_required(torch_required: None) -> None:
    """NVRx (the ``nvrx`` extra) importable, or a skip (a failure where torch is required)."""
    if importlib.util.find_spec("nvidia_resiliency_ext") is None:
        skip_or_fail(
            "nvidia-resiliency-ext is not installed: pip install -c constraints.txt -e '.[nvrx]'",
            require="ETCD_RDZV_REQUIRE_TORCH",
        )
