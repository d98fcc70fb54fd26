"""docs/inprocess.md's Slurm script, run as written on a real Slurm on this machine,
with the page's ``train.py``: three tasks on the private Slurm's one node
(``_slurm.py``); the task holding rank 0 is killed with SIGKILL (its pid found under
``slurmstepd``) while they train, and the two others must train on at world 2 in their
own processes and finish, and the job must end as the page says.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from etcd_rdzv.testing import EtcdServer

from ._slurm import Slurm, make_bin_dir, private_slurm
from .test_inprocess_guide import STEP, guide_block

pytestmark = pytest.mark.torch

HANG = 240.0  # seconds: a generous bound that only catches hangs
_SBATCH = re.compile(r"^<!-- inprocess: sbatch -->\n```bash\n(.*?)^```$", re.M | re.S)
_SCRIPT = re.compile(r"^<!-- inprocess: train.py -->\n```python\n(.*?)^```$", re.M | re.S)
#: A line of the job's output: srun's label (the task number), then the task's line.
_LABELLED = re.compile(r"^\s*(\d+): (.*)$")


@pytest.fixture(scope="module")
def slurm() -> Iterator[Slurm]:
    with private_slurm() as started:
        yield started


def _tasks(script: Path) -> dict[int, int]:
    """Task number -> pid of the processes ``python script`` whose parent is a
    ``slurmstepd`` (the tasks ``srun`` started)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
            parent = int(stat[stat.rindex(")") + 2 :].split()[1])
            parent_name = Path(f"/proc/{parent}/comm").read_text().strip()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        # [python, train.py] (not the batch script, whose arguments name train.py too)
        if argv[1:2] != [str(script).encode()] or parent_name != "slurmstepd":
            continue
        for item in environ:
            if item.startswith(b"SLURM_PROCID="):
                found[int(item.split(b"=", 1)[1])] = int(entry.name)
    return found


class Job:
    """The submitted job: ``sbatch --wait`` and the job's output file."""

    def __init__(self, slurm: Slurm, tmp_path: Path, env: dict[str, str], *argv: str) -> None:
        self.dir = tmp_path
        self.sbatch = subprocess.Popen(
            ["sbatch", "--wait", f"--chdir={tmp_path}", f"--output={tmp_path}/slurm-%j.out", *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def output(self) -> list[str]:
        return [
            line
            for p in sorted(self.dir.glob("slurm-*.out"))
            for line in p.read_text(errors="replace").splitlines()
        ]

    def steps(self) -> list[tuple[int, int, int, int, int]]:
        """(task, call, step, rank, world) of each step line so far."""
        found = []
        for line in self.output():
            labelled = _LABELLED.match(line)
            m = labelled and STEP.match(labelled.group(2))
            if labelled and m:
                task = int(labelled.group(1))
                call, step, rank, world = map(int, m.groups())
                found.append((task, call, step, rank, world))
        return found

    def report(self) -> str:
        return "--- the job's output (last lines)\n" + "\n".join(self.output()[-80:])

    def until(self, what: str, cond: object, deadline: float) -> None:
        while not cond():  # type: ignore[operator]
            assert self.sbatch.poll() is None, f"the job ended before {what}\n{self.report()}"
            assert time.monotonic() < deadline, f"no {what} within {HANG} s\n{self.report()}"
            time.sleep(0.1)


def test_sbatch_script_survives_the_loss_of_rank_0(
    torch_required: None, slurm: Slurm, etcd_server: EtcdServer, tmp_path: Path
) -> None:
    bin_dir = make_bin_dir(tmp_path / "bin")
    train = tmp_path / "train.py"
    train.write_text(guide_block(_SCRIPT, "train.py"))
    sbatch = tmp_path / "train.sbatch"
    sbatch.write_text(guide_block(_SBATCH, "sbatch"))
    env = slurm.env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        ETCD_RDZV_ENDPOINT=etcd_server.endpoint,
    )
    for name in ("MIN_NODES", "MAX_NODES", "STEPS", "ETCD_RDZV_RUN_ID"):
        env.pop(name, None)  # only what the page sets
    deadline = time.monotonic() + HANG
    job = Job(slurm, tmp_path, env, str(sbatch), str(train))
    try:

        def at(world: int, call: int, from_step: int = 0) -> dict[int, int]:
            """Task -> rank of the tasks that printed a step >= from_step at world, call."""
            return {
                s[0]: s[3]
                for s in job.steps()
                if (s[1], s[4]) == (call, world) and s[2] >= from_step
            }

        job.until("three tasks training at world 3", lambda: len(at(3, 0, 100)) == 3, deadline)
        ranks = at(3, 0)
        assert sorted(ranks.values()) == [0, 1, 2], job.report()
        pids = _tasks(train)
        assert sorted(pids) == [0, 1, 2], f"{pids}\n{job.report()}"
        victim = next(task for task, rank in ranks.items() if rank == 0)
        os.kill(pids[victim], signal.SIGKILL)
        killed = time.monotonic()
        survivors = sorted(set(pids) - {victim})
        job.until(
            "the survivors training at world 2",
            lambda: sorted(at(2, 1)) == survivors,
            deadline,
        )
        print(f"\nkill of rank 0's task -> survivors at world 2: {time.monotonic() - killed:.2f} s")
        # The survivors are the processes srun started: no task was started again.
        expected = {t: pids[t] for t in survivors}
        seen = [_tasks(train)]
        while seen[-1] != expected and time.monotonic() < killed + 10.0:
            time.sleep(0.1)  # the killed task may take a moment to leave /proc
            seen.append(_tasks(train))
        print(f"tasks {pids} -> {seen[0]} -> {seen[-1]}")
        assert seen[-1] == expected, f"{pids} -> {seen}\n{job.report()}"
        try:
            job.sbatch.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end within {HANG} s\n{job.report()}")
        out = job.output()
        srun_said = [line for line in out if line.startswith("srun:")]
        print("srun:", srun_said)
        for task in survivors:
            done = [line for line in out if re.match(rf"^\s*{task}: done: 1000 steps, loss ", line)]
            assert done, f"task {task} did not finish\n{job.report()}"
            # Its first call at world 3, its second at world 2, from where it stopped.
            steps = [s for s in job.steps() if s[0] == task]
            assert {(s[1], s[4]) for s in steps} == {(0, 3), (1, 2)}, job.report()
            assert min(s[2] for s in steps if s[1] == 1) > 0, job.report()
        assert sorted(at(2, 1).values()) == [0, 1], job.report()
        # As the page says: srun exits with the killed task's status (128 + 9), the
        # script with it (set -e), and Slurm records the job as failed.
        (output,) = tmp_path.glob("slurm-*.out")
        job_id = output.name.removeprefix("slurm-").removesuffix(".out")
        shown = slurm.command("scontrol", "show", "job", job_id).stdout
        state = re.findall(r"\b(JobState|ExitCode)=(\S+)", shown)
        print(f"sbatch --wait exited {job.sbatch.returncode}; {state}")
        assert job.sbatch.returncode == 137, job.report()
        assert state == [("JobState", "FAILED"), ("ExitCode", "137:0")], shown
        assert any(f"task {victim}: Killed" in line for line in srun_said), job.report()
    finally:
        if job.sbatch.poll() is None:
            slurm.command("scancel", "-u", "root")
            job.sbatch.wait(30.0)
