"""The benchmark command in its quick mode: it runs, and writes its report.

``python3 -m benchmarks.run --quick`` starts its own etcd member(s), runs our handler
for N = 2 and 4 (on every API this etcd_rdzv supports), and writes a markdown report
and the raw results. No timing is asserted here: the targets live in the report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from etcd_rdzv import params

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def test_quick_benchmark_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "bench.md"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--quick",
            "--handlers",
            "ours",
            "--out",
            str(out),
        ],
        cwd=str(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    apis = [api for api in ("v2", "v3") if api in params.SUPPORTED_APIS]

    results = json.loads(out.with_suffix(".json").read_text())
    rows = results["rendezvous"]
    assert {(r["series"], r["n"]) for r in rows} == {(f"ours/{a}", n) for a in apis for n in (2, 4)}
    for row in rows:
        assert not row.get("error"), row
        assert row["seconds"] > 0 and len(row["node_seconds"]) == row["n"], row
        assert row["requests"] > 0 and row["writes"] > 0, row
    assert [r["series"] for r in results["steady"] if "rate" in r] == [f"ours/{a}" for a in apis]
    assert all("seconds" in r and not r.get("error") for r in results["death"]), results["death"]
    assert all(len(r["samples"]) == 10 for r in results["store"]), results["store"]
    assert results["imports"]["etcd_rdzv"]

    report = out.read_text()
    for heading in ("## Targets", "## Time to rendezvous", "## Steady state", "## Import time"):
        assert heading in report
    for api in apis:
        assert f"| etcd_rdzv, {api} API | " in report
