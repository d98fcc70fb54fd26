"""docs/inprocess-nvrx.md's example, run as the page shows it: NVIDIA's in-process
``Wrapper`` (nvidia-resiliency-ext 0.4.1) with both of its stores on etcd survives the
loss of rank 0.

The page's blocks are marked ``<!-- nvrx: NAME -->``: ``train.py`` (the script, written
to a file as shown), ``start`` (the shell lines that start a development etcd with
``etcd-rdzv serve`` and three ranks) and ``rank1.log`` (how a survivor's log ends).
The ``start`` lines run in ``bash`` as written, only the page's etcd port replaced by
a free one; ``python`` and ``etcd-rdzv`` are this interpreter's. After them the test
appends lines of its own that only observe: the background jobs' pids, and each
rank's exit code as ``bash`` reaps it. Once every rank printed its first step, rank
0's process is SIGKILLed (``kill -9``, as the page says): ranks 1 and 2 must exit 0
in the processes ``bash`` started, and their logs must end with the page's lines
(rank 2's with ``rank 1/2``).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from etcd_rdzv.testing import cli_env
from etcd_rdzv.testing._member import free_ports

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "inprocess-nvrx.md"
_BLOCK = re.compile(r"^<!-- nvrx: ([\w.-]+) -->\n```[a-z]*\n(.*?)^```$", re.M | re.S)
#: The etcd port the page's lines use; the test runs them on a free one.
GUIDE_PORT = "23791"
WORLD = 3
#: Seconds for the etcd and three ranks to start (torch and NVRx imported) and step.
START_BOUND = 120.0
#: Seconds from rank 0's kill to the survivors' exit: NVRx's restart (rank 0's
#: monitor daemon reports the death within 1 s), then the script's 3,000 steps at
#: world 2 (about 15 s here).
FINISH_BOUND = 120.0
#: The test's own lines after the page's: the background jobs' pids (the serve and
#: ranks 0, 1, 2, in the order the page starts them), then each rank's exit code.
OBSERVE = """
jobs -p > pids
for pid in $(tail -n 3 pids); do wait "$pid"; echo "$pid $?" >> exits; done
wait
"""


def guide_blocks() -> dict[str, str]:
    """The page's marked blocks, exactly as the page shows them."""
    blocks = dict(_BLOCK.findall(GUIDE.read_text(encoding="utf-8")))
    for name in ("train.py", "start", "rank1.log"):
        assert name in blocks, f"{GUIDE}: no '<!-- nvrx: {name} -->' block"
    return blocks


class Run:
    """The page's lines running in ``bash`` in ``workdir``: its files, its processes."""

    def __init__(self, workdir: Path, script: str) -> None:
        self.workdir = workdir
        (workdir / "start.sh").write_text(script)
        scripts = sysconfig.get_path("scripts")  # this python and its etcd-rdzv first
        env = cli_env(
            PATH=os.pathsep.join((scripts, os.environ.get("PATH", ""))),
            PYTHONPATH=os.pathsep.join(
                p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
            ),
        )
        with (workdir / "bash.out").open("wb") as out:
            self.bash = subprocess.Popen(
                ["bash", "start.sh"],
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def text(self, name: str) -> str:
        path = self.workdir / name
        return path.read_text(errors="replace") if path.exists() else ""

    def pids(self) -> list[int]:
        return [int(p) for p in self.text("pids").split()]

    def exits(self) -> dict[int, int]:
        """Each rank's exit code by rank, as far as ``bash`` reaped them."""
        by_pid = dict(line.split() for line in self.text("exits").splitlines())
        return {
            rank: int(by_pid[str(pid)])
            for rank, pid in enumerate(self.pids()[1:])
            if str(pid) in by_pid
        }

    def report(self) -> str:
        parts = [f"--- {name}\n{self.text(name)[-3000:]}" for name in ("bash.out", "exits")]
        parts += [f"--- rank{r}.log\n{self.text(f'rank{r}.log')[-3000:]}" for r in range(WORLD)]
        return "\n".join(parts)

    def wait_for(self, what: str, done: Callable[[], bool], timeout: float) -> float:
        """Poll ``done()`` every 50 ms until true; the instant it was seen true."""
        deadline = time.monotonic() + timeout
        while not done():
            if self.bash.poll() is not None:
                pytest.fail(f"bash exited ({self.bash.returncode}) before {what}\n{self.report()}")
            if time.monotonic() > deadline:
                pytest.fail(f"not within {timeout} s: {what}\n{self.report()}")
            time.sleep(0.05)
        return time.monotonic()

    def stop(self) -> None:
        """SIGTERM to the run's session (``bash`` exits; the serve stops its etcd and
        removes its data), a wait for the run's processes to end, then SIGKILL to
        whatever is left."""
        with contextlib.suppress(ProcessLookupError):  # bash not reaped yet: its group
            os.killpg(self.bash.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.bash.wait(10)
        if self.bash.poll() is None:
            self.bash.kill()
            self.bash.wait(10)
        # The rest of the session (the serve, the ranks) and NVRx's monitor daemons
        # (which leave it: setsid; one whose rank is gone exits by itself) run in this
        # run's directory; the serve's etcd runs in a session of its own, stopped by it.
        deadline = time.monotonic() + 20
        while (left := _running_in(self.workdir)) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _running_in(workdir: Path) -> list[int]:
    """Live processes whose working directory is ``workdir``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            here = (proc / "cwd").resolve() == workdir.resolve()
            state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if here and state != "Z":
            found.append(int(proc.name))
    return found


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    runs: list[Run] = []
    yield runs
    for run in runs:
        run.stop()


def test_the_guides_example_survives_rank_0s_kill(
    nvrx_required: None, tmp_path: Path, runs: list[Run]
) -> None:
    blocks = guide_blocks()
    start = blocks["start"]
    assert start.count(GUIDE_PORT) == 1, f"the page's etcd port, once:\n{start}"
    (port,) = free_ports(1)
    workdir = tmp_path / "job"
    workdir.mkdir()
    (workdir / "train.py").write_text(blocks["train.py"])
    began = time.monotonic()
    run = Run(workdir, start.replace(GUIDE_PORT, str(port)) + OBSERVE)
    runs.append(run)

    def training() -> bool:
        ranks = range(WORLD)
        return len(run.pids()) == WORLD + 1 and all(
            f"call 0 rank {r}/{WORLD} step 0\n" in run.text(f"rank{r}.log") for r in ranks
        )

    trained = run.wait_for("every rank's first step", training, START_BOUND)
    assert run.exits() == {}, run.report()
    rank0 = run.pids()[1]
    killed = time.monotonic()
    os.kill(rank0, signal.SIGKILL)  # the page's `kill -9`: rank 0's process only
    again = run.wait_for(
        "the survivors' first step at world 2",
        lambda: all(f"call 1 rank {r - 1}/2 step 0\n" in run.text(f"rank{r}.log") for r in (1, 2)),
        FINISH_BOUND,
    )
    finished = run.wait_for("the ranks' exits", lambda: len(run.exits()) == WORLD, FINISH_BOUND)
    report = run.report()
    print(
        f"the page's example: training {trained - began:.1f} s after the start; the "
        f"survivors' first step at world 2 {again - killed:.1f} s after rank 0's kill; "
        f"exited {finished - killed:.1f} s after it"
    )
    assert run.exits() == {0: 128 + signal.SIGKILL, 1: 0, 2: 0}, report
    assert "done:" not in run.text("rank0.log"), report  # killed while it trained
    documented = blocks["rank1.log"].splitlines()
    for rank in (1, 2):
        log = run.text(f"rank{rank}.log")
        # One process per rank, called at world 3 once, then once at world 2.
        assert log.count(f"call 0 rank {rank}/{WORLD} step 0\n") == 1, report
        expected = [line.replace("rank 0/2", f"rank {rank - 1}/2") for line in documented]
        assert log.splitlines()[-len(expected) :] == expected, (
            f"rank{rank}.log does not end as the page says:\n" + "\n".join(expected) + f"\n{report}"
        )
