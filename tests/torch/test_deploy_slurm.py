"""docs/slurm.md's sbatch script, run as written on a real Slurm on this machine.

The module starts a private Slurm (Debian's ``slurm-wlm`` 22.05): a ``munged`` with a
key of its own, a ``slurmctld`` and a ``slurmd`` for one node with 4 CPUs, on free
ports, with every file under a temporary directory (``SLURM_CONF`` points the client
commands at it; nothing of the system's Slurm or munge configuration is used). The
guide's script is submitted with ``sbatch --wait --nodes=1 --ntasks-per-node=2``: two
agents on the one node, started by the script's ``srun`` as it starts one per node.
A missing Slurm skips the module, or fails it where skips are not allowed (CI, which
installs ``slurm-wlm``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from etcd_rdzv.testing import EtcdServer, find_etcd_binary
from etcd_rdzv.testing._member import free_ports
from etcd_rdzv.testing.pytest_plugin import skip_or_fail
from fleet import child_env

pytestmark = pytest.mark.torch

HERE = Path(__file__).resolve().parent
GUIDE = HERE.parents[1] / "docs" / "slurm.md"
SLURM_COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "squeue", "scancel")
START_TIMEOUT = 30.0  # seconds for the private Slurm to show an idle node
JOB_TIMEOUT = 180.0  # seconds for one sbatch --wait; the job normally needs ~20
CLUSTER = "deploytest"

_SCRIPT = re.compile(r"^<!-- slurm: sbatch -->\n```bash\n(.*?)^```$", re.M | re.S)


def guide_script() -> str:
    """The guide's sbatch script, exactly as the guide shows it."""
    found = _SCRIPT.findall(GUIDE.read_text())
    assert len(found) == 1, f"{GUIDE}: expected one '<!-- slurm: sbatch -->' block"
    return str(found[0])


@dataclass
class Slurm:
    """The private Slurm: its configuration, and the environment its commands need."""

    root: Path
    conf: Path
    pid_files: tuple[Path, ...]

    def env(self, **extra: str) -> dict[str, str]:
        env = child_env(SLURM_CONF=str(self.conf))
        env.update(extra)
        return env

    def command(self, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, env=self.env(), capture_output=True, text=True, timeout=timeout, check=False
        )

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / "log" / name
            text = path.read_text(errors="replace") if path.exists() else "(none)"
            parts.append(f"--- {name} (last lines)\n" + "\n".join(text.splitlines()[-20:]))
        return "\n".join(parts)


def _slurm_conf(root: Path, node: str, ctld_port: int, slurmd_port: int) -> str:
    return f"""\
ClusterName={CLUSTER}
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.sock
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName={node} NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _stop(pid_file: Path) -> None:
    """Stop the daemon whose pid ``pid_file`` holds (SIGTERM, then SIGKILL after 10 s)."""
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            os.kill(pid, 0)
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def slurm() -> Iterator[Slurm]:
    missing = [c for c in SLURM_COMMANDS if shutil.which(c) is None]
    if missing:
        skip_or_fail(
            f"Slurm is not installed ({', '.join(missing)} missing): "
            "apt-get install slurm-wlm (Debian's Slurm 22.05, with munge)"
        )
    if os.geteuid() != 0:
        skip_or_fail("the private Slurm needs root (slurmd runs jobs as their users)")
    # Not under pytest's temporary directory: munged wants every directory above its
    # socket searchable by all (pytest's base directory is private).
    root = Path(tempfile.mkdtemp(prefix="etcd-rdzv-slurm-"))
    root.chmod(0o755)
    for sub in ("state", "spool", "log", "munge", "munge-key"):
        (root / sub).mkdir()
    (root / "munge-key").chmod(0o700)
    key = root / "munge-key" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    node = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, node, *free_ports(2)))
    slurm = Slurm(
        root,
        conf,
        (root / "slurmd.pid", root / "slurmctld.pid", root / "munge" / "munged.pid"),
    )
    try:
        munge = root / "munge"
        # Each daemon forks into the background once it is set up; the pid files are
        # how this fixture stops them.
        for argv in (
            [
                "munged",
                f"--key-file={key}",
                f"--socket={munge}/munge.sock",
                f"--pid-file={munge}/munged.pid",
                f"--log-file={munge}/munged.log",
                f"--seed-file={munge}/munged.seed",
            ],
            ["slurmctld", "-i", "-f", str(conf)],
            ["slurmd", "-f", str(conf)],
        ):
            done = subprocess.run(
                argv, env=slurm.env(), capture_output=True, text=True, check=False
            )
            assert done.returncode == 0, f"{argv[0]} failed: {done.stderr}\n{slurm.logs()}"
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            state = slurm.command("sinfo", "-h", "-o", "%T").stdout.strip()
            if state == "idle":
                break
            assert time.monotonic() < deadline, f"node state {state!r}\n{slurm.logs()}"
            time.sleep(0.2)
        yield slurm
    finally:
        with contextlib.suppress(Exception):
            slurm.command("scancel", "-u", "root")  # this Slurm's jobs (SLURM_CONF)
        for pid_file in slurm.pid_files:
            _stop(pid_file)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """``torchrun`` (this interpreter's torch) and ``etcd`` as the script calls them."""
    path = tmp_path / "bin"
    path.mkdir()
    torchrun = path / "torchrun"
    torchrun.write_text(f'#!/bin/sh\nexec {sys.executable} -m torch.distributed.run "$@"\n')
    torchrun.chmod(0o755)
    (path / "etcd").symlink_to(find_etcd_binary())
    return path


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
