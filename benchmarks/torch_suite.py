"""torch's own elastic agent and launcher tests, run on each rendezvous backend.

Usage (from the repository root)::

    python3 -m benchmarks.torch_suite --torch-tests PYTORCH_CHECKOUT \\
        [--backend etcd-rdzv --backend etcd-rdzv-dynamic --backend c10d] [--json FILE]

``PYTORCH_CHECKOUT`` is a copy of PyTorch's repository at the installed release (only
the files below are read; nothing of it is part of this project):

* ``test/distributed/elastic/agent/server/test/local_elastic_agent_test.py``
* ``test/distributed/launcher/api_test.py`` and its ``bin/`` scripts

One etcd (``etcd_rdzv.testing.EtcdServer``) serves every backend. Each backend runs
the files in one pytest process, unchanged: the ``sitecustomize`` in
``benchmarks/_torch_suite_site`` (first on ``PYTHONPATH`` of that process and of
every process it starts) makes torch's rendezvous registry build the backend under
test wherever a test asks for ``etcd``, ``etcd-v2`` or ``c10d``. Tests that exist
once per backend (``test_x_c10d``, ``test_x_etcd``, ``test_x_etcd_v2``) run once:
they are the same test on the backend under test. torch's test utilities need
``expecttest``; ``pytest-timeout``, where it is importable, bounds each test.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from etcd_rdzv.testing import EtcdServer

FILES = (
    "test/distributed/elastic/agent/server/test/local_elastic_agent_test.py",
    "test/distributed/launcher/api_test.py",
)
BACKENDS = ("etcd-rdzv", "etcd-rdzv-dynamic", "c10d")
TEST_TIMEOUT = 300  # seconds per test (with pytest-timeout)
RUN_TIMEOUT = 3600  # seconds per backend
ROOT = Path(__file__).resolve().parent.parent
SITE = Path(__file__).resolve().parent / "_torch_suite_site"
# A test's backend suffix, and which variant of a test runs (the first found).
_SUFFIX = re.compile(r"_(etcd_v2|etcd|c10d)$")
_PREFERRED = ("etcd", "c10d", "etcd_v2")


@dataclass
class Outcome:
    backend: str
    passed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def total(self) -> int:
        return len(self.passed) + len(self.failed)


def _env(backend: str | None, endpoint: str) -> dict[str, str]:
    env = dict(os.environ)
    path = [str(SITE), str(ROOT)]
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("ETCD_RDZV_TORCH_SUITE_BACKEND", None)
    if backend is not None:
        env["ETCD_RDZV_TORCH_SUITE_BACKEND"] = backend
        env["ETCD_RDZV_TORCH_SUITE_ENDPOINT"] = endpoint
    return env


def _pytest(torch_root: Path, ini: Path, args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        "-c",
        str(ini),
        f"--rootdir={torch_root}",
        "-p",
        "no:cacheprovider",
        *args,
    ]


def select(node_ids: list[str]) -> list[str]:
    """One node id per test: of ``test_x_etcd``, ``test_x_c10d`` and
    ``test_x_etcd_v2`` the first of :data:`_PREFERRED` found."""
    chosen: dict[str, tuple[int, str]] = {}
    for node in node_ids:
        match = _SUFFIX.search(node)
        base = node[: match.start()] if match else node
        rank = _PREFERRED.index(match.group(1)) if match else -1
        if base not in chosen or rank < chosen[base][0]:
            chosen[base] = (rank, node)
    return sorted(node for _, node in chosen.values())


def collect(torch_root: Path, ini: Path) -> list[str]:
    cmd = _pytest(torch_root, ini, ["--collect-only", "-q", *FILES])
    done = subprocess.run(
        cmd, cwd=torch_root, env=_env(None, ""), capture_output=True, text=True, check=False
    )
    nodes = [line for line in done.stdout.splitlines() if "::" in line]
    if done.returncode != 0 or not nodes:
        raise SystemExit(f"collecting torch's tests failed:\n{done.stdout}\n{done.stderr}")
    return select(nodes)


def run_backend(
    backend: str, endpoint: str, torch_root: Path, ini: Path, nodes: list[str], out: Path
) -> Outcome:
    report = out / f"{backend}.xml"
    args = ["-q", f"--junitxml={report}", *nodes]
    if importlib.util.find_spec("pytest_timeout") is not None:
        args.insert(0, f"--timeout={TEST_TIMEOUT}")
    log = out / f"{backend}.log"
    outcome = Outcome(backend)
    with log.open("w") as sink:
        try:
            subprocess.run(
                _pytest(torch_root, ini, args),
                cwd=torch_root,
                env=_env(backend, endpoint),
                stdout=sink,
                stderr=subprocess.STDOUT,
                timeout=RUN_TIMEOUT,
                check=False,
            )
        except subprocess.TimeoutExpired:
            outcome.note = f"stopped after {RUN_TIMEOUT} s"
    if not report.exists():
        outcome.note = outcome.note or f"no report; see {log}"
        return outcome
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        if case.find("skipped") is not None:
            outcome.skipped.append(name)
        elif case.find("failure") is not None or case.find("error") is not None:
            outcome.failed.append(name)
        else:
            outcome.passed.append(name)
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks.torch_suite", description=__doc__)
    parser.add_argument("--torch-tests", type=Path, required=True, metavar="PYTORCH_CHECKOUT")
    parser.add_argument("--backend", action="append", choices=BACKENDS, dest="backends")
    parser.add_argument("--json", type=Path, help="also write the outcome to this file")
    parser.add_argument("--keep", type=Path, help="keep the pytest logs and reports here")
    args = parser.parse_args(argv)
    torch_root = args.torch_tests.resolve()
    missing = [f for f in FILES if not (torch_root / f).is_file()]
    if missing:
        parser.error(
            f"--torch-tests {args.torch_tests}: no {', '.join(missing)} there; give a copy "
            "of PyTorch's repository at the installed release"
        )
    if importlib.util.find_spec("expecttest") is None:
        parser.error("torch's test utilities need expecttest: pip install expecttest")
    backends = args.backends or list(BACKENDS)

    with tempfile.TemporaryDirectory(prefix="torch-suite-") as tmp:
        out = args.keep.resolve() if args.keep else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        ini = out / "pytest.ini"
        ini.write_text("[pytest]\n")
        nodes = collect(torch_root, ini)
        print(f"{len(nodes)} tests of torch's (one per backend variant)", flush=True)
        outcomes = []
        with EtcdServer("torch-suite") as etcd:
            for backend in backends:
                outcome = run_backend(backend, etcd.endpoint, torch_root, ini, nodes, out)
                outcomes.append(outcome)
                print(
                    f"{backend}: {len(outcome.passed)}/{outcome.total} passed"
                    + (f", {len(outcome.skipped)} skipped" if outcome.skipped else "")
                    + (f" ({outcome.note})" if outcome.note else ""),
                    flush=True,
                )
                for name in outcome.failed:
                    print(f"  failed: {name}", flush=True)
    if args.json:
        args.json.write_text(
            json.dumps([o.__dict__ | {"total": o.total} for o in outcomes], indent=2) + "\n"
        )
    return 0 if all(not o.failed and not o.note for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
