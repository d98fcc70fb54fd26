"""The ``etcd-rdzv`` command line: demo, join, status, close and a development etcd.

Results go to stdout, progress to stderr. Exit codes: ``0`` success, ``1`` failure
(etcd unreachable, rendezvous closed or timed out, etcd did not start), ``2`` usage
error (a bad option; argparse's convention), ``130`` interrupted (Ctrl-C, SIGTERM).
Errors are one line, ``etcd-rdzv: error: ...``; ``--debug`` adds the traceback and
debug logs.

The CLI never imports torch: it calls :func:`etcd_rdzv.create_handler` with
``use_torch=False``, because importing torch costs seconds per process and the CLI
needs the round and the peer addresses, which torch's ``RendezvousInfo`` does not
carry. ``demo --torch`` builds torch's flavour, to show that path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from types import FrameType
from typing import IO, Any, NoReturn

from . import __version__, _keys
from ._factory import create_handler
from ._kv import KV, Record
from .client import create_client
from .errors import RendezvousError
from .handler import _META_TTL, EtcdRendezvousHandler, HandlerSettings, RendezvousResult
from .params import DEFAULT_KEY_PREFIX, DEFAULT_READ_TIMEOUT, ClientConfig, RendezvousParameters
from .params import parse_endpoints as _parse_endpoints

__all__ = ["build_parser", "main"]

log = logging.getLogger(__name__)

PROG = "etcd-rdzv"
BACKEND = "etcd-rdzv"  # the native handler's name, as torchrun knows it
DEFAULT_ENDPOINT = "127.0.0.1:2379"
ENV_ENDPOINT = "ETCD_RDZV_ENDPOINT"
ENV_PASSWORD = "ETCD_RDZV_PASSWORD"

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

# How long `join` waits for its peers to have read the round before it leaves (a
# member that leaves deletes its join key, which holds its address).
_JOIN_BARRIER = timedelta(seconds=30)
_DEMO_STORE_TIMEOUT = timedelta(seconds=30)
_DEMO_KEY = "demo/greeting"

# Rendezvous option names (as in error messages of the library) -> our flags.
_FLAGS = {
    "endpoint": "--endpoint",
    "key_prefix": "--key-prefix",
    "protocol": "--protocol",
    "ca_cert": "--ca-cert",
    "ssl_cert": "--ssl-cert",
    "ssl_cert_key": "--ssl-cert-key",
    "tls_insecure": "--tls-insecure",
    "username": "--username",
    "password": "--password",
    "read_timeout": "--read-timeout",
    "join_timeout": "--join-timeout",
    "last_call_timeout": "--last-call-timeout",
    "keep_alive_interval": "--keep-alive-interval",
}


class _Interrupted(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that cleanup (``finally``) runs."""


# -- output ------------------------------------------------------------------------------


@dataclass
class _Out:
    """Where results (stdout) and progress (stderr) go."""

    quiet: bool = False
    out: IO[str] = field(default_factory=lambda: sys.stdout)
    err: IO[str] = field(default_factory=lambda: sys.stderr)

    def result(self, line: str = "") -> None:
        print(line, file=self.out, flush=True)

    def progress(self, line: str) -> None:
        if not self.quiet:
            print(f"{PROG}: {line}", file=self.err, flush=True)

    def warning(self, message: str) -> None:
        print(f"{PROG}: warning: {message}", file=self.err, flush=True)

    def error(self, message: str) -> None:
        print(f"{PROG}: error: {message}", file=self.err, flush=True)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    first, _, rest = text.partition("\n")
    return first + (" (more with --debug)" if rest.strip() else "")


# -- argument types ----------------------------------------------------------------------


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            what = "a positive" if minimum == 1 else f"an integer >= {minimum}, not a"
            raise argparse.ArgumentTypeError(f"must be {what} integer, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def _port(text: str) -> int:
    value = _int_at_least(1)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (1-65535), got {value}")
    return value


def _endpoint(text: str) -> str:
    try:
        _parse_endpoints(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("Option 'endpoint': ", "")) from None
    return text


def _run_id(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


_positive = _int_at_least(1)
_non_negative = _int_at_least(0)


# -- the parser --------------------------------------------------------------------------


class _Formatter(argparse.HelpFormatter):
    """Fills each paragraph of a description on its own; shows defaults that say something."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n\n".join(
            super(_Formatter, self)._fill_text(part, width, indent) for part in text.split("\n\n")
        )

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            action.option_strings
            and action.default not in (None, False, argparse.SUPPRESS)
            and "default" not in text
        ):
            text += " (default: %(default)s)"
        return text


def _global_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    # Accepted before and after the subcommand; SUPPRESS keeps a subcommand's unset
    # flag from overwriting the value given before it.
    default: Any = argparse.SUPPRESS if suppress else False
    group = parser.add_argument_group("output")
    group.add_argument(
        "--debug",
        action="store_true",
        default=default,
        help="show debug logs and a traceback on errors",
    )
    group.add_argument(
        "-v", "--verbose", action="store_true", default=default, help="show the library's logs"
    )
    group.add_argument(
        "-q", "--quiet", action="store_true", default=default, help="no progress on stderr"
    )


def _etcd_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("etcd connection")
    group.add_argument(
        "--endpoint",
        type=_endpoint,
        default=None,
        metavar="HOST[:PORT][,...]",
        help=f"etcd client endpoints (default: ${ENV_ENDPOINT}, else {DEFAULT_ENDPOINT})",
    )
    group.add_argument(
        "--key-prefix",
        default=DEFAULT_KEY_PREFIX,
        metavar="PATH",
        help="etcd directory that holds every run",
    )
    group.add_argument(
        "--protocol", choices=("http", "https"), default="http", help="how to talk to etcd"
    )
    group.add_argument("--ca-cert", metavar="FILE", help="CA bundle that verifies etcd (https)")
    group.add_argument("--ssl-cert", metavar="FILE", help="client certificate (https)")
    group.add_argument("--ssl-cert-key", metavar="FILE", help="key of --ssl-cert, if separate")
    group.add_argument(
        "--tls-insecure",
        action="store_true",
        help="do NOT verify etcd's certificate (https; logs a warning)",
    )
    group.add_argument("--username", metavar="USER", help="etcd user")
    group.add_argument(
        "--password",
        metavar="PASSWORD",
        help=f"password of --username (default: ${ENV_PASSWORD}; prefer the variable, "
        "command lines are visible to other users)",
    )
    group.add_argument(
        "--read-timeout",
        type=_positive,
        default=DEFAULT_READ_TIMEOUT,
        metavar="SECONDS",
        help="bound of each request to etcd",
    )


def _rendezvous_options(
    parser: argparse.ArgumentParser, *, join_timeout: int, last_call: int, keep_alive: int
) -> None:
    group = parser.add_argument_group("rendezvous")
    group.add_argument(
        "--join-timeout",
        type=_positive,
        default=join_timeout,
        metavar="SECONDS",
        help="fail if the round does not complete within this time",
    )
    group.add_argument(
        "--last-call-timeout",
        type=_non_negative,
        default=last_call,
        metavar="SECONDS",
        help="once --min-nodes joined, wait this long for more",
    )
    group.add_argument(
        "--keep-alive-interval",
        type=_positive,
        default=keep_alive,
        metavar="SECONDS",
        help="heartbeat interval; a node is dropped after 3 missed beats",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``etcd-rdzv`` (no side effects; no network)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Rendezvous over etcd for elastic distributed jobs: try it locally, "
        "join a rendezvous from a shell script, inspect or close a run, or serve a "
        "development etcd.",
        epilog="Exit codes: 0 ok, 1 failure, 2 usage error, 130 interrupted. "
        f"Run '{PROG} COMMAND --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _global_options(parser, suppress=False)
    commands = parser.add_subparsers(
        dest="command", metavar="{demo,join,status,close,serve}", title="commands"
    )
    commands.required = True

    def add(name: str, help_text: str | None, description: str) -> argparse.ArgumentParser:
        kwargs: dict[str, Any] = {"description": description, "formatter_class": _Formatter}
        if help_text is not None:  # no help: the command is not listed (hidden)
            kwargs["help"] = help_text
        sub = commands.add_parser(name, **kwargs)
        _global_options(sub, suppress=True)
        sub.set_defaults(parser_=sub)
        return sub

    demo = add(
        "demo",
        "run local nodes through one rendezvous",
        "Start an embedded etcd (unless --endpoint or $ETCD_RDZV_ENDPOINT is given), run "
        "--nodes local processes through one rendezvous, print their ranks, check the "
        "round's store, and clean up.",
    )
    demo.add_argument("--nodes", type=_positive, default=4, metavar="N", help="local nodes to run")
    demo.add_argument(
        "--min-nodes", type=_positive, metavar="N", help="minimum nodes (default: --nodes)"
    )
    demo.add_argument(
        "--max-nodes", type=_positive, metavar="N", help="maximum nodes (default: --nodes)"
    )
    demo.add_argument(
        "--run-id", type=_run_id, metavar="ID", help="run id (default: demo-<random>)"
    )
    demo.add_argument(
        "--torch",
        action="store_true",
        help="build the handlers with create_handler (torch's flavour if torch is "
        "installed; slower: each node imports torch)",
    )
    _rendezvous_options(demo, join_timeout=60, last_call=1, keep_alive=1)
    _etcd_options(demo)
    demo.set_defaults(func=_cmd_demo)

    join = add(
        "join",
        "join a rendezvous and print rank, world size and peers",
        "Join the rendezvous of --run-id, wait until the round completes, print this "
        "node's rank, the world size, the round and the peers' addresses in rank order, "
        "then leave (the run's other members then see this node gone).\n\n"
        'With --export:  eval "$(etcd-rdzv join --run-id job1 --min-nodes 2 --export)"',
    )
    join.add_argument("--run-id", type=_run_id, required=True, metavar="ID", help="run id")
    join.add_argument("--min-nodes", type=_positive, required=True, metavar="N")
    join.add_argument("--max-nodes", type=_positive, metavar="N", help="(default: --min-nodes)")
    join.add_argument(
        "--local-addr",
        metavar="ADDR",
        help="this node's address as peers should reach it (default: this host's FQDN)",
    )
    join.add_argument(
        "--export",
        action="store_true",
        help="print 'export NAME=value' shell lines (RANK, WORLD_SIZE, MASTER_ADDR, ...)",
    )
    join.add_argument(
        "--master-port",
        type=_port,
        metavar="PORT",
        help="with --export, also export MASTER_PORT=PORT",
    )
    _rendezvous_options(join, join_timeout=600, last_call=30, keep_alive=5)
    _etcd_options(join)
    join.set_defaults(func=_cmd_join)

    status = add(
        "status",
        "show a run: closed, round, members, waiting nodes",
        "Read the run's keys and show whether it is closed, the current round, the "
        "members of the latest completed round in rank order and the nodes waiting "
        "for the next round. Read-only.",
    )
    status.add_argument("--run-id", type=_run_id, required=True, metavar="ID", help="run id")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    _etcd_options(status)
    status.set_defaults(func=_cmd_status)

    close = add(
        "close",
        "close a run: later joins fail",
        "Mark the run closed (what handler.set_closed() does): nodes waiting in or "
        "joining it get a 'closed' error; the marker expires after 2 hours.",
    )
    close.add_argument("--run-id", type=_run_id, required=True, metavar="ID", help="run id")
    _etcd_options(close)
    close.set_defaults(func=_cmd_close)

    serve = add(
        "serve",
        "run a development etcd in the foreground",
        "Run a single-member etcd on 127.0.0.1 for development (v2 API on, which "
        "etcd_rdzv needs), print its endpoint on stdout, and stop it cleanly on Ctrl-C "
        "or SIGTERM. Not for production: no TLS, no auth, loopback only.",
    )
    serve.add_argument(
        "--port", type=_port, metavar="PORT", help="client port (default: a free port)"
    )
    serve.add_argument(
        "--data-dir",
        metavar="DIR",
        help="keep etcd's data here (default: a temporary directory, removed on stop)",
    )
    serve.add_argument(
        "--no-v2",
        dest="v2",
        action="store_false",
        help="do not serve the v2 API (etcd_rdzv cannot use such an etcd yet)",
    )
    serve.set_defaults(func=_cmd_serve)

    node = add("_node", None, "Internal: one node of 'demo'.")
    node.add_argument("--run-id", type=_run_id, required=True)
    node.add_argument("--min-nodes", type=_positive, required=True)
    node.add_argument("--max-nodes", type=_positive, required=True)
    node.add_argument("--index", type=_non_negative, required=True)
    node.add_argument("--torch", action="store_true")
    _rendezvous_options(node, join_timeout=60, last_call=1, keep_alive=1)
    _etcd_options(node)
    node.set_defaults(func=_cmd_node)
    return parser


# -- from arguments to parameters --------------------------------------------------------


def _usage_error(args: argparse.Namespace, message: str) -> NoReturn:
    for option, flag in _FLAGS.items():
        # Quoted names, and bare names with an underscore (no English word has one).
        bare = "?" if "_" in option else ""
        message = re.sub(rf"(?<![\w-])'{bare}{option}'{bare}(?![\w-])", flag, message)
    parser: argparse.ArgumentParser = args.parser_
    parser.error(message)  # exits with status 2


def _endpoint_of(args: argparse.Namespace) -> str:
    given: str | None = args.endpoint
    if given:
        return given
    env = os.environ.get(ENV_ENDPOINT, "").strip()
    if env:
        try:
            _parse_endpoints(env)
        except ValueError as exc:
            _usage_error(args, f"${ENV_ENDPOINT}: {exc}")
        return env
    return DEFAULT_ENDPOINT


def _params(
    args: argparse.Namespace,
    endpoint: str | None = None,
    *,
    min_nodes: int = 1,
    max_nodes: int = 1,
    local_addr: str | None = None,
) -> RendezvousParameters:
    """Validated rendezvous parameters from the etcd (and rendezvous) options; a bad
    value is a usage error naming the flag. No network I/O."""
    if max_nodes < min_nodes:
        _usage_error(
            args, f"argument --max-nodes: must be >= --min-nodes ({min_nodes}), got {max_nodes}"
        )
    config: dict[str, Any] = {
        "key_prefix": args.key_prefix,
        "protocol": args.protocol,
        "read_timeout": args.read_timeout,
        "ca_cert": args.ca_cert,
        "ssl_cert": args.ssl_cert,
        "ssl_cert_key": args.ssl_cert_key,
        "tls_insecure": args.tls_insecure,
        "username": args.username,
        "password": args.password if args.password is not None else os.environ.get(ENV_PASSWORD),
    }
    for option in ("join_timeout", "last_call_timeout", "keep_alive_interval"):
        if hasattr(args, option):
            config[option] = getattr(args, option)
    params = RendezvousParameters(
        BACKEND,
        endpoint if endpoint is not None else _endpoint_of(args),
        getattr(args, "run_id", None) or "-",
        min_nodes,
        max_nodes,
        local_addr,
        **{k: v for k, v in config.items() if v is not None},
    )
    try:
        config_ = ClientConfig.from_params(params)
        if hasattr(args, "join_timeout"):
            HandlerSettings.from_params(params, config_.key_prefix)
    except ValueError as exc:
        _usage_error(args, str(exc))
    return params


def _handler(params: RendezvousParameters, *, use_torch: bool = False) -> EtcdRendezvousHandler:
    """The native handler for ``params`` (probes etcd); imports torch only with
    ``use_torch``."""
    return create_handler(params, use_torch=use_torch)


def _rendezvous(handler: EtcdRendezvousHandler) -> RendezvousResult:
    # The base method on purpose: torch's flavour returns torch's RendezvousInfo, which
    # has neither the round nor the peers' addresses.
    result: RendezvousResult = EtcdRendezvousHandler.next_rendezvous(handler)
    return result


# -- join --------------------------------------------------------------------------------


def export_lines(
    run_id: str, result: RendezvousResult, master_port: int | None = None
) -> list[str]:
    """``export NAME=value`` lines (shell-quoted) describing ``result``."""
    values = {
        "RANK": str(result.rank),
        "WORLD_SIZE": str(result.world_size),
        "MASTER_ADDR": result.addrs[0] if result.addrs else "",
    }
    if master_port is not None:
        values["MASTER_PORT"] = str(master_port)
    values["ETCD_RDZV_ROUND"] = str(result.round)
    values["ETCD_RDZV_RUN_ID"] = run_id
    values["ETCD_RDZV_PEERS"] = ",".join(result.addrs)
    return [f"export {name}={shlex.quote(value)}" for name, value in values.items()]


def _barrier(result: RendezvousResult, name: str, out: _Out) -> None:
    """Wait until every member of the round got past its rendezvous.

    A member that leaves deletes its join key, and with it the address its peers read
    right after the round completes; without this, a fast member could leave before a
    slow one read its address.
    """
    store = result.store
    store.set(f"etcd-rdzv-cli/{name}/{result.rank}", "1")
    try:
        store.wait([f"etcd-rdzv-cli/{name}/{r}" for r in range(result.world_size)], _JOIN_BARRIER)
    except RendezvousError as exc:
        out.warning(f"not every member confirmed the round: {_one_line(exc)}")


def _cmd_join(args: argparse.Namespace, out: _Out) -> int:
    max_nodes = args.max_nodes or args.min_nodes
    params = _params(
        args, min_nodes=args.min_nodes, max_nodes=max_nodes, local_addr=args.local_addr
    )
    handler = _handler(params)
    out.progress(
        f"joining run {args.run_id!r} as node {handler.node_id} at {params.endpoint} "
        f"(min {args.min_nodes}, max {max_nodes} nodes)"
    )
    started = time.monotonic()
    try:
        result = _rendezvous(handler)
        _barrier(result, "join", out)
    finally:
        handler.shutdown()
    out.progress(
        f"round {result.round} complete in {time.monotonic() - started:.2f}s: rank "
        f"{result.rank} of {result.world_size}; left the run"
    )
    if args.export:
        for line in export_lines(args.run_id, result, args.master_port):
            out.result(line)
    else:
        out.result(f"rank: {result.rank}")
        out.result(f"world size: {result.world_size}")
        out.result(f"round: {result.round}")
        out.result(f"peers: {' '.join(a or '?' for a in result.addrs)}")
        out.result(f"nodes: {' '.join(result.members)}")
    return EXIT_OK


# -- status and close --------------------------------------------------------------------


@dataclass(frozen=True)
class Member:
    """A member of a completed round."""

    rank: int
    node: str
    addr: str | None  # None: its join key is gone (it left or died)

    @property
    def alive(self) -> bool:
        return self.addr is not None


@dataclass(frozen=True)
class Waiting:
    """A node with a join key in a round that has not completed."""

    round: int
    node: str
    addr: str


@dataclass(frozen=True)
class RunStatus:
    """What :func:`read_status` found under one run."""

    run_id: str
    closed: bool
    round: int  # the round being formed or run now (0: nothing yet)
    hint: int | None
    completed_round: int | None
    members: tuple[Member, ...]
    waiting: tuple[Waiting, ...]
    problems: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "closed": self.closed,
            "round": self.round,
            "hint": self.hint,
            "completed_round": self.completed_round,
            "members": [
                {"rank": m.rank, "node": m.node, "addr": m.addr, "alive": m.alive}
                for m in self.members
            ],
            "waiting": [{"round": w.round, "node": w.node, "addr": w.addr} for w in self.waiting],
            "problems": list(self.problems),
        }


def read_status(records: Sequence[Record], key_prefix: str, run_id: str) -> RunStatus:
    """The status of ``run_id`` from the records under its ``rdzv`` directory.

    Pure: the records come from ``kv.list_tree(_keys.rdzv_dir(key_prefix, run_id))``.
    Records that do not parse are skipped and described in ``problems``.
    """
    rdzv = _keys.rdzv_dir(key_prefix, run_id)
    closed = False
    hint: int | None = None
    results: dict[int, list[str]] = {}
    nodes: dict[int, dict[str, str]] = {}  # round -> node id -> address
    problems: list[str] = []
    for record in records:
        if record.key == rdzv + "/closed":
            closed = True
            continue
        if record.key == rdzv + "/round":
            try:
                hint = int(record.value)
            except ValueError:
                problems.append(f"{record.key}: not a round number: {record.value!r}")
            continue
        where = _keys.round_of(rdzv, record.key)
        if where is None:
            continue
        round_no, rest = where
        try:
            data = json.loads(record.value)
            if rest == "result":
                listed = data["members"]
                if not isinstance(listed, list) or not all(isinstance(m, str) for m in listed):
                    raise TypeError("members is not a list of node ids")
                results[round_no] = listed
            elif rest.startswith("nodes/"):
                nodes.setdefault(round_no, {})[str(data["id"])] = str(data.get("addr") or "")
        except (ValueError, KeyError, TypeError) as exc:
            problems.append(f"{record.key}: not a record of etcd_rdzv's handler ({exc})")
    completed = max(results) if results else None
    present = max([*results, *nodes], default=0)
    current = max(present, hint or 0)
    members: tuple[Member, ...] = ()
    if completed is not None:
        alive = nodes.get(completed, {})
        members = tuple(
            Member(rank, node, alive.get(node)) for rank, node in enumerate(results[completed])
        )
    waiting = tuple(
        Waiting(round_no, node, addr)
        for round_no in sorted(nodes)
        if completed is None or round_no > completed
        for node, addr in sorted(nodes[round_no].items())
    )
    return RunStatus(run_id, closed, current, hint, completed, members, waiting, tuple(problems))


def format_status(status: RunStatus) -> list[str]:
    """Human-readable lines for :func:`read_status`'s result."""
    lines = [f"run: {status.run_id}", f"closed: {'yes' if status.closed else 'no'}"]
    if status.round == 0:
        lines.append("round: none (no node has joined this run)")
    else:
        if status.round == status.completed_round:
            state = "completed"
        elif any(w.round == status.round for w in status.waiting):
            state = "forming"
        else:
            state = "next; no node has joined it yet"
        lines.append(f"round: {status.round} ({state})")
    if status.completed_round is None:
        lines.append("latest completed round: none")
    else:
        lines.append(
            f"latest completed round: {status.completed_round} (world size {len(status.members)})"
        )
        rows: list[tuple[str, ...]] = [("rank", "node", "address", "alive")]
        rows += [
            (str(m.rank), m.node, m.addr or "-", "yes" if m.alive else "no") for m in status.members
        ]
        lines += _table(rows)
    lines.append(f"waiting: {len(status.waiting)} node(s)")
    if status.waiting:
        rows = [("round", "node", "address")]
        rows += [(str(w.round), w.node, w.addr or "-") for w in status.waiting]
        lines += _table(rows)
    return lines


def _table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _client(args: argparse.Namespace, out: _Out) -> tuple[KV, RendezvousParameters]:
    params = _params(args)
    kv = create_client(params)
    out.progress(f"connected to etcd at {params.endpoint}")
    return kv, params


def _cmd_status(args: argparse.Namespace, out: _Out) -> int:
    kv, params = _client(args, out)
    try:
        key_prefix = ClientConfig.from_params(params).key_prefix
        records, _ = kv.list_tree(_keys.rdzv_dir(key_prefix, args.run_id))
    finally:
        kv.close()
    status = read_status(records, key_prefix, args.run_id)
    for problem in status.problems:
        out.warning(f"skipped {problem}")
    if args.json:
        out.result(json.dumps(status.to_json(), indent=2))
    else:
        for line in format_status(status):
            out.result(line)
    return EXIT_OK


def _cmd_close(args: argparse.Namespace, out: _Out) -> int:
    kv, params = _client(args, out)
    try:
        key = _keys.closed_key(ClientConfig.from_params(params).key_prefix, args.run_id)
        before, _ = kv.get(key)
        kv.put(key, "1", _META_TTL)
    finally:
        kv.close()
    already = " (it already was)" if before is not None else ""
    out.result(f"run {args.run_id} closed{already}")
    return EXIT_OK


# -- demo --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _NodeReport:
    index: int
    data: dict[str, Any]


def _cmd_node(args: argparse.Namespace, out: _Out) -> int:
    """One demo node: rendezvous, store round-trip, barrier, leave; one JSON line."""
    params = _params(
        args, min_nodes=args.min_nodes, max_nodes=args.max_nodes, local_addr="127.0.0.1"
    )
    handler = _handler(params, use_torch=args.torch)
    report: dict[str, Any] = {"index": args.index, "node": handler.node_id}
    try:
        started = time.monotonic()
        try:
            result = _rendezvous(handler)
        except RendezvousError as exc:
            if handler.is_closed():  # not admitted before rank 0 closed the run
                report.update(admitted=False, reason=_one_line(exc))
                out.result(json.dumps(report))
                return EXIT_OK
            raise
        report.update(
            admitted=True,
            rank=result.rank,
            world_size=result.world_size,
            round=result.round,
            seconds=round(time.monotonic() - started, 3),
            torch="torch" in sys.modules,
        )
        store = result.store
        store.set_timeout(_DEMO_STORE_TIMEOUT)
        if result.rank == 0:
            store.set(_DEMO_KEY, f"hello from rank 0 ({handler.node_id})")
        report["value"] = store.get(_DEMO_KEY).decode("utf-8")
        _barrier(result, "demo", out)
        if result.rank == 0:
            handler.set_closed()  # nodes still waiting for a next round give up now
    finally:
        handler.shutdown()
    out.result(json.dumps(report))
    return EXIT_OK


def _node_command(args: argparse.Namespace, endpoint: str, index: int) -> list[str]:
    command = [sys.executable, "-m", "etcd_rdzv", "_node", "--quiet"]
    if args.debug:
        command.append("--debug")
    command += [
        f"--run-id={args.run_id}",
        f"--min-nodes={args.min_nodes}",
        f"--max-nodes={args.max_nodes}",
        f"--index={index}",
        f"--join-timeout={args.join_timeout}",
        f"--last-call-timeout={args.last_call_timeout}",
        f"--keep-alive-interval={args.keep_alive_interval}",
        f"--endpoint={endpoint}",
        f"--key-prefix={args.key_prefix}",
        f"--protocol={args.protocol}",
        f"--read-timeout={args.read_timeout}",
    ]
    for flag in ("ca_cert", "ssl_cert", "ssl_cert_key", "username"):
        value = getattr(args, flag)
        if value:
            command.append(f"--{flag.replace('_', '-')}={value}")
    if args.tls_insecure:
        command.append("--tls-insecure")
    if args.torch:
        command.append("--torch")
    return command


@contextlib.contextmanager
def _embedded_etcd(out: _Out) -> Iterator[str]:
    from .testing import EtcdServer

    started = time.monotonic()
    out.progress("starting an embedded etcd on free loopback ports")
    server = EtcdServer("etcd-rdzv-demo")
    try:
        server.start()
        took = time.monotonic() - started
        out.progress(f"embedded etcd ready at {server.endpoint} ({took:.2f}s)")
        yield server.endpoint
    finally:
        server.close()
        out.progress("embedded etcd stopped")


def _run_nodes(
    args: argparse.Namespace, endpoint: str, password: str | None, out: _Out
) -> list[_NodeReport]:
    env = dict(os.environ)
    if password is not None:
        env[ENV_PASSWORD] = password  # not on the command line, where `ps` shows it
    env.pop(ENV_ENDPOINT, None)
    procs: list[subprocess.Popen[str]] = []
    logs: list[IO[str] | None] = []
    done: queue.Queue[tuple[int, int, str]] = queue.Queue()

    def collect(i: int, proc: subprocess.Popen[str]) -> None:
        stdout, _ = proc.communicate()
        done.put((i, proc.returncode, stdout))

    with contextlib.ExitStack() as stack:
        stack.callback(_reap, procs)
        for i in range(args.nodes):
            errlog: IO[str] | None = None
            if not args.debug:  # with --debug the nodes' logs go straight to our stderr
                errlog = stack.enter_context(tempfile.TemporaryFile("w+", encoding="utf-8"))
            logs.append(errlog)
            proc = subprocess.Popen(
                _node_command(args, endpoint, i),
                stdout=subprocess.PIPE,
                stderr=errlog,
                stdin=subprocess.DEVNULL,
                env=env,
                text=True,
            )
            procs.append(proc)
            threading.Thread(
                target=collect, args=(i, proc), name=f"etcd-rdzv-demo-node-{i}", daemon=True
            ).start()
        out.progress(
            f"started {args.nodes} node processes for run {args.run_id!r} "
            f"(min {args.min_nodes}, max {args.max_nodes}, last call {args.last_call_timeout}s)"
        )
        deadline = time.monotonic() + args.join_timeout + 2 * args.read_timeout + 30
        reports: list[_NodeReport] = []
        for _ in procs:
            try:
                i, code, stdout = done.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                raise RendezvousError("demo nodes did not finish in time") from None
            if code != 0:
                raise RendezvousError(f"demo node {i} failed: {_node_error(logs[i], code)}")
            lines = stdout.strip().splitlines()
            try:
                reports.append(_NodeReport(i, json.loads(lines[-1])))
            except (IndexError, ValueError):
                raise RendezvousError(f"demo node {i} printed no report: {stdout!r}") from None
        return sorted(reports, key=lambda r: (not r.data["admitted"], r.data.get("rank", 0)))


def _reap(procs: list[subprocess.Popen[str]]) -> None:
    """Kill node processes still running (after a failure) and wait for all."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


def _node_error(errlog: IO[str] | None, code: int) -> str:
    if errlog is None:
        return f"exit status {code} (its errors are above)"
    errlog.seek(0)
    lines = [line.strip() for line in errlog.read().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(f"{PROG}: error:")]
    if errors:
        return errors[-1][len(f"{PROG}: error: ") :]
    return lines[-1] if lines else f"exit status {code}"


def _check_demo(reports: list[_NodeReport]) -> list[str]:
    """What is wrong with the nodes' reports (empty: all agree)."""
    members = [r.data for r in reports if r.data["admitted"]]
    if not members:
        return ["no node was admitted"]
    problems = []
    size = members[0]["world_size"]
    if sorted(m["rank"] for m in members) != list(range(size)):
        problems.append(f"ranks {sorted(m['rank'] for m in members)} are not 0..{size - 1}")
    if len({(m["world_size"], m["round"]) for m in members}) != 1:
        problems.append("members disagree on world size or round")
    if len({m["value"] for m in members}) != 1:
        problems.append("members read different store values")
    return problems


def _cmd_demo(args: argparse.Namespace, out: _Out) -> int:
    started = time.monotonic()
    args.min_nodes = args.min_nodes or min(args.nodes, args.max_nodes or args.nodes)
    args.max_nodes = args.max_nodes or max(args.nodes, args.min_nodes)
    if args.min_nodes > args.nodes:
        _usage_error(
            args,
            f"argument --min-nodes: must be at most --nodes ({args.nodes}), got {args.min_nodes}",
        )
    args.run_id = args.run_id or f"demo-{uuid.uuid4().hex[:8]}"
    given = (
        _endpoint_of(args) if args.endpoint or os.environ.get(ENV_ENDPOINT, "").strip() else None
    )
    # Validate everything before starting anything.
    params = _params(
        args,
        endpoint=given or DEFAULT_ENDPOINT,
        min_nodes=args.min_nodes,
        max_nodes=args.max_nodes,
    )
    password = params.get("password")
    with contextlib.ExitStack() as stack:
        if given is None:
            endpoint = stack.enter_context(_embedded_etcd(out))
            params.endpoint = endpoint
        else:
            endpoint = given
        kv = create_client(params)  # fail here, once, if etcd does not answer
        stack.callback(kv.close)
        run_dir = _keys.run_dir(ClientConfig.from_params(params).key_prefix, args.run_id)
        if given is not None:
            stack.callback(kv.delete_prefix, run_dir)  # leave no keys in a shared etcd
        reports = _run_nodes(args, endpoint, password, out)
        problems = _check_demo(reports)
        _print_demo(reports, out)
        if problems:
            raise RendezvousError("demo failed: " + "; ".join(problems))
        out.progress("handlers shut down; run closed by rank 0")
    out.progress(f"demo finished in {time.monotonic() - started:.2f}s")
    return EXIT_OK


def _print_demo(reports: list[_NodeReport], out: _Out) -> None:
    rows = [("proc", "node", "rank", "world size", "round", "rendezvous (s)")]
    for r in reports:
        d = r.data
        if d["admitted"]:
            rows.append(
                (
                    str(r.index),
                    d["node"],
                    str(d["rank"]),
                    str(d["world_size"]),
                    str(d["round"]),
                    f"{d['seconds']:.2f}",
                )
            )
        else:
            rows.append((str(r.index), d["node"], "-", "-", "-", "not admitted"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [row[0].rjust(widths[0]), row[1].ljust(widths[1])]
        cells += [cell.rjust(w) for cell, w in zip(row[2:], widths[2:], strict=True)]
        out.result("  ".join(cells))
    members = [r.data for r in reports if r.data["admitted"]]
    if members:
        value = members[0]["value"]
        flavour = "torch" if any(m["torch"] for m in members) else "native (torch not imported)"
        out.result(
            f"store round-trip: rank 0 set {_DEMO_KEY!r}, {len(members)} of "
            f"{len(members)} members read {value!r}: ok"
        )
        out.result(f"handler: {flavour}")
    late = len(reports) - len(members)
    if late:
        out.result(f"{late} node(s) were not admitted (round full) and gave up when it closed")


# -- serve -------------------------------------------------------------------------------


def _reserve_ports(port: int | None) -> tuple[int, int]:
    """(client, peer) ports on 127.0.0.1; ``port`` must be free."""
    socks: list[socket.socket] = []
    try:
        for wanted in (port or 0, 0):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            # As etcd (Go) does: connections in TIME_WAIT do not make a port busy.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", wanted))
            except OSError as exc:
                raise OSError(f"port {wanted} on 127.0.0.1 is not free: {exc.strerror}") from exc
        return socks[0].getsockname()[1], socks[1].getsockname()[1]
    finally:
        for s in socks:
            s.close()


def _cmd_serve(args: argparse.Namespace, out: _Out) -> int:
    from .testing import EtcdServer

    client_port, peer_port = _reserve_ports(args.port)
    server = EtcdServer("etcd-rdzv-dev", enable_v2=args.v2, _ports=(client_port, peer_port))
    if args.data_dir:
        data_dir = os.path.abspath(args.data_dir)
        os.makedirs(data_dir, exist_ok=True)
        server.data_dir = data_dir
    started = time.monotonic()
    try:
        server.start()
        out.progress(
            f"etcd (pid {server.pid}) ready at {server.client_url} in "
            f"{time.monotonic() - started:.2f}s; v2 API {'on' if args.v2 else 'OFF'}"
        )
        out.progress(f"data: {server.data_dir}  log: {server.log_path}")
        out.progress(f"use it with: export {ENV_ENDPOINT}={server.endpoint}")
        out.progress("press Ctrl-C to stop")
        out.result(server.endpoint)
        while server.running:
            time.sleep(0.5)  # a liveness check of the child; signals end the sleep at once
        out.error(f"etcd exited unexpectedly; last log line: {server.log_tail(1)}")
        return EXIT_FAILURE
    except KeyboardInterrupt:
        out.progress("stopping etcd")
        server.stop()
        out.progress("etcd stopped")
        return EXIT_OK
    finally:
        server.close()


# -- main --------------------------------------------------------------------------------


def _configure_logging(args: argparse.Namespace) -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    if args.debug:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(process)d]: %(message)s")
        )
        level = logging.DEBUG
    else:
        handler.setFormatter(logging.Formatter(f"{PROG}: %(levelname)s: %(message)s"))
        level = logging.INFO if args.verbose else logging.WARNING
    handler.setLevel(level)
    package = logging.getLogger("etcd_rdzv")
    package.addHandler(handler)
    package.setLevel(level)
    return handler


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Interrupted


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``etcd-rdzv`` with ``argv`` (default: ``sys.argv[1:]``); the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version or a usage error
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    for name in ("debug", "verbose", "quiet"):
        if not hasattr(args, name):
            setattr(args, name, False)
    out = _Out(quiet=args.quiet)
    log_handler = _configure_logging(args)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        code: int = args.func(args, out)
        return code
    except SystemExit as exc:  # a usage error found after parsing
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except KeyboardInterrupt:
        out.error("interrupted")
        return EXIT_INTERRUPTED
    except ValueError as exc:  # bad configuration (e.g. a certificate that does not load)
        _report(out, args, exc)
        return EXIT_USAGE
    except Exception as exc:  # the one place that turns any error into one line
        _report(out, args, exc)
        return EXIT_FAILURE
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        logging.getLogger("etcd_rdzv").removeHandler(log_handler)


def _report(out: _Out, args: argparse.Namespace, exc: Exception) -> None:
    if args.debug:
        traceback.print_exc(file=out.err)
        out.error(str(exc))
        return
    message = _one_line(exc)
    if not isinstance(exc, (RendezvousError, OSError, ValueError)) and not _is_etcd_start(exc):
        message = f"{type(exc).__name__}: {message}"
    out.error(re.sub(r"\s+", " ", message))


def _is_etcd_start(exc: Exception) -> bool:
    from .testing import EtcdNotFoundError, EtcdStartError

    return isinstance(exc, (EtcdNotFoundError, EtcdStartError))
