"""What ``.ci/torch-edges`` leaves out of tests/torch on the torch edges
(``ETCD_RDZV_TORCH_EDGE=1``, ``conftest.py``): exactly the recovery timings, the real
Slurm, NVRx (installed with the pinned torch only) and the v2 runs of the torchrun tests
that run on both APIs; every other torchrun scenario stays, each v2 run's scenario on v3."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.torch

HERE = Path(__file__).resolve().parent


def _collected(edge: str) -> set[str]:
    env = {**os.environ, "ETCD_RDZV_TORCH_EDGE": edge}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "."],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # Ids from the root (tests/torch/test_x.py::test_y[v3]), here without the directory.
    return {line.rsplit("/", 1)[-1] for line in done.stdout.splitlines() if "::" in line}


def test_the_edges_leave_out_the_recovery_timings_and_the_v2_runs_of_torchrun(
    torch_required: None,
) -> None:
    everything, on_an_edge = _collected("0"), _collected("1")
    assert on_an_edge < everything
    left_out = everything - on_an_edge
    whole = (
        "test_torchrun_recovery.py",
        "test_deploy_slurm.py",
        "test_inprocess_slurm.py",
        "test_nvrx.py",
        "test_nvrx_guide.py",
    )
    recovery = {t for t in everything if t.split("::")[0] in whole}
    v2_runs = {
        t for t in everything - recovery if t.startswith("test_torchrun") and t.endswith("[v2]")
    }
    assert recovery and v2_runs
    assert left_out == recovery | v2_runs
    for test in v2_runs:  # the scenario itself still runs, on v3
        assert test.replace("[v2]", "[v3]") in on_an_edge, test
    modules = {t.split("::")[0] for t in everything if re.match(r"test_torchrun\w*\.py", t)}
    kept = {t.split("::")[0] for t in on_an_edge}
    assert modules - kept == {"test_torchrun_recovery.py"}
    assert {t.split("::")[0] for t in recovery} == set(whole)
