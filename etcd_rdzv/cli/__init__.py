"""The ``etcd-rdzv`` command line: demo, join, status, close, delete, a development etcd.

Results go to stdout, progress to stderr. Exit codes: ``0`` success, ``1`` failure
(etcd unreachable, rendezvous closed or timed out, etcd did not start), ``2`` usage
error (a bad option; argparse's convention), ``130`` interrupted (Ctrl-C, SIGTERM).
Errors are one line, ``etcd-rdzv: error: ...``; ``--debug`` adds the traceback and
debug logs.

The CLI never imports torch: :func:`etcd_rdzv.create_handler` builds the native
handler without it, because importing torch costs seconds per process and the CLI needs
the round and the peer addresses, which torch's ``RendezvousInfo`` does not carry.
``demo --torch`` builds torch's flavour, to show that path.

This module holds the parser, :func:`main` and the error reporting; each command lives
in its own module: :mod:`.join`, :mod:`.status` (status and close), :mod:`.delete`,
:mod:`.demo`, :mod:`.serve`; :mod:`._common` holds what they share (output, exit codes, the way from
arguments to validated settings).
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from .. import __version__
from ..errors import RendezvousError
from ..params import (
    DEFAULT_API,
    DEFAULT_KEY_PREFIX,
    DEFAULT_READ_TIMEOUT,
    SUPPORTED_APIS,
    parse_endpoints,
)
from ..rendezvous.handler import LOGGED_AND_RAISED
from ._common import (
    DEFAULT_ENDPOINT,
    ENV_API,
    ENV_ENDPOINT,
    ENV_PASSWORD,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    Out,
    one_line,
)
from .delete import cmd_delete
from .demo import cmd_demo, cmd_node
from .join import cmd_join
from .serve import cmd_serve
from .status import cmd_close, cmd_status

__all__ = ["ENV_API", "ENV_ENDPOINT", "ENV_PASSWORD", "build_parser", "main"]


#: A command: its parsed arguments and where output goes -> the exit code.
Command = Callable[[argparse.Namespace, Out], int]


class _Interrupted(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that cleanup (``finally``) runs."""


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
        parse_endpoints(text)
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
            and action.nargs != 0  # a flag: its default says nothing
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
    group = parser.add_argument_group(
        "etcd connection",
        "The commands use etcd's v3 API by default (every etcd >= 3.4; the only API of "
        "etcd 3.6); --api v2 reaches runs of jobs that use api=v2 (etcd started with "
        "--enable-v2).",
    )
    group.add_argument(
        "--api",
        type=str.lower,
        choices=SUPPORTED_APIS,
        default=None,
        help=f"etcd API of the run (default: ${ENV_API}, else {DEFAULT_API}); every node "
        "of a job and the commands that look at it must use the same",
    )
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
        dest="command", metavar="{demo,join,status,close,delete,serve}", title="commands"
    )
    commands.required = True

    def add(
        name: str, func: Command, help_text: str | None, description: str
    ) -> argparse.ArgumentParser:
        kwargs: dict[str, Any] = {"description": description, "formatter_class": _Formatter}
        if help_text is not None:  # no help: the command is not listed (hidden)
            kwargs["help"] = help_text
        sub = commands.add_parser(name, **kwargs)
        _global_options(sub, suppress=True)
        sub.set_defaults(parser_=sub, func=func)
        return sub

    demo = add(
        "demo",
        cmd_demo,
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
        help="build torch's flavour of the handler (create_handler(params, "
        "use_torch=True); needs torch, and is slower: each node imports it)",
    )
    _rendezvous_options(demo, join_timeout=60, last_call=1, keep_alive=1)
    _etcd_options(demo)

    join = add(
        "join",
        cmd_join,
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
        "--rank",
        type=_non_negative,
        metavar="R",
        help="the static rendezvous: this node's rank, 0..max-nodes-1 (the world is "
        "--max-nodes nodes, each with the rank it was given)",
    )
    join.add_argument(
        "--node-group",
        metavar="NAME",
        help="this node's group (a rack, a switch): ranks are contiguous within a group "
        "(default: $ETCD_RDZV_NODE_GROUP, else none)",
    )
    join.add_argument(
        "--node-unit",
        type=_positive,
        metavar="N",
        help="the world size is a multiple of N; nodes left over wait as spares (default: 1)",
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

    status = add(
        "status",
        cmd_status,
        "show a run: closed, round, members, waiting nodes, spares",
        "Read the run's keys and show whether it is closed, the current round, the "
        "members of the latest completed round in rank order and the nodes waiting "
        "for the next round (spares marked), of runs of etcd_rdzv's handlers and of "
        "etcd-rdzv-dynamic (torch's handler; its state is decoded without running "
        "it). Read-only. Text from etcd is shown with control characters escaped.",
    )
    status.add_argument("--run-id", type=_run_id, required=True, metavar="ID", help="run id")
    status.add_argument(
        "--json", action="store_true", help="print one JSON object (--watch: one per line)"
    )
    status.add_argument(
        "--watch",
        action="store_true",
        help="show the run again each time it changes (an etcd watch), until Ctrl-C",
    )
    _etcd_options(status)

    close = add(
        "close",
        cmd_close,
        "close a run: later joins fail",
        "Mark the run closed (what handler.set_closed() does): nodes waiting in or "
        "joining it get a 'closed' error; the marker expires after 2 hours.",
    )
    close.add_argument("--run-id", type=_run_id, required=True, metavar="ID", help="run id")
    _etcd_options(close)

    delete = add(
        "delete",
        cmd_delete,
        "delete every key of a run, so its id can be used again",
        "Remove the run's whole directory (<key-prefix>/<run>/: the native handler's "
        "keys, the store, the state of etcd-rdzv-dynamic runs) in the keyspace of --api. "
        "Refused while nodes are alive: a join key in the latest completed round or a "
        "later one; for etcd-rdzv-dynamic runs, a state write within 2 x "
        "--keep-alive-interval + 1 seconds (delete waits that long to see one).",
    )
    delete.add_argument("--run-id", type=_run_id, required=True, metavar="ID", help="run id")
    delete.add_argument(
        "--force", action="store_true", help="delete even while nodes are alive (no checks)"
    )
    delete.add_argument(
        "--keep-alive-interval",
        type=_positive,
        default=5,
        metavar="SECONDS",
        help="the keep-alive interval of etcd-rdzv-dynamic runs (torch's default 5): "
        "how long a quiet rendezvous state means no live node",
    )
    _etcd_options(delete)

    serve = add(
        "serve",
        cmd_serve,
        "run a development etcd in the foreground",
        "Run a single-member etcd on 127.0.0.1 for development, print its endpoint on "
        "stdout, and stop it cleanly on Ctrl-C or SIGTERM. It serves the v3 API (as "
        "etcd 3.6 does) and, with --enable-v2, also the v2 API for jobs with api=v2. "
        "Not for production: no TLS, no auth, loopback only.",
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
        "--enable-v2",
        dest="v2",
        action="store_true",
        help="also serve the v2 API (for jobs with api=v2; etcd 3.6 cannot)",
    )

    node = add("_node", cmd_node, None, "Internal: one node of 'demo'.")
    node.add_argument("--run-id", type=_run_id, required=True)
    node.add_argument("--min-nodes", type=_positive, required=True)
    node.add_argument("--max-nodes", type=_positive, required=True)
    node.add_argument("--index", type=_non_negative, required=True)
    node.add_argument("--torch", action="store_true")
    _rendezvous_options(node, join_timeout=60, last_call=1, keep_alive=1)
    _etcd_options(node)
    return parser


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
    if not args.debug:
        # An error the library logs right before raising it: main() prints it once.
        handler.addFilter(lambda record: not getattr(record, LOGGED_AND_RAISED, False))
    package = logging.getLogger("etcd_rdzv")
    package.addHandler(handler)
    package.setLevel(level)
    return handler


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Interrupted


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``etcd-rdzv`` with ``argv`` (default: ``sys.argv[1:]``); the exit code.

    When ``join --export`` fails (usage errors included), the last line on stdout is
    ``false``: ``eval "$(etcd-rdzv join ... --export)"`` then fails too, instead of
    evaluating nothing and returning 0, so ``set -e`` stops the script. ``false``, not
    ``exit``: an interactive shell that evals it stays open.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    code = _main(args)
    if code != EXIT_OK and _wants_export(args):
        print("false", file=sys.stdout, flush=True)
    return code


def _wants_export(argv: Sequence[str]) -> bool:
    """Whether ``argv`` asks for ``--export`` (argparse also takes a prefix: ``--exp``)."""
    for arg in argv:
        if arg == "--":
            return False
        if len(arg) >= 4 and "--export".startswith(arg):
            return True
    return False


def _main(argv: Sequence[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version or a usage error
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    for name in ("debug", "verbose", "quiet"):
        if not hasattr(args, name):
            setattr(args, name, False)
    out = Out(quiet=args.quiet)
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


def _report(out: Out, args: argparse.Namespace, exc: Exception) -> None:
    if args.debug:
        traceback.print_exc(file=out.err)
        out.error(str(exc))
        return
    message = one_line(exc)
    if not isinstance(exc, (RendezvousError, OSError, ValueError)) and not _is_etcd_start(exc):
        message = f"{type(exc).__name__}: {message}"
    out.error(re.sub(r"\s+", " ", message))


def _is_etcd_start(exc: Exception) -> bool:
    from ..testing import EtcdNotFoundError, EtcdStartError

    return isinstance(exc, (EtcdNotFoundError, EtcdStartError))
