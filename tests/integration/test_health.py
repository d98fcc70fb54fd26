"""The health gate on a real etcd, every node a process: a host whose check fails
never enters a round, the others complete without it, and status shows why.

Every test runs on the etcd v2 API and on the v3 API (``etcd_api_params``); nodes are
processes of :class:`fleet.Fleet`, ``etcd-rdzv status`` and
``etcd-rdzv join`` commands. Every wait has a deadline that only catches hangs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousParameters
from etcd_rdzv.admission.health import ERROR_CHARS, MAX_LINE, RETRY_PAUSE, HealthCheckError
from etcd_rdzv.testing import EtcdRdzvCli
from fleet import Fleet

from ._cli_where import cli_where

Params = Callable[..., RendezvousParameters]
READY_TIMEOUT = 45.0
HANG = 60.0  # seconds: a generous bound that only catches hangs
BAD_CHECK = "sh -c 'echo checking disks; echo disk /dev/sdb bad; exit 3'"
HEALTH_ERROR = "etcd_rdzv.admission.health.HealthCheckError"


def _params(etcd_api_params: Params, **config: Any) -> RendezvousParameters:
    config.setdefault("backend", "etcd-rdzv")
    config.setdefault("keep_alive_interval", 1)
    config.setdefault("keep_alive_max_attempt", 2)
    config.setdefault("join_timeout", 60)
    config.setdefault("last_call_timeout", 2)
    config.setdefault("read_timeout", 10)
    config.setdefault("min_nodes", 2)
    return etcd_api_params("health", max_nodes=3, **config)


def test_a_host_whose_check_fails_is_kept_out_and_status_shows_why(
    fleet: Fleet, etcd_api_params: Params, etcd_rdzv_cli: EtcdRdzvCli
) -> None:
    good = [
        fleet.start(name, _params(etcd_api_params, host_id=f"host-{name}")) for name in ("a", "b")
    ]
    bad_params = _params(etcd_api_params, host_id="host-c", health_check=BAD_CHECK, join_timeout=8)
    bad = fleet.start("c", bad_params)
    fleet.ready(timeout=READY_TIMEOUT)
    bad.join()  # first: it would be in the round if the gate let it through
    for node in good:
        node.join()
    rounds = fleet.wait_each(good, "round", HANG)
    members = {tuple(e["members"]) for e in rounds}
    fleet.check(
        members in ({(good[0].node_id, good[1].node_id)}, {(good[1].node_id, good[0].node_id)}),
        f"the round is not a and b: {members}",
    )
    # c's join fails by itself, within its join_timeout, naming the check and why.
    error = fleet.wait(bad, "error", 8 + HANG)
    fleet.check(HEALTH_ERROR in error["kinds"], f"not a HealthCheckError: {error}")
    for part in ("host-c", BAD_CHECK, "exit code 3", "disk /dev/sdb bad"):
        fleet.check(part in error["message"], f"{part!r} not in {error['message']!r}")
    # It gives up once another try (RETRY_PAUSE later) would not fit in join_timeout.
    fleet.check(8 - RETRY_PAUSE - 1 <= error["elapsed"] <= 8 + 5, f"gave up: {error}")
    fleet.check(not bad.events("round"), "c entered a round")

    status = etcd_rdzv_cli.status(bad_params.run_id, *cli_where(bad_params))
    nodes = {m["node"] for m in status["members"]} | {w["node"] for w in status["waiting"]}
    fleet.check(bad.node_id not in nodes, f"c has a join key: {status}")
    (failure,) = status["health"]
    fleet.check(
        failure["host"] == "host-c"
        and failure["check"] == BAD_CHECK
        and failure["why"] == "exit code 3"
        and failure["output"] == ["checking disks", "disk /dev/sdb bad"]
        and failure["at"],
        f"status: {failure}",
    )
    text = etcd_rdzv_cli.run("status", "--run-id", bad_params.run_id, *cli_where(bad_params))
    assert text.returncode == 0, text.stderr
    assert "failed health checks: 1 host(s)" in text.stdout, text.stdout
    assert "host-c | disk /dev/sdb bad" in text.stdout, text.stdout


def test_join_runs_the_check_and_a_passing_check_clears_the_record(
    etcd_api_params: Params, etcd_rdzv_cli: EtcdRdzvCli, tmp_path: Path
) -> None:
    params = _params(etcd_api_params)
    where = ["--run-id", params.run_id, *cli_where(params), "--min-nodes", "1", "--max-nodes", "1"]
    flag = tmp_path / "healthy"
    check = f"test -e {flag}"
    failed = etcd_rdzv_cli.run(
        "join", *where, "--host-id", "h1", "--health-check", check, "--join-timeout", "3",
        timeout=HANG,
    )  # fmt: skip
    assert failed.returncode != 0, failed.stdout
    assert "health check" in failed.stderr and check in failed.stderr, failed.stderr
    assert "exit code 1" in failed.stderr, failed.stderr
    status = etcd_rdzv_cli.status(params.run_id, *cli_where(params))
    assert [h["host"] for h in status["health"]] == ["h1"], status
    assert status["round"] == 0, status  # never joined

    flag.touch()
    passed = etcd_rdzv_cli.run(
        "join", *where, "--host-id", "h1", "--health-check", check, "--join-timeout", "30",
        timeout=HANG,
    )  # fmt: skip
    assert passed.returncode == 0, passed.stderr
    assert "world size: 1" in passed.stdout, passed.stdout
    assert etcd_rdzv_cli.status(params.run_id, *cli_where(params))["health"] == []


def test_a_kept_out_handler_does_not_close_the_run_on_shutdown(etcd_api_params: Params) -> None:
    # As under torchrun (close_on_shutdown): the agent whose check failed calls
    # shutdown(), which must not end the job of the others.
    params = _params(etcd_api_params, health_check="false", join_timeout=2, host_id="h9")
    handler = etcd_rdzv.create_handler(params)
    handler.close_on_shutdown = True
    with pytest.raises(HealthCheckError, match="'h9'"):
        handler.next_rendezvous()
    assert handler.shutdown()
    assert not handler.is_closed()
    # A node that passes its check (and joins) still closes the run on shutdown.
    passing = etcd_rdzv.create_handler(_params(etcd_api_params, min_nodes=1, health_check="true"))
    passing.close_on_shutdown = True
    passing.next_rendezvous()
    assert passing.shutdown() and passing.is_closed()


def test_join_shows_the_last_lines_the_failing_check_printed(
    etcd_api_params: Params, etcd_rdzv_cli: EtcdRdzvCli, tmp_path: Path
) -> None:
    """The line an operator needs is the check's own output: ``etcd-rdzv join`` shows
    its last lines (stdout and stderr, at most ERROR_LINES of them and ERROR_CHARS
    characters) in its one-line error. The check is a script, so that what it prints
    is nowhere in its command line."""
    params = _params(etcd_api_params)
    where = ["--run-id", params.run_id, *cli_where(params), "--min-nodes", "1", "--max-nodes", "1"]
    script = tmp_path / "gpu-check.sh"
    script.write_text(
        "for i in 1 2 3 4 5 6 7; do echo step $i ok; done\necho 'GPU 3: Xid 79' >&2\nexit 4\n"
    )
    failed = etcd_rdzv_cli.run(
        "join", *where, "--host-id", "h2", "--health-check", f"sh {script}",
        "--join-timeout", "3", timeout=HANG,
    )  # fmt: skip
    assert failed.returncode == 1, failed.stderr
    (error,) = [line for line in failed.stderr.splitlines() if "error:" in line]
    assert error.endswith(
        "exit code 4; last output: ... | step 4 ok | step 5 ok | step 6 ok | step 7 ok | "
        "GPU 3: Xid 79"
    ), failed.stderr
    assert "step 3 ok" not in failed.stderr and "more with --debug" not in failed.stderr

    # Long lines: the last ERROR_CHARS characters, its end kept.
    script.write_text(
        f"for i in 1 2 3 4 5; do printf '%0{MAX_LINE}d\\n' $i; done\necho end\nexit 1\n"
    )
    failed = etcd_rdzv_cli.run(
        "join", *where, "--host-id", "h2", "--health-check", f"sh {script}",
        "--join-timeout", "3", timeout=HANG,
    )  # fmt: skip
    (error,) = [line for line in failed.stderr.splitlines() if "error:" in line]
    shown = error.split("; last output: ", 1)[1]
    assert shown.startswith("...") and shown.endswith(f"{5:0{MAX_LINE}d} | end"), error
    assert len(shown) == ERROR_CHARS, len(shown)
