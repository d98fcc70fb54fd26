"""The plugin's ``etcd_rdzv_cli`` fixture, which every CLI test uses: what a command
sees of the environment, output read as it comes, bounded waits, and the clean-up of
what a test started."""

from __future__ import annotations

import re
import socket

import pytest

from etcd_rdzv.testing import EtcdRdzvCli, EtcdServer, cli_env, wait_until
from etcd_rdzv.testing.pytest_plugin import NO_SKIP_ENV


def _closed_port() -> int:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_a_command_sees_no_option_variable_of_the_test_process(
    etcd_rdzv_cli: EtcdRdzvCli, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = _closed_port()
    monkeypatch.setenv("ETCD_RDZV_ENDPOINT", f"127.0.0.1:{port}")
    monkeypatch.setenv("ETCD_RDZV_API", "v4")  # would be a usage error
    monkeypatch.setenv(NO_SKIP_ENV, "1")
    env = cli_env(ETCD_RDZV_READ_TIMEOUT="3")
    assert "ETCD_RDZV_ENDPOINT" not in env and "ETCD_RDZV_API" not in env
    assert env[NO_SKIP_ENV] == "1"  # the harness's own variables stay
    assert env["ETCD_RDZV_READ_TIMEOUT"] == "3"  # what the test gives is kept
    # Without --endpoint the CLI uses its default, not the variable (a read only:
    # something may listen on the default port).
    done = etcd_rdzv_cli.run("status", "--run-id", "r", "--read-timeout", "1")
    assert f":{port}" not in done.stdout + done.stderr, done.stderr
    assert "v4" not in done.stderr, done.stderr
    # A variable passed to run() does reach it.
    bad = etcd_rdzv_cli.run("status", "--run-id", "r", env={"ETCD_RDZV_API": "v4"})
    assert bad.returncode == 2 and "'v4'" in bad.stderr, bad.stderr


def test_started_commands_are_read_as_they_write_and_waits_are_bounded(
    etcd_rdzv_cli: EtcdRdzvCli,
) -> None:
    endpoint = f"127.0.0.1:{_closed_port()}"
    proc = etcd_rdzv_cli.start("status", "--run-id", "r", "--endpoint", endpoint)
    line = proc.wait_line(r"^etcd-rdzv: error:")
    assert endpoint in line
    done = proc.finish()
    assert done.returncode == 1 and line in done.stderr  # the line waited for is kept
    with pytest.raises(AssertionError, match="it ended"):
        proc.wait_line("a line that never comes", timeout=5)
    with pytest.raises(pytest.fail.Exception, match=re.escape("never: not reached within 0.3 s")):
        wait_until(lambda: False, 0.3, what="never")
    assert wait_until(lambda: True, 0.3) < 0.3


def test_a_started_server_is_stopped_when_the_test_ends() -> None:
    cli = EtcdRdzvCli()
    proc = cli.start("serve")
    endpoint = proc.readline(60).strip()
    assert endpoint.startswith("127.0.0.1:")
    cli.close()  # what the fixture does after the test
    assert proc.proc.returncode == 0  # SIGTERM: serve stopped its etcd and exited
    with socket.socket() as s:
        host, port = endpoint.split(":")
        assert s.connect_ex((host, int(port))) != 0, "etcd still listens"


def test_the_example_of_docs_testing(
    etcd_rdzv_cli: EtcdRdzvCli, etcd_server: EtcdServer, etcd_key_prefix: str
) -> None:
    """docs/testing.md's example, as written there."""
    conn = ["--endpoint", etcd_server.endpoint, "--key-prefix", etcd_key_prefix]
    waiting = etcd_rdzv_cli.start("join", "--run-id", "job", "--min-nodes", "2", *conn)
    etcd_rdzv_cli.until(lambda: etcd_rdzv_cli.status("job", *conn)["waiting"])
    assert etcd_rdzv_cli.run("close", "--run-id", "job", *conn).returncode == 0
    assert waiting.finish().returncode == 1
