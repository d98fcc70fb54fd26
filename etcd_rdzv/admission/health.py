"""The health gate: a check a node runs before each join, and the record of a failure.

Option ``health_check`` names the check: a command line (split as a shell would,
run without one) or ``python:<module>:<function>`` (imported when it first runs).
:func:`gate` runs it before every join; while it fails, the failure is recorded
under the run (``<rdzv>/hosts/health/<host>``, :func:`_keys.health_key`), logged at
WARNING, and the check runs again after :data:`RETRY_PAUSE` seconds, until it passes
or ``join_timeout`` is spent; then :class:`HealthCheckError` names the check, the host
and why. A passing check deletes the host's record. The node never writes a join key
before its check passed, so it never enters a round.

The record is JSON, ``{"host", "check", "why", "output", "at"}`` (``at``: the
writer's wall clock, ISO 8601, shown but never compared), with a TTL of
:data:`RECORD_TTL_JOINS` join timeouts so that records of hosts gone stale go by
themselves. :func:`parse_failure` reads it strictly (it is untrusted input).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib
import json
import logging
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .. import _keys
from .._kv import KV, Record
from ..config.params import ENV_HOST_ID, LEAVE_GRACE, HandlerSettings, host_id_error
from ..errors import (
    LOGGED_AND_RAISED,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousStateError,
)

__all__ = [
    "ERROR_CHARS",
    "ERROR_LINES",
    "RETRY_PAUSE",
    "CheckResult",
    "HealthCheckError",
    "HealthFailure",
    "failure_record",
    "failures_in",
    "gate",
    "last_output",
    "parse_failure",
    "run_check",
]

log = logging.getLogger(__name__)

#: Seconds between two runs of a failing check (fixed: a check is a local program,
#: and a host that recovers joins within this of recovering).
RETRY_PAUSE = 5.0
#: A failure record lives this many join timeouts (at least a minute) after its write.
RECORD_TTL_JOINS = 3
#: Lines of a check's output kept (its last ones), and characters of each line.
MAX_LINES = 20
MAX_LINE = 300
#: The most of a check's output an error message shows: its last lines, this many
#: at most and this many characters in all (the record keeps more).
ERROR_LINES = 5
ERROR_CHARS = 1024
#: Bytes of a command's output kept in memory while it runs (its tail).
_TAIL_BYTES = 16 * 1024
#: Bytes of a record read at most, and characters of its ``check`` and ``why``.
_MAX_RECORD = 32 * 1024
_MAX_TEXT = 4096
#: Seconds the output reader may take after a killed command (a grandchild that
#: left the process group may hold the pipe).
_READER_GRACE = 2.0
#: Variables a command check is given (besides the agent's environment).
ENV_RUN_ID = "ETCD_RDZV_RUN_ID"


class HealthCheckError(RendezvousError):
    """The node's health check kept failing until ``join_timeout`` was spent: it
    never joined (the message names the check, the host and why)."""


@dataclass(frozen=True)
class CheckResult:
    """One run of a check: passed or not, why not, and its last output lines."""

    ok: bool
    why: str = ""
    output: tuple[str, ...] = ()


@dataclass(frozen=True)
class HealthFailure:
    """A host's latest failed check, as the run's record holds it."""

    host: str
    check: str
    why: str
    output: tuple[str, ...]
    at: dt.datetime | None  # the writer's wall clock; informational only

    def to_json(self) -> dict[str, Any]:
        """As ``etcd-rdzv status --json`` shows it (``at``: ISO 8601)."""
        return {
            "host": self.host,
            "check": self.check,
            "why": self.why,
            "output": list(self.output),
            "at": None if self.at is None else self.at.isoformat(),
        }


def _lines(text: str) -> tuple[str, ...]:
    lines = [line[:MAX_LINE] for line in text.splitlines() if line.strip()]
    return tuple(lines[-MAX_LINES:])


def last_output(output: Sequence[str]) -> str:
    """The end of a check's ``output`` on one line (``" | "`` between lines), as an
    error shows it: at most :data:`ERROR_LINES` lines and :data:`ERROR_CHARS`
    characters, the oldest cut first (``...`` says so). One line, because a command
    line tool shows an error's first line only."""
    shown = " | ".join(line.strip() for line in output[-ERROR_LINES:])
    if len(shown) > ERROR_CHARS - 6:
        return "..." + shown[-(ERROR_CHARS - 3) :]
    return ("... | " if len(output) > ERROR_LINES else "") + shown


# -- running a check -----------------------------------------------------------------------


def run_check(check: str, timeout: float, env: dict[str, str] | None = None) -> CheckResult:
    """Run ``check`` (the option's value) once, for at most ``timeout`` seconds.

    Never raises for what the check does: a failure to start, an exit code, a
    timeout, an exception are all a failed :class:`CheckResult`.
    """
    if check.startswith("python:"):
        return _run_callable(check, timeout)
    return _run_command(shlex.split(check), timeout, env)


def _run_command(argv: list[str], timeout: float, env: dict[str, str] | None) -> CheckResult:
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, killed whole on timeout
            env=None if env is None else {**os.environ, **env},
        )
    except OSError as exc:
        return CheckResult(False, f"could not start {argv[0]!r}: {exc}")
    tail = bytearray()

    def read() -> None:
        assert proc.stdout is not None
        while chunk := os.read(proc.stdout.fileno(), 4096):
            tail.extend(chunk)
            if len(tail) > 2 * _TAIL_BYTES:
                del tail[:-_TAIL_BYTES]

    reader = threading.Thread(target=read, name="etcd-rdzv-health-output", daemon=True)
    reader.start()
    timed_out = False
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc.pid)
        code = proc.wait()
    finally:
        reader.join(_READER_GRACE)
        if reader.is_alive():  # the pipe is held by a process outside the group
            _kill_group(proc.pid)
        elif proc.stdout is not None:
            proc.stdout.close()
    output = _lines(bytes(tail[-_TAIL_BYTES:]).decode("utf-8", "replace"))
    if timed_out:
        return CheckResult(False, f"timed out after {timeout:g}s (killed)", output)
    if code != 0:
        why = f"exit code {code}" if code > 0 else f"killed by signal {-code}"
        return CheckResult(False, why, output)
    return CheckResult(True, "", output)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # gone already
        os.killpg(pid, signal.SIGKILL)


def _run_callable(check: str, timeout: float) -> CheckResult:
    _, module_name, function_name = check.split(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in function_name.split("."):
            target = getattr(target, part)
    except Exception as exc:  # an import error, an attribute missing
        return CheckResult(False, f"could not load {module_name}:{function_name}: {exc!r}")
    if not callable(target):
        return CheckResult(False, f"{module_name}:{function_name} is not callable")
    done: list[CheckResult] = []

    def call(function: Callable[[], Any]) -> None:
        try:
            returned = function()
        except BaseException as exc:  # the check's failure, whatever it is
            done.append(CheckResult(False, f"raised {type(exc).__name__}", _lines(str(exc))))
            return
        if returned is False:
            done.append(CheckResult(False, "returned False"))
        else:
            done.append(CheckResult(True))

    # A thread, so that a callable that hangs is bounded too (it cannot be killed: it
    # runs on, a daemon, and its late answer is dropped).
    thread = threading.Thread(target=call, args=(target,), name="etcd-rdzv-health", daemon=True)
    thread.start()
    thread.join(timeout)
    if not done:
        return CheckResult(False, f"timed out after {timeout:g}s (still running)")
    return done[0]


# -- the record ----------------------------------------------------------------------------


def failure_record(host: str, check: str, result: CheckResult, at: dt.datetime) -> str:
    """The value of a host's health record after ``result`` (a failure)."""
    return json.dumps(
        {
            "host": host,
            "check": check[:_MAX_TEXT],
            "why": result.why[:_MAX_TEXT],
            "output": list(result.output),
            "at": at.isoformat(),
        }
    )


def parse_failure(record: Record) -> HealthFailure:
    """A health record, strictly.

    Raises:
        RendezvousStateError: naming the key, for anything but a record of this module
            whose ``host`` matches its key.
    """
    try:
        if len(record.value) > _MAX_RECORD:
            raise ValueError(f"over {_MAX_RECORD} characters")
        data = json.loads(record.value)
        if not isinstance(data, dict) or set(data) != {"host", "check", "why", "output", "at"}:
            raise ValueError("not an object of host, check, why, output, at")
        host, check, why, output, at = (data[k] for k in ("host", "check", "why", "output", "at"))
        if not isinstance(host, str) or host_id_error(host) is not None:
            raise ValueError("host is not a host id")
        if record.key.rsplit("/", 1)[-1] != _keys.b64_key(host):
            raise ValueError(f"host {host!r} is not the key's")
        for name, text in (("check", check), ("why", why)):
            if not isinstance(text, str) or len(text) > _MAX_TEXT:
                raise ValueError(f"{name} is not a string of at most {_MAX_TEXT} characters")
        if not isinstance(output, list) or len(output) > MAX_LINES:
            raise ValueError(f"output is not a list of at most {MAX_LINES} lines")
        if not all(isinstance(line, str) and len(line) <= MAX_LINE for line in output):
            raise ValueError(f"output holds a line that is no string of {MAX_LINE} characters")
        when = dt.datetime.fromisoformat(at) if isinstance(at, str) and len(at) <= 64 else None
        if when is None:
            raise ValueError("at is not an ISO 8601 time")
    except (ValueError, TypeError, RecursionError) as exc:
        raise RendezvousStateError(f"{record.key}: not a health record ({exc})") from None
    return HealthFailure(host, check, why, tuple(output), when)


def failures_in(
    found: Sequence[Record], key_prefix: str, run_id: str, problems: list[str]
) -> tuple[HealthFailure, ...]:
    """The health records among ``found`` (a listing of the run's ``rdzv``
    directory), by host; a record that does not parse is added to ``problems``."""
    directory = _keys.hosts_dir(key_prefix, run_id) + "/health/"
    failures: list[HealthFailure] = []
    for record in found:
        if record.key.startswith(directory):
            try:
                failures.append(parse_failure(record))
            except RendezvousStateError as exc:
                problems.append(str(exc))
    return tuple(sorted(failures, key=lambda f: f.host))


# -- the gate ------------------------------------------------------------------------------


def gate(kv: KV, s: HandlerSettings, node_id: str, deadline: float) -> None:
    """Run the health check until it passes (then delete the host's record), or
    ``deadline`` (``time.monotonic()``) comes: then raise.

    Raises:
        HealthCheckError: the check failed until the deadline (logged at ERROR too).
    """
    check = s.health_check
    if check is None:
        return
    key = _keys.health_key(s.key_prefix, s.run_id, s.host_id)
    env = {ENV_RUN_ID: s.run_id, ENV_HOST_ID: s.host_id}
    ttl = max(60, RECORD_TTL_JOINS * s.join_timeout)
    tries = 0
    while True:
        tries += 1
        remaining = deadline - time.monotonic()
        result = run_check(check, max(1.0, min(float(s.health_check_timeout), remaining)), env)
        if result.ok:
            _write(kv, s, deadline, lambda: kv.delete(key))
            if tries > 1:
                log.info("run %s: host %s passed health check %r", s.run_id, s.host_id, check)
            return
        last = f"; last output: {last_output(result.output)}" if result.output else ""
        value = failure_record(s.host_id, check, result, dt.datetime.now(dt.timezone.utc))
        _write(kv, s, deadline, lambda: kv.put(key, value, ttl))  # noqa: B023 (called at once)
        if time.monotonic() + RETRY_PAUSE >= deadline:
            message = (
                f"Run {s.run_id!r}: host {s.host_id!r} (node {node_id}) failed its health "
                f"check {check!r} {tries} time(s) within join_timeout ({s.join_timeout}s) "
                f"and does not join: {result.why}{last}"
            )
            log.error("%s", message, extra={LOGGED_AND_RAISED: True})
            raise HealthCheckError(message)
        log.warning(
            "run %s: host %s (node %s) failed health check %r: %s%s; not joining, trying "
            "again in %gs",
            s.run_id,
            s.host_id,
            node_id,
            check,
            result.why,
            last,
            RETRY_PAUSE,
        )
        time.sleep(RETRY_PAUSE)


def _write(kv: KV, s: HandlerSettings, deadline: float, write: Callable[[], object]) -> None:
    """One write of the record; etcd failing it only costs the record (logged)."""
    try:
        # A moment past the join's deadline: the last failure is recorded too.
        with kv.bounded(max(deadline, time.monotonic()) + LEAVE_GRACE):
            write()
    except RendezvousConnectionError as exc:
        log.warning("run %s: host %s: health record not written: %s", s.run_id, s.host_id, exc)
