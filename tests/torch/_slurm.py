"""A private Slurm for the tests of the guides' Slurm scripts (docs/slurm.md,
docs/inprocess.md): Debian's ``slurm-wlm`` 22.05, a ``munged`` with a key of its own, a
``slurmctld`` and a ``slurmd`` for one node with 4 CPUs, on free ports, with every file
under a temporary directory (``SLURM_CONF`` points the client commands at it; nothing
of the system's Slurm or munge configuration is used).
"""

from __future__ import annotations

import contextlib
import os
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

from etcd_rdzv.testing import find_etcd_binary
from etcd_rdzv.testing._member import free_ports
from etcd_rdzv.testing.pytest_plugin import skip_or_fail
from fleet import child_env

SLURM_COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "squeue", "scancel")
START_TIMEOUT = 30.0  # seconds for the private Slurm to show an idle node
CLUSTER = "deploytest"


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


@contextlib.contextmanager
def private_slurm() -> Iterator[Slurm]:
    """Start the private Slurm; stop it and remove its files at the end. A missing
    Slurm skips (or fails, where skips are not allowed)."""
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
        # how private_slurm stops them.
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


def make_bin_dir(path: Path) -> Path:
    """``path`` with ``torchrun`` and ``python`` (this interpreter, its torch) and
    ``etcd``, as the guides' scripts call them."""
    path.mkdir()
    torchrun = path / "torchrun"
    torchrun.write_text(f'#!/bin/sh\nexec {sys.executable} -m torch.distributed.run "$@"\n')
    torchrun.chmod(0o755)
    python = path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    (path / "etcd").symlink_to(find_etcd_binary())
    return path
