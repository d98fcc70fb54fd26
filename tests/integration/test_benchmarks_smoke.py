"""The benchmark command in its quick mode: it runs, and writes its report.

``python3 -m benchmarks.run --quick`` starts its own etcd member(s), runs our handler
for N = 2 and 4 (on every API this etcd_rdzv supports), runs the large part at N = 16
(as processes, and as threads in 2 processes) with its floor's calibration, and writes
a markdown report and the raw results. No timing is asserted here: the targets live in
the report.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from etcd_rdzv.config import params

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
LARGE_LAYOUTS = (("processes", 16), ("threads", 2))  # --quick: N=16, --large-procs 2


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
            "--skip",
            "recovery",  # test_recovery_part_writes_its_section (needs torch)
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
    large = results["large"]
    assert sorted((r["series"], r["layout"], r["procs"], r["clock"]) for r in large) == sorted(
        (f"ours/{a}", layout, procs, clock)
        for a in apis
        for layout, procs in LARGE_LAYOUTS
        for clock in ("built", "cold")
    )
    for row in large:
        assert row["n"] == 16 and not row.get("error"), row
        assert row["seconds"] > 0 and row["requests"] > 0 and row["requests_to_rank"] > 0, row
    for api in apis:
        calibration = results["calibration"][api]
        for kind in ("read", "write"):
            assert calibration[kind]["requests"] >= 100, calibration
            assert calibration[kind]["client"] > 0, calibration

    report = out.read_text()
    for heading in ("## Targets", "## Time to rendezvous", "## Steady state", "## Import time"):
        assert heading in report
    for api in apis:
        assert f"| etcd_rdzv, {api} API | " in report
    assert "## Large N: our handler at N=16" in report
    assert "**Estimated floor on this machine**" in report
    for api in apis:
        for shown in ("processes", "threads (2 processes)"):
            assert f"- Estimated floor, {api}, {shown}: 16 x " in report
            target = f"| N=1024: etcd_rdzv, {api} API, nodes as {shown.split()[0]}, within 3 s | "
            assert target + "not measured (large part ran at N=16) | not run |" in report


def test_large_part_on_a_cluster_survives_its_leader_killed(tmp_path: Path) -> None:
    """The large part at N = 8 (threads in 2 processes, cold) on a 3-member cluster
    whose leader is SIGKILLed 0.1 s after the go signal: every rank once, the kill
    and a new leader recorded, etcd's cost summed over the members."""
    api = "v3" if "v3" in params.SUPPORTED_APIS else "v2"
    out = tmp_path / "bench.md"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--handlers",
            "ours",
            "--api",
            api,
            "--skip",
            "rendezvous,steady,death,store,imports,recovery",
            "--large-nodes",
            "8",
            "--large-procs",
            "2",
            "--large-layouts",
            "threads",
            "--large-clocks",
            "cold",
            "--large-cluster",
            "3",
            "--large-kill-leader",
            "--large-kill-after",
            "0.1",
            "--large-settle",
            "0",
            "--floor-requests",
            "20",
            "--count-tail",
            "0",
            "--out",
            str(out),
        ],
        cwd=str(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    results = json.loads(out.with_suffix(".json").read_text())
    (row,) = results["large"]
    assert (row["series"], row["n"], row["cluster"], row["etcd_members"]) == (
        f"ours/{api}",
        8,
        3,
        3,
    ), row
    # The harness's check: every rank 0..7 once, one world size (else "error").
    assert not row.get("error") and row["seconds"] > 0 and len(row["node_seconds"]) == 8, row
    kill = row["kill"]
    assert "error" not in kill, kill
    assert kill["member"] == row["leader"] and kill["at"] >= 0.1, kill
    assert kill["new_leader"] in {"m0", "m1", "m2"} - {kill["member"]}, kill
    assert kill["elected"] > kill["at"] and kill["election"] > 0, kill
    assert row["requests"] > 0 and row["writes"] > 0, row
    assert set(row["etcd_cpu_members"]) == {"m0", "m1", "m2"}, row
    assert row["etcd_cpu"] >= row["etcd_cpu_leader"] >= 0, row
    if api == "v3":
        assert row["bytes_sent"] > 0, row
    report = out.read_text()
    assert "| bytes sent per node |" in report and "**Leader kill.**" in report
    assert f"3 members, {kill['member']} killed at " in report


OTHER_PARTS = "rendezvous,steady,death,store,imports,large"
RECOVERY_LIMIT = 30  # seconds for the job to train again after it lost a host


@pytest.mark.torch
def test_recovery_part_writes_its_section(tmp_path: Path, torch_required: None) -> None:
    """One real torchrun job of our handler (v3) loses a host; run alone, the part
    replaces only its own section of an existing report and keeps the JSON's other
    results. The job recovers within RECOVERY_LIMIT, and its idle requests are
    counted (a positive rate)."""
    out = tmp_path / "bench.md"
    out.write_text("# Benchmarks\n\n## Time to rendezvous\n\nkept\n\n## How the numbers are made\n")
    out.with_suffix(".json").write_text(json.dumps({"rendezvous": ["kept"]}))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--skip",
            OTHER_PARTS,
            "--api",
            "v3",
            "--recovery-handlers",
            "ours",
            "--recovery-faults",
            "killed",
            "--recovery-limit",
            str(RECOVERY_LIMIT),
            "--recovery-settle",
            "0",
            "--recovery-idle",
            # Longer than the renewal interval (4.5 s: half the 9 s TTL), so every node
            # beats in it.
            "6",
            "--out",
            str(out),
        ],
        cwd=str(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    results = json.loads(out.with_suffix(".json").read_text())
    assert results["rendezvous"] == ["kept"]
    (row,) = results["recovery"]["rows"]
    assert (row["series"], row["fault"]) == ("ours/v3", "killed"), row
    # The job recovered (within a limit that only a recovery that never comes misses:
    # a busy CI machine stretches the usual few seconds).
    assert "error" not in row and 0 < row["seconds"] < RECOVERY_LIMIT, row
    (idle,) = results["recovery"]["idle"]
    # Heartbeats at least: an idle job still sends requests, and they were counted.
    assert idle["series"] == "ours/v3" and idle["rate"] > 0, idle
    page = out.read_text()
    assert page.index("kept") < page.index("## Recovery") < page.index("## How the numbers")
    assert "| etcd_rdzv, v3 API | " in page
    assert "<svg" in out.with_name("bench-recovery.svg").read_text()


#: Default rendezvous settings: a killed member's key lives 9 s (3 s x 3).
KILLED_KEY_TTL = 9.0


@pytest.mark.torch
def test_recovery_part_runs_in_process_rows(tmp_path: Path, torch_required: None) -> None:
    """The in-process handler under the rank-0 host killed: three plain processes run
    ``etcd_rdzv.inprocess.run``; the survivors train again at world 2 before the dead
    member's key expires, with no new process and each calling the function again."""
    out = tmp_path / "bench.md"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--skip",
            OTHER_PARTS,
            "--api",
            "v3",
            "--recovery-handlers",
            "inprocess",
            "--recovery-faults",
            "rank0",
            "--recovery-limit",
            str(RECOVERY_LIMIT),
            "--recovery-settle",
            "1",
            "--recovery-idle",
            "0",
            "--out",
            str(out),
        ],
        cwd=str(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    (row,) = json.loads(out.with_suffix(".json").read_text())["recovery"]["rows"]
    assert (row["series"], row["fault"]) == ("inprocess/v3", "rank0"), row
    assert "error" not in row, row
    # A round that waited for the killed member's key would take its TTL.
    assert 0 < row["seconds"] < KILLED_KEY_TTL - 1, row
    assert row["restarts"] == 0 and row["recalls"] == 2, row
    assert "| etcd_rdzv in-process (no torchrun), v3 API | " in out.read_text()


def _floor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.floor", *args],
        cwd=str(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_floor_script_ranks_every_node() -> None:
    done = _floor("--nodes", "6", "--size", "3000")
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    line = done.stdout.strip().splitlines()[-1]
    # Every node found its rank in an announcement padded to the size asked for.
    assert line.startswith("floor, 6 processes, announcement 3000 B: all joined "), line
    assert "last rank" in line and "etcd CPU" in line, line


def test_the_floor_script_refuses_a_bad_count_before_starting_etcd() -> None:
    done = _floor("--nodes", "0")
    assert done.returncode == 2 and "--nodes" in done.stderr and "0" in done.stderr, done.stderr


def test_the_scale_harness_forms_an_exact_round_and_counts_etcd(tmp_path: Path) -> None:
    """``python3 -m benchmarks.scale`` (docs/benchmarks.md, "Scale") at a small N, both
    APIs, with an idle window: an exact round checked by the history checker, etcd's
    counts by kind, and the idle cost."""
    out = tmp_path / "scale.jsonl"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "benchmarks.scale", "--nodes", "12", "--procs", "3"),
            *("--api", "v3,v2", "--settle", "0", "--idle", "4", "--idle-settle", "1"),
            *("--baseline", "2", "--after", "5", "--json", str(out)),
        ],
        cwd=str(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["api"] for r in rows] == ["v3", "v2"]
    for row in rows:
        assert row["exact"] is True and row["history"] == "ok", row
        assert row["answered"] == 12 and row["failed"] == 0, row
        assert row["seconds"] is not None and row["etcd_cpu_ms_per_node"] > 0, row
        # Every node wrote its join key: a write each at least, counted by kind.
        assert row["writes"] >= 1 and sum(row["by_kind"].values()) >= row["requests"] - 0.01, row
        assert row["idle_requests_per_node_s"] > 0, row  # heartbeats, counted
        # Where they went: by member (the three of the cluster), and who led.
        assert sorted(row["idle_by_member"]) == ["m0", "m1", "m2"], row
        assert abs(sum(row["idle_by_member"].values()) - row["idle_requests_per_node_s"]) < 0.01
        assert row["idle_leader"] in row["idle_by_member"], row
        # The cluster alone costs some CPU; the idle nodes' share is given beside it.
        assert row["baseline_cpu_ms_s"] > 0 and "idle_nodes_cpu_ms_per_node_s" in row, row
        assert row["alive"] > 0 and row["waited"] <= row["alive"], row
    assert rows[0]["by_kind"].get("Txn", 0) >= 1, rows[0]  # v3: the join's transaction
    assert rows[1]["by_kind"].get("PUT", 0) >= 1, rows[1]  # v2: the join key's PUT
    # The count through 5 s past the last rank holds the first one and what came
    # after it: every node's first heartbeat (3 s after its lease or key, both made
    # before the last rank).
    v3, v2 = rows[0], rows[1]
    assert (
        v3["settled"]["by_kind"]["LeaseKeepAlive"] >= v3["by_kind"].get("LeaseKeepAlive", 0) + 1
    ), v3
    assert v2["settled"]["by_kind"]["PUT"] >= v2["by_kind"]["PUT"] + 1, v2
    for row in rows:
        assert row["settled"]["requests"] >= row["requests"] + 1, row


def test_the_scale_harness_refuses_bad_counts_before_starting_etcd() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.scale", "--nodes", "0"],
        cwd=str(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0 and "--nodes" in done.stderr, done.stderr


def _nvrx_processes(under: Path) -> list[int]:
    """Live processes of the NVRx worker program (workers and their monitor daemons,
    which are forked from them) whose command line names a path under ``under``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if b"benchmarks._nvrx_job" in cmdline and str(under).encode() in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.mark.torch
def test_recovery_part_runs_nvrx_rows_on_our_store(tmp_path: Path, torch_required: None) -> None:
    """NVRx's Wrapper on EtcdWrapperStore and pg_store loses rank 0's process: the two
    survivors call the function again in their own processes and train at world 2
    (with NVRx's rank-0 TCPStores they never do), and no worker or NVRx monitor daemon
    outlives the measurement (the daemons leave their worker's session)."""
    if importlib.util.find_spec("nvidia_resiliency_ext") is None:
        from etcd_rdzv.testing.pytest_plugin import skip_or_fail

        skip_or_fail(
            "nvidia-resiliency-ext is not installed: pip install -c constraints.txt -e '.[nvrx]'",
            require="ETCD_RDZV_REQUIRE_TORCH",
        )
    out = tmp_path / "bench.md"
    work = tmp_path / "work"  # the harness's temporary files: the workers' paths name it
    work.mkdir()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--skip",
            OTHER_PARTS,
            "--api",
            "v3",
            "--recovery-handlers",
            "nvrx-etcd",
            "--recovery-faults",
            "rank0",
            "--recovery-limit",
            str(RECOVERY_LIMIT),
            "--recovery-settle",
            "1",
            "--recovery-idle",
            "0",
            "--out",
            str(out),
        ],
        cwd=str(REPO_ROOT),
        env={**os.environ, "TMPDIR": str(work)},
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    left = _nvrx_processes(work)
    for pid in left:  # not to leave them running when the assertion below fails
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    (row,) = json.loads(out.with_suffix(".json").read_text())["recovery"]["rows"]
    assert (row["series"], row["fault"]) == ("nvrx-etcd/v3", "rank0"), row
    assert "error" not in row and 0 < row["seconds"] < RECOVERY_LIMIT, row
    assert row["restarts"] == 0 and row["recalls"] == 2, row
    assert left == [], f"NVRx processes left running: {left}"
    page = out.read_text()
    assert "| NVRx Wrapper, etcd_rdzv's stores, v3 API | " in page
    assert "NVRx rows (`--recovery-handlers nvrx-tcpstore,nvrx-etcd`)" in page
