"""The health gate without a server: the options, running a check, the record, the gate."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import pickle
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from etcd_rdzv import _keys
from etcd_rdzv._kv import Record
from etcd_rdzv.admission import health
from etcd_rdzv.admission.health import CheckResult, HealthCheckError, run_check
from etcd_rdzv.config.params import HandlerSettings, RendezvousParameters, Settings
from etcd_rdzv.errors import RendezvousError, RendezvousStateError

PREFIX = "/etcd_rdzv"


def P(**config: object) -> RendezvousParameters:
    return RendezvousParameters("etcd-rdzv", "127.0.0.1:2379", "run", 1, 2, **config)


# -- options -----------------------------------------------------------------------------


def test_no_check_by_default() -> None:
    s = Settings.from_params(P()).handler
    assert s.health_check is None and s.health_check_timeout == 60


@pytest.mark.parametrize(
    "value", ["/usr/bin/check --disk", "sh -c 'exit 3'", "python:my_checks:disk", "python:a.b:c.d"]
)
def test_good_checks_are_kept(value: str) -> None:
    s = Settings.from_params(P(health_check=value, health_check_timeout="5")).handler
    assert s.health_check == value and s.health_check_timeout == 5


@pytest.mark.parametrize(
    "value", ["sh -c 'unclosed", "python:mod", "python:mod:", "python:1mod:f", "python:a:b:c"]
)
def test_bad_checks_name_the_option_and_value(value: str) -> None:
    with pytest.raises(ValueError, match="health_check") as info:
        Settings.from_params(P(health_check=value))
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_bad_timeouts_name_the_option(value: str) -> None:
    with pytest.raises(ValueError, match="health_check_timeout"):
        Settings.from_params(P(health_check="true", health_check_timeout=value))


def test_a_callable_is_not_imported_at_settings_time() -> None:
    Settings.from_params(P(health_check="python:no_such_module_here:check"))
    assert "no_such_module_here" not in sys.modules


# -- running a check ---------------------------------------------------------------------


def test_a_passing_command() -> None:
    assert run_check("true", 10).ok


def test_a_failing_command_gives_its_exit_code_and_last_lines() -> None:
    result = run_check(f"{sys.executable} -c \"import sys; [print(i) for i in range(100)]; "
                       "print('disk bad', file=sys.stderr); sys.exit(3)\"", 10)  # fmt: skip
    assert not result.ok and result.why == "exit code 3"
    assert len(result.output) == health.MAX_LINES and result.output[-1] == "disk bad"


def test_output_is_bounded_in_bytes_and_line_length() -> None:
    result = run_check(f"{sys.executable} -c \"print('x' * 10_000_000); raise SystemExit(1)\"", 30)
    assert not result.ok and all(len(line) <= health.MAX_LINE for line in result.output)


def test_a_command_that_cannot_start() -> None:
    result = run_check("/no/such/check", 5)
    assert not result.ok and "could not start" in result.why


def test_a_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    # The check starts a grandchild and waits for it: both must go on timeout.
    script = f"sleep 60 & echo $! > {pid_file}; echo started; wait"
    started = time.monotonic()
    result = run_check(f"sh -c '{script}'", 1)
    assert time.monotonic() - started < 10
    assert not result.ok and "timed out after 1s" in result.why and result.output == ("started",)
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (not reaped by its dead parent yet) is gone as far as we care.
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    return True


def test_the_command_gets_the_run_and_host() -> None:
    env = {health.ENV_RUN_ID: "r1", "ETCD_RDZV_HOST_ID": "h1"}
    check = "sh -c 'test \"$ETCD_RDZV_RUN_ID/$ETCD_RDZV_HOST_ID\" = r1/h1'"
    assert run_check(check, 10, env).ok


def passes() -> None:
    pass


def returns_false() -> bool:
    return False


def raises() -> None:
    raise RuntimeError("gpu 3 missing\nnvidia-smi: 7 of 8")


def hangs() -> None:
    time.sleep(30)


def test_python_callables() -> None:
    module = __name__
    assert run_check(f"python:{module}:passes", 5).ok
    assert run_check(f"python:{module}:returns_false", 5) == CheckResult(False, "returned False")
    failed = run_check(f"python:{module}:raises", 5)
    assert failed == CheckResult(
        False, "raised RuntimeError", ("gpu 3 missing", "nvidia-smi: 7 of 8")
    )
    started = time.monotonic()
    assert "timed out" in run_check(f"python:{module}:hangs", 1).why
    assert time.monotonic() - started < 5
    assert "could not load" in run_check("python:no_such_module_here:f", 5).why
    assert "could not load" in run_check(f"python:{module}:no_such_function", 5).why


# -- the record --------------------------------------------------------------------------


def _record(host: str, value: Any) -> Record:
    key = _keys.health_key(PREFIX, "run", host)
    return Record(key, value if isinstance(value, str) else json.dumps(value), 3, 3)


def test_a_record_round_trips() -> None:
    at = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    value = health.failure_record("h1", "chk", CheckResult(False, "exit code 3", ("a", "b")), at)
    failure = health.parse_failure(_record("h1", value))
    assert (failure.host, failure.check, failure.why, failure.output, failure.at) == (
        "h1",
        "chk",
        "exit code 3",
        ("a", "b"),
        at,
    )
    assert failure.to_json()["at"] == at.isoformat()


GOOD = {"host": "h1", "check": "c", "why": "w", "output": [], "at": "2026-01-01T00:00:00+00:00"}


@pytest.mark.parametrize(
    "value",
    [
        "not json",
        "[" * 100_000,
        [],
        {**GOOD, "extra": 1},
        {**GOOD, "host": "other"},  # not the key's host
        {**GOOD, "host": "bad host"},
        {**GOOD, "why": 3},
        {**GOOD, "why": "w" * 5000},
        {**GOOD, "output": ["x"] * 21},
        {**GOOD, "output": ["x" * 301]},
        {**GOOD, "output": [1]},
        {**GOOD, "at": "yesterday"},
        {**GOOD, "at": 5},
    ],
)
def test_bad_records_are_state_errors_naming_the_key(value: Any) -> None:
    record = _record("h1", value)
    with pytest.raises(RendezvousStateError, match="not a health record") as info:
        health.parse_failure(record)
    assert record.key in str(info.value)


def test_failures_in_a_listing_and_problems() -> None:
    good = _record("h1", GOOD)
    bad = _record("h2", "junk")
    other = Record(_keys.round_dir(PREFIX, "run", 1) + "/result", "{}", 1, 1)
    problems: list[str] = []
    found = health.failures_in([other, bad, good], PREFIX, "run", problems)
    assert [f.host for f in found] == ["h1"] and len(problems) == 1 and bad.key in problems[0]


# -- the gate ----------------------------------------------------------------------------


class FakeKV:
    def __init__(self) -> None:
        self.keys: dict[str, tuple[str, int | None]] = {}

    @contextlib.contextmanager
    def bounded(self, deadline: float) -> Iterator[None]:
        yield

    def put(self, key: str, value: str, ttl: int | None) -> None:
        self.keys[key] = (value, ttl)

    def delete(self, key: str) -> bool:
        return self.keys.pop(key, None) is not None


def _settings(check: str, join_timeout: int = 600) -> HandlerSettings:
    return Settings.from_params(
        P(health_check=check, host_id="h1", join_timeout=join_timeout)
    ).handler


def test_the_gate_fails_with_the_check_host_and_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(health, "RETRY_PAUSE", 0.2)
    kv = FakeKV()
    s = _settings("sh -c 'echo disk bad; exit 3'", join_timeout=10)
    caplog.set_level(logging.WARNING, "etcd_rdzv")
    with pytest.raises(HealthCheckError) as info:
        health.gate(kv, s, "node-1", time.monotonic() + 1.0)  # type: ignore[arg-type]
    message = str(info.value)
    assert isinstance(info.value, RendezvousError)
    for part in ("'h1'", "sh -c 'echo disk bad; exit 3'", "exit code 3", "disk bad"):
        assert part in message
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and "exit code 3" in warnings[0].getMessage()
    (value, ttl), = kv.keys.values()  # fmt: skip
    assert ttl == 60 and json.loads(value)["output"] == ["disk bad"]
    assert health.parse_failure(_record("h1", value)).why == "exit code 3"


def test_the_gate_passes_once_the_check_does_and_deletes_the_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(health, "RETRY_PAUSE", 0.1)
    flag = tmp_path / "healthy"
    # Fails once, then passes: the file is made on the second run.
    script = f"test -e {flag}.1 && touch {flag}; touch {flag}.1; test -e {flag}"
    kv = FakeKV()
    s = _settings(f"sh -c '{script}'")
    health.gate(kv, s, "node-1", time.monotonic() + 30)  # type: ignore[arg-type]
    assert flag.exists() and kv.keys == {}


def test_no_check_no_gate() -> None:
    kv = FakeKV()
    health.gate(kv, Settings.from_params(P()).handler, "n", time.monotonic())  # type: ignore[arg-type]
    assert kv.keys == {}


def test_the_dynamic_handler_warns_that_it_runs_no_check(caplog: pytest.LogCaptureFixture) -> None:
    params = RendezvousParameters(
        "etcd-rdzv-dynamic", "127.0.0.1:2379", "run", 1, 2, health_check="true"
    )
    with caplog.at_level(logging.WARNING, "etcd_rdzv"):
        Settings.from_params(params)
    assert "'health_check' are read by the native handler" in caplog.text
    assert "keeps no host out" in caplog.text


def test_the_error_pickles_as_itself() -> None:
    error = HealthCheckError("host 'h1' failed its health check")
    again = pickle.loads(pickle.dumps(error))
    # With torch loaded (the whole suite), both are its flavour of HealthCheckError.
    assert type(again) is type(error) and isinstance(again, HealthCheckError)
    assert str(again) == str(error)
