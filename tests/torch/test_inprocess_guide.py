"""docs/inprocess.md's example, run as written: three processes of its ``train.py``
(copied from the page) against a real etcd; the process holding rank 0 is killed with
SIGKILL while they train, and the two others must train on at world 2 in their own
processes (the function's second call, the same pids) and finish with status 0.

The page's quoted output is checked against what a survivor printed (numbers vary from
run to run: each number of the quote stands for any number). The test prints the
seconds from the kill to each survivor's first completed step at world 2.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from etcd_rdzv.testing import EtcdServer
from fleet import child_env

pytestmark = pytest.mark.torch

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "inprocess.md"
HANG = 180.0  # seconds: a generous bound that only catches hangs
_SCRIPT = re.compile(r"^<!-- inprocess: train.py -->\n```python\n(.*?)^```$", re.M | re.S)
_OUTPUT = re.compile(r"^<!-- inprocess: output -->\n```text\n(.*?)^```$", re.M | re.S)
#: What the script prints at a step: call, step, rank, world size.
STEP = re.compile(r"^call (\d+), step (\d+): rank (\d+) of (\d+), loss [0-9.]+$")


def guide_block(pattern: re.Pattern[str], name: str) -> str:
    """One marked block of the page, exactly as the page shows it."""
    found = pattern.findall(GUIDE.read_text())
    assert len(found) == 1, f"{GUIDE}: expected one '<!-- inprocess: {name} -->' block"
    return str(found[0])


def quoted_lines_printed(quote: str, printed: list[str]) -> None:
    """Each line of the page's quote (but ``...``) matches a printed line, in order,
    with any number in place of each number of the quote."""
    at = 0
    for line in quote.splitlines():
        if line == "...":
            continue
        form = re.compile(re.sub(r"\\?\d+(?:\\\.\d+)?", r"[0-9]+(?:\\.[0-9]+)?", re.escape(line)))
        while at < len(printed) and not form.fullmatch(printed[at]):
            at += 1
        assert at < len(printed), f"the page quotes {line!r}; printed:\n" + "\n".join(printed)
        at += 1


class Trainer:
    """One process of the guide's script; its output lines with their arrival times."""

    def __init__(self, script: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(script)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def steps(self) -> list[tuple[float, int, int, int, int]]:
        """(time, call, step, rank, world) of each step line so far."""
        found = []
        for t, line in list(self.lines):
            m = STEP.match(line)
            if m:
                call, step, rank, world = map(int, m.groups())
                found.append((t, call, step, rank, world))
        return found

    def output(self) -> list[str]:
        self._reader.join(10.0)
        return [line for _, line in self.lines]

    def text(self) -> str:
        return "\n".join(line for _, line in list(self.lines)[-60:])


def _report(trainers: list[Trainer]) -> str:
    return "\n".join(
        f"--- process {i} (pid {t.proc.pid}, status {t.proc.poll()})\n{t.text()}"
        for i, t in enumerate(trainers)
    )


def _until(what: str, cond: object, trainers: list[Trainer], allowed_dead: int = -1) -> None:
    deadline = time.monotonic() + HANG
    while not cond():  # type: ignore[operator]
        for i, t in enumerate(trainers):
            if i != allowed_dead:
                code = t.proc.poll()
                assert code is None, f"process {i} ended ({code}) before {what}\n" + _report(
                    trainers
                )
        assert time.monotonic() < deadline, f"no {what} within {HANG} s\n{_report(trainers)}"
        time.sleep(0.05)


def test_guide_example_survives_the_loss_of_rank_0(
    torch_required: None, etcd_server: EtcdServer, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(guide_block(_SCRIPT, "train.py"))
    env = child_env(
        ETCD_RDZV_ENDPOINT=etcd_server.endpoint,
        ETCD_RDZV_RUN_ID=f"guide-{uuid.uuid4().hex[:8]}",
    )
    for name in ("MIN_NODES", "MAX_NODES", "STEPS"):
        env.pop(name, None)  # the script's defaults: 2 to 3 nodes, 1000 steps
    trainers = [Trainer(script, env) for _ in range(3)]
    try:

        def at_world(t: Trainer, world: int, call: int) -> list[tuple[float, int, int, int, int]]:
            return [s for s in t.steps() if s[4] == world and s[1] == call]

        _until(  # mid-training: each printed its step 100
            "three processes training at world 3",
            lambda: all(any(s[2] >= 100 for s in at_world(t, 3, 0)) for t in trainers),
            trainers,
        )
        ranks = [at_world(t, 3, 0)[0][3] for t in trainers]
        assert sorted(ranks) == [0, 1, 2], _report(trainers)
        victim = ranks.index(0)
        survivors = [t for i, t in enumerate(trainers) if i != victim]
        os.kill(trainers[victim].proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        _until(
            "the survivors training at world 2",
            lambda: all(at_world(t, 2, 1) for t in survivors),
            trainers,
            allowed_dead=victim,
        )
        delays = [at_world(t, 2, 1)[0][0] - killed for t in survivors]
        print(
            f"\nkill of rank 0 -> survivors' next step: {', '.join(f'{d:.2f} s' for d in delays)}"
        )
        for t in survivors:
            try:
                code = t.proc.wait(HANG)
            except subprocess.TimeoutExpired:
                pytest.fail(f"a survivor did not finish within {HANG} s\n{_report(trainers)}")
            assert code == 0, f"a survivor exited {code}\n{_report(trainers)}"
        assert trainers[victim].proc.wait(10.0) == -signal.SIGKILL
        for t in survivors:
            out = t.output()
            steps = t.steps()
            # One process all along (the one started, printing all this): the
            # function's first call at world 3, its second at world 2 from where the
            # first stopped, and nothing else.
            assert {(s[1], s[4]) for s in steps} == {(0, 3), (1, 2)}, "\n".join(out)
            assert [s[2] for s in steps] == sorted(s[2] for s in steps), "\n".join(out)
            assert at_world(t, 2, 1)[0][2] > 0, "the second call started again from step 0"
            assert out[-1].startswith("done: 1000 steps, loss "), "\n".join(out)
        assert sorted(at_world(t, 2, 1)[0][3] for t in survivors) == [0, 1]
        print("a survivor printed:\n" + "\n".join(survivors[0].output()))
        quoted_lines_printed(guide_block(_OUTPUT, "output"), survivors[0].output())
    finally:
        for t in trainers:
            if t.proc.poll() is None:
                t.proc.kill()
                t.proc.wait(10.0)
