"""docs/slurm.md's sbatch script, run as written on a real Slurm on this machine.

The module starts a private Slurm (``_slurm.py``: Debian's ``slurm-wlm`` 22.05, one
node with 4 CPUs, every file under a temporary directory). The
guide's script is submitted with ``sbatch --wait --nodes=1 --ntasks-per-node=2``: two
agents on the one node, started by the script's ``srun`` as it starts one per node.
A missing Slurm skips the module, or fails it where skips are not allowed (CI, which
installs ``slurm-wlm``).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from etcd_rdzv.testing import EtcdServer
from etcd_rdzv.testing._member import free_ports

from ._slurm import CLUSTER, Slurm, make_bin_dir, private_slurm

pytestmark = pytest.mark.torch

HERE = Path(__file__).resolve().parent
GUIDE = HERE.parents[1] / "docs" / "slurm.md"
JOB_TIMEOUT = 180.0  # seconds for one sbatch --wait; the job normally needs ~20

_SCRIPT = re.compile(r"^<!-- slurm: sbatch -->\n```bash\n(.*?)^```$", re.M | re.S)


def guide_script() -> str:
    """The guide's sbatch script, exactly as the guide shows it."""
    found = _SCRIPT.findall(GUIDE.read_text())
    assert len(found) == 1, f"{GUIDE}: expected one '<!-- slurm: sbatch -->' block"
    return str(found[0])


@pytest.fixture(scope="module")
def slurm() -> Iterator[Slurm]:
    with private_slurm() as started:
        yield started


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """``torchrun`` (this interpreter's torch) and ``etcd`` as the script calls them."""
    return make_bin_dir(tmp_path / "bin")


def _submit(slurm: Slurm, tmp_path: Path, out_dir: Path, bin_dir: Path, **settings: str) -> str:
    """Submit the guide's script as the guide says, wait for the job; its id."""
    script = tmp_path / "train.sbatch"
    script.write_text(guide_script())
    env = slurm.env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", LOGLEVEL="INFO")
    for name in ("RDZV_ENDPOINTS", "RDZV_CONF", "TRAIN_IFACE", "MIN_NODES"):
        env.pop(name, None)  # only what the test sets
    env.update(settings)
    argv = [
        "sbatch",
        "--wait",
        "--parsable",
        "--nodes=1",
        "--ntasks-per-node=2",
        f"--chdir={tmp_path}",
        f"--output={tmp_path}/slurm-%j.out",
        str(script),
        str(HERE / "_deploy_job.py"),
        str(out_dir),
    ]
    try:
        done = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired:
        slurm.command("scancel", "-u", "root")
        pytest.fail(f"the job did not end within {JOB_TIMEOUT} s\n{_outputs(tmp_path)}")
    job_id = done.stdout.strip().split(";")[0]
    assert done.returncode == 0, (
        f"sbatch exited {done.returncode}: {done.stderr}\n{_outputs(tmp_path)}\n{slurm.logs()}"
    )
    assert job_id.isdigit(), done.stdout
    return job_id


def _outputs(tmp_path: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')}" for p in sorted(tmp_path.glob("slurm-*"))
    )


def _check_results(out_dir: Path, job_id: str, tmp_path: Path) -> None:
    report = _outputs(tmp_path)
    written = sorted(p.name for p in out_dir.glob("rank*.json"))
    assert written == ["rank0.json", "rank1.json"], f"{written}\n{report}"
    for rank in (0, 1):
        seen = json.loads((out_dir / f"rank{rank}.json").read_text())
        assert (seen["rank"], seen["world_size"], seen["value"]) == (rank, 2, 3.0), report
        assert seen["TORCHELASTIC_RUN_ID"] == f"slurm-{CLUSTER}-{job_id}", f"{seen}\n{report}"
        assert seen["TORCHELASTIC_MAX_RESTARTS"] == "3", f"{seen}\n{report}"
        assert seen["LOCAL_WORLD_SIZE"] == "1", f"{seen}\n{report}"
        # --local-addr from TRAIN_IFACE (lo): rank 0's address is every worker's master.
        assert seen["MASTER_ADDR"] == "127.0.0.1", f"{seen}\n{report}"


def test_sbatch_script_with_the_sites_etcd(
    torch_required: None,
    slurm: Slurm,
    etcd_server: EtcdServer,
    etcd_key_prefix: str,
    bin_dir: Path,
    tmp_path: Path,
) -> None:
    out_dir = tmp_path / "results"
    out_dir.mkdir()
    job_id = _submit(
        slurm,
        tmp_path,
        out_dir,
        bin_dir,
        RDZV_ENDPOINTS=etcd_server.endpoint,
        RDZV_CONF=f"key_prefix={etcd_key_prefix},join_timeout=60",
        TRAIN_IFACE="lo",
        NPROC_PER_NODE="1",
    )
    _check_results(out_dir, job_id, tmp_path)


def test_sbatch_script_with_an_etcd_for_the_job(
    torch_required: None, slurm: Slurm, bin_dir: Path, tmp_path: Path
) -> None:
    out_dir = tmp_path / "results"
    out_dir.mkdir()
    client_port, peer_port = free_ports(2)
    job_id = _submit(
        slurm,
        tmp_path,
        out_dir,
        bin_dir,
        ETCD_PORT=str(client_port),
        ETCD_PEER_PORT=str(peer_port),
        TRAIN_IFACE="lo",
        NPROC_PER_NODE="1",
    )
    _check_results(out_dir, job_id, tmp_path)
    # The job's etcd ended with the job: nothing listens on its port any more.
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", client_port)) != 0, _outputs(tmp_path)
