"""``etcd-rdzv status`` and ``etcd-rdzv close``: the output of a run's status, and closing.

Reading, watching and closing a run are the library's
(:mod:`etcd_rdzv.runs.status`, the same code
:meth:`~etcd_rdzv.EtcdRendezvousHandler.set_closed` uses); this module formats what
they return, says when the run does not exist (and which runs do), and keeps
``--watch`` going across a lost etcd. Every text that comes from etcd (node ids,
addresses, keys) goes through :func:`printable` before it reaches a terminal: a
forged node id must not draw lines of its own or send escape sequences.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import time
from collections.abc import Callable, Iterator, Sequence

from .._kv import KV
from ..admission.hosts import duration_text as human
from ..client._build import transport
from ..client._probe import established_here, other_keys, refusal_text, stray_text
from ..config.params import Settings
from ..errors import RendezvousConnectionError
from ..rendezvous.incarnation import close_run
from ..runs.status import DYNAMIC, RunStatus, read_run, run_ids, watch_run
from ._common import EXIT_OK, NotFound, Out, client, closest, one_line, parameters

__all__ = [
    "cmd_close",
    "cmd_status",
    "format_status",
    "human",
    "missing_run",
    "printable",
    "time_left",
]

_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}

#: Seconds between attempts to reach etcd again while ``--watch`` has lost it.
RECONNECT_PAUSE = 1.0

#: A status with what only the command can check added (the other API's keyspace).
_Check = Callable[[RunStatus], RunStatus]

# Home the cursor and clear the screen: --watch on a terminal draws each status anew.
_CLEAR = "\x1b[H\x1b[J"


def printable(text: str) -> str:
    """``text`` safe to print on one line of a terminal: a backslash, and every
    character that is not printable (control characters such as newline, carriage
    return and escape, format characters such as bidirectional overrides, separators
    other than the space), become Python-style escapes (``\\\\``, ``\\n``, ``\\x1b``,
    ``\\u202e``). Printable text, non-ASCII letters included, is unchanged."""
    if text.isprintable() and "\\" not in text:
        return text
    out = []
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif ch.isprintable():
            out.append(ch)
        else:
            # repr() escapes exactly the characters isprintable() rejects.
            out.append(repr(ch)[1:-1])
    return "".join(out)


def time_left(seconds: int) -> str:
    """Time still to go in its largest unit and the next: ``11h 59m``, ``12h 0m``,
    ``4m 10s``, ``42s``."""
    units = list(_UNITS.items())
    for i, (unit, size) in enumerate(units[:-1]):
        if seconds >= size:
            following, next_size = units[i + 1]
            return f"{seconds // size}{unit} {seconds % size // next_size}{following}"
    return f"{seconds}s"


def _relative(when: dt.datetime | None, now: dt.datetime) -> str:
    """``when`` (the writer's clock) from ``now`` (this host's): ``12s ago``, ``in 3s``
    (a heartbeat "in" the future: the clocks differ)."""
    if when is None:
        return "-"
    if when.tzinfo is None:  # torch writes UTC; a naive time is taken as UTC too
        when = when.replace(tzinfo=dt.timezone.utc)
    seconds = round((now - when).total_seconds())
    return f"{seconds}s ago" if seconds >= 0 else f"in {-seconds}s"


def format_status(status: RunStatus, now: dt.datetime | None = None) -> list[str]:
    """Human-readable lines for a run's status (see ``docs/cli.md``); text from etcd
    is escaped (:func:`printable`). ``now`` (default: this host's clock, UTC) dates
    the heartbeats of a dynamic run."""
    now = now or dt.datetime.now(dt.timezone.utc)
    dynamic = status.handler == DYNAMIC
    lines = [f"run: {printable(status.run_id)}"]
    if not status.exists:
        lines.append("keys: none (the run does not exist in this keyspace, or not yet)")
    if status.other_api is not None:
        lines.append(f"problem: {printable(status.other_api)}")
    if dynamic:
        lines.append("handler: etcd-rdzv-dynamic (torch's DynamicRendezvousHandler)")
    lines.append(f"closed: {'yes' if status.closed else 'no'}")
    if status.round == 0 and not status.waiting:
        lines.append("round: none (no node has joined this run)")
    else:
        if status.round == status.completed_round:
            state = "completed"
        elif any(w.round == status.round for w in status.waiting):
            state = "forming"
        else:
            state = "next; no node has joined it yet"
        lines.append(f"round: {status.round} ({state})")
    if status.deadline is not None:
        ends = _relative(status.deadline, now)
        lines.append(f"last call ends: {status.deadline.isoformat()} ({ends})")
    if status.completed_round is None:
        lines.append("latest completed round: none")
    else:
        lines.append(
            f"latest completed round: {status.completed_round} (world size {len(status.members)})"
        )
        last = "last heartbeat" if dynamic else "alive"
        # A group column only in runs whose nodes have a node_group.
        grouped = any(m.group is not None for m in status.members)
        hosted = any(m.host is not None for m in status.members)
        rows: list[tuple[str, ...]] = [
            ("rank", "node", "address", last)
            + (("group",) if grouped else ())
            + (("host",) if hosted else ())
        ]
        rows += [
            (
                str(m.rank),
                printable(m.node),
                printable(m.addr or "-"),
                _relative(m.last_heartbeat, now) if dynamic else ("yes" if m.alive else "no"),
            )
            + ((printable(m.group or "-"),) if grouped else ())
            + ((printable(m.host or "-"),) if hosted else ())
            for m in status.members
        ]
        lines += _table(rows)
    if status.failure is not None:
        lines.append(f"round {status.failure[0]} failed: {status.failure[1]!r}")
    lines += _health(status, now)
    spares = sum(w.spare for w in status.waiting)
    note = (
        f", {spares} of them spare(s): the group is at max_nodes, or they are short of "
        "a whole node_unit"
        if spares
        else ""
    )
    lines.append(f"waiting: {len(status.waiting)} node(s){note}")
    if status.waiting:
        grouped = any(w.group is not None for w in status.waiting)
        hosted = any(w.host is not None for w in status.waiting)
        header: tuple[str, ...] = ("round", "node", "address", "spare")
        header += ("last heartbeat",) if dynamic else ()
        rows = [header + (("group",) if grouped else ()) + (("host",) if hosted else ())]
        for w in status.waiting:
            row = [str(w.round), printable(w.node), printable(w.addr or "-")]
            row.append("yes" if w.spare else "no")
            if dynamic:
                row.append(_relative(w.last_heartbeat, now))
            if grouped:
                row.append(printable(w.group or "-"))
            if hosted:
                row.append(printable(w.host or "-"))
            rows.append(tuple(row))
        lines += _table(rows)
    if status.excluded:
        lines.append(f"excluded hosts: {len(status.excluded)}")
        rows = [("host", "by", "since", "for", "ends", "reason")]
        rows += [
            (
                printable(e.host),
                e.by,
                printable(e.at or "-"),
                human(e.seconds) if e.seconds else "until included",
                f"in {time_left(e.left)}" if e.left is not None else "-",
                printable(e.reason or "-"),
            )
            for e in status.excluded
        ]
        lines += _table(rows)
    if status.deaths:
        lines.append(f"deaths counted for quarantine: {len(status.deaths)}")
        rows = [("host", "node", "started", "found")]
        rows += [
            (printable(d.host), printable(d.node), printable(d.started or "-"), printable(d.found))
            for d in status.deaths
        ]
        lines += _table(rows)
    return lines


def _health(status: RunStatus, now: dt.datetime) -> list[str]:
    """The hosts kept out by a failed health check: why, when, the last output lines."""
    if not status.health:
        return []
    lines = [f"failed health checks: {len(status.health)} host(s), not joining"]
    rows = [("host", "why", "when", "check")]
    rows += [
        (printable(h.host), printable(h.why), _relative(h.at, now), printable(h.check))
        for h in status.health
    ]
    lines += _table(rows)
    for h in status.health:
        lines += [f"    {printable(h.host)} | {printable(line)}" for line in h.output[-3:]]
    return lines


def _table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


@contextlib.contextmanager
def _connected(
    args: argparse.Namespace, out: Out, *, any_api: bool = False
) -> Iterator[tuple[KV, Settings]]:
    """A client of the etcd the options name, and the settings; closed on exit.
    ``any_api``: not refused when the run has keys in the other API's keyspace (status
    shows that as a problem instead)."""
    params, settings = parameters(args)
    config = dataclasses.replace(settings.client, run_id=None) if any_api else settings.client
    kv = client(config)
    out.progress(f"connected to etcd at {params.endpoint}")
    try:
        yield kv, settings
    finally:
        kv.close()


@contextlib.contextmanager
def _other_api(kv: KV, settings: Settings) -> Iterator[_Check]:
    """What adds to a status why the run is in trouble on two APIs (it has keys in the
    other keyspace): one request a status, the check a run's client makes when it
    connects, over connections of its own (closed on exit)."""
    http = transport(settings.client)
    config = settings.client

    def check(status: RunStatus) -> RunStatus:
        found = other_keys(kv, config, http)
        if found is None:
            return status
        try:
            here = established_here(kv, config)
        except RendezvousConnectionError:
            here = False
        # A run that lives here: stray keys its nodes never see; otherwise the run may
        # live in the other keyspace, and a node on this API would be refused.
        text = stray_text(config, found) if here else refusal_text(config, found)
        return dataclasses.replace(status, other_api=text)

    try:
        yield check
    finally:
        http.close()


def missing_run(kv: KV, settings: Settings, status: RunStatus) -> str:
    """What to say of a run with no keys: where none are, which runs there are
    (the closest to the id given), and the other API's keyspace if the run is there."""
    from .. import _keys

    prefix, run_id, api = settings.client.key_prefix, settings.run_id, settings.client.api
    text = (
        f"run {printable(run_id)!r} does not exist: no key under "
        f"{printable(_keys.run_dir(prefix, run_id))}/ in etcd's {api} keyspace"
    )
    if status.other_api is not None:
        return f"{text}. {printable(status.other_api)}"
    runs = run_ids(kv, prefix)
    if runs is None:
        return text
    if not runs:
        return f"{text}; no run has keys under {printable(prefix)} there"
    known = closest(run_id, [printable(r) for r in runs])
    return f"{text}; runs there: {known}"


class _Screen:
    """Draws statuses: once, or (``--watch``) again on each change.

    With ``--watch``, a terminal is cleared before each drawing; a pipe gets each
    status after a blank line (text) or as one JSON object per line. A problem is
    warned about once, not on every drawing.
    """

    def __init__(self, args: argparse.Namespace, out: Out) -> None:
        self._json: bool = args.json
        self._watch: bool = args.watch
        self._out = out
        self._tty = bool(getattr(out.out, "isatty", lambda: False)())
        self._warned: set[str] = set()
        self._last: RunStatus | None = None
        self.drawn = 0  # statuses drawn so far

    def draw(self, status: RunStatus) -> None:
        if status == self._last:  # read again after etcd came back: nothing new
            return
        self._last = status
        warnings = [f"skipped {problem}" for problem in status.problems]
        warnings += [status.other_api] if status.other_api else []
        for problem in warnings:
            if problem not in self._warned:
                self._warned.add(problem)
                self._out.warning(printable(problem))
        if self._json:
            data = status.to_json()
            # ensure_ascii (the default): whatever etcd held leaves as plain ASCII.
            self._out.result(json.dumps(data) if self._watch else json.dumps(data, indent=2))
        else:
            lines = format_status(status)
            if self._watch and self._tty:
                lines[0] = _CLEAR + lines[0]
            elif self.drawn:
                self._out.result()
            for line in lines:
                self._out.result(line)
        self.drawn += 1


def cmd_status(args: argparse.Namespace, out: Out) -> int:
    """Print the status of ``--run-id`` (``--json``: one object). Read-only.

    A run with no keys in this keyspace is :class:`NotFound` (exit code 3), naming the
    runs there are (``--json`` still prints its object, ``"exists": false``).
    ``--watch``: print it again each time it changes (a run with no keys too: it may be
    about to start), until Ctrl-C or SIGTERM (then ``0``: that is how a watch ends);
    when etcd stops answering, say so and reconnect.
    """
    screen = _Screen(args, out)
    with (
        _connected(args, out, any_api=True) as (kv, settings),
        _other_api(kv, settings) as checked,
    ):
        prefix, run_id = settings.client.key_prefix, settings.run_id
        if not args.watch:
            status = checked(read_run(kv, prefix, run_id))
            if status.exists or args.json:  # JSON: one object whatever the answer
                screen.draw(status)
            if not status.exists:
                raise NotFound(missing_run(kv, settings, status))
            return EXIT_OK
        try:
            _watch(kv, settings, screen, out, checked)
        except KeyboardInterrupt:
            out.progress("stopped watching")
        return EXIT_OK


def _watch(kv: KV, settings: Settings, screen: _Screen, out: Out, checked: _Check) -> None:
    """Draw each change of the run, forever; across a lost etcd (stopped, restarted,
    a partition): say so once, try again every :data:`RECONNECT_PAUSE` seconds, and
    go on from a new read when it answers (a watch cannot resume across a restart)."""
    prefix, run_id = settings.client.key_prefix, settings.run_id
    lost = announced = False
    while True:
        statuses = watch_run(kv, prefix, run_id)
        try:
            for status in statuses:
                if lost:
                    lost = False
                    out.warning("etcd answers again; watching")
                screen.draw(checked(status))
                if not announced:
                    announced = True
                    out.progress(f"watching run {printable(run_id)}; Ctrl-C to stop")
        except RendezvousConnectionError as exc:
            if not lost:
                lost = True
                out.warning(f"lost etcd; reconnecting (Ctrl-C to stop): {one_line(exc)}")
            time.sleep(RECONNECT_PAUSE)
        finally:
            statuses.close()


def cmd_close(args: argparse.Namespace, out: Out) -> int:
    """Close ``--run-id``: later joins fail. A run with no keys is :class:`NotFound`
    (a mistyped id must not pass for a closed run), unless ``--force``."""
    note = ""
    with _connected(args, out) as (kv, settings):
        prefix, run_id = settings.client.key_prefix, settings.run_id
        status = read_run(kv, prefix, run_id)
        if not status.exists:
            if not args.force:
                raise NotFound(
                    missing_run(kv, settings, status)
                    + " (--force closes it all the same: its joins then fail)"
                )
            note = " (forced: it had no keys)"
        already = close_run(kv, prefix, run_id)
    shown = printable(settings.run_id)
    out.result(f"run {shown} closed{' (it already was)' if already else ''}{note}")
    return EXIT_OK
