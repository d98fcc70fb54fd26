"""The parser of ``etcd-rdzv``: its commands and their flags.

The flags of rendezvous options come from the option table (:mod:`etcd_rdzv.config._options`):
their names, help and defaults are declared there once. They are given to the library
as they were typed; the library checks them when the command's settings are parsed.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from .. import __version__
from ..config._options import OPTIONS, CliGroup, Option, flags, option
from ._common import DEFAULT_ENDPOINT, ENV_ENDPOINT, PROG, Out
from .delete import cmd_delete
from .demo import cmd_demo, cmd_node
from .hosts import cmd_exclude, cmd_include, duration, host, reason
from .join import cmd_join
from .serve import cmd_serve
from .status import cmd_close, cmd_status

__all__ = ["DEMO_DEFAULTS", "build_parser", "cli_text"]

#: A command: its parsed arguments and where output goes -> the exit code.
Command = Callable[[argparse.Namespace, Out], int]

_HELP_FLAGS = {**flags(), "min_nodes": "--min-nodes", "max_nodes": "--max-nodes"}


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


def _run_id(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


_positive = _int_at_least(1)
_non_negative = _int_at_least(0)


# -- the parser --------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """A parser whose usage errors help with a typo: a flag it does not know is named
    with its closest known flag (``--hots (did you mean --host?)``), a command name
    with the closest command, and the usage shown is that of the command the flag was
    given to (a command's parser reports the flags it was given itself, instead of
    handing them back to the top level as argparse does)."""

    _given: Sequence[str] = ()

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._given = list(sys.argv[1:] if args is None else args)
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error("unrecognized arguments: " + ", ".join(self._explain(extras)))
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        if message.startswith("the following arguments are required"):
            # A mistyped flag is often why a required one is missing: say so first.
            unknown = [arg for arg in self._given_flags() if self._unknown(arg)]
            if unknown:
                message = (
                    "unrecognized arguments: " + ", ".join(self._explain(unknown)) + "; " + message
                )
        choice = re.match(r"argument (\S+): invalid choice: '([^']*)'", message)
        if choice is not None:
            choices = next(
                (a.choices for a in self._actions if a.dest == "command" and a.choices), None
            )
            close = difflib.get_close_matches(choice[2], list(choices or ()), n=1, cutoff=0.6)
            if close:
                message += f" (did you mean {close[0]!r}?)"
        super().error(message)

    def _given_flags(self) -> list[str]:
        flags = []
        for arg in self._given:
            if arg == "--":
                break
            if arg.startswith("-") and len(arg) > 1 and not re.match(r"-[0-9.]", arg):
                flags.append(arg)
        return flags

    def _unknown(self, arg: str) -> bool:
        name = arg.split("=", 1)[0]
        known = self._option_string_actions
        if name in known:
            return False
        # argparse takes an unambiguous prefix of a long flag (--run for --run-id).
        return not (name.startswith("--") and any(k.startswith(name) for k in known))

    def _explain(self, extras: Sequence[str]) -> list[str]:
        known = [k for k in self._option_string_actions if k.startswith("--")]
        explained = []
        for arg in extras:
            name = arg.split("=", 1)[0]
            close = (
                difflib.get_close_matches(name, known, n=1, cutoff=0.6)
                if arg.startswith("-")
                else []
            )
            explained.append(f"{arg} (did you mean {close[0]}?)" if close else arg)
        return explained


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


def cli_text(text: str) -> str:
    """``text`` of the option table as the command line says it: option names in
    backticks become flags (`read_timeout` -> --read-timeout), other backticks go."""
    return re.sub(r"`([^`]*)`", lambda m: _HELP_FLAGS.get(m[1], m[1]), text)


def _option_flags(
    group: argparse._ArgumentGroup,
    cli: CliGroup,
    defaults: Mapping[str, int] | None = None,
    helps: Mapping[str, str] | None = None,
) -> None:
    """A flag for each option of the table that ``cli`` commands take.

    A flag not given leaves its option out of the parameters (the library's default,
    or its variable, applies), unless ``defaults`` names a value of this command's own.
    Values are checked where the options are parsed, once (:func:`._common.parameters`).
    """
    defaults = defaults or {}
    helps = helps or {}
    for opt in OPTIONS:
        if opt.cli != cli:
            continue
        default = defaults.get(opt.name)
        text = cli_text(helps.get(opt.name, opt.help))
        shown = _default_text(opt, default)
        if shown:
            text += f" (default: {shown})"
        kwargs: dict[str, Any] = {"dest": opt.name, "default": default, "help": text}
        if opt.kind == "bool":
            # A flag that is on by default is turned off by --no-<flag>.
            kwargs["action"] = argparse.BooleanOptionalAction if opt.default else "store_true"
        elif opt.choices:
            kwargs["metavar"] = "{" + ",".join(opt.choices) + "}"
        else:
            kwargs["metavar"] = opt.metavar
        group.add_argument(opt.flag, **kwargs)


def _default_text(opt: Option, default: int | None) -> str:
    if default is not None:
        return str(default)
    if opt.kind == "bool":
        return ""
    variable = opt.cli_env or opt.env
    value = "none" if opt.default is None else str(opt.default)
    if variable:
        return f"${variable}, else {value}"
    return "" if opt.default is None else value


def _etcd_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "etcd connection",
        "The commands use etcd's v3 API by default (every etcd >= 3.4; the only API of "
        "etcd 3.6); --api v2 reaches runs of jobs that use api=v2 (etcd started with "
        "--enable-v2).",
    )
    group.add_argument(
        "--endpoint",
        default=None,
        metavar="HOST[:PORT][,...]",
        help=f"etcd client endpoints (default: ${ENV_ENDPOINT}, else {DEFAULT_ENDPOINT})",
    )
    _option_flags(group, "etcd")


def _rendezvous_options(
    parser: argparse.ArgumentParser, defaults: Mapping[str, int] | None = None
) -> None:
    _option_flags(parser.add_argument_group("rendezvous"), "rendezvous", defaults)


#: What the demo's nodes use instead of the library's defaults: a local demo is quick.
DEMO_DEFAULTS = {"join_timeout": 60, "last_call_timeout": 1, "keep_alive_interval": 1}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``etcd-rdzv`` (no side effects; no network)."""
    parser = _Parser(
        prog=PROG,
        description="Rendezvous over etcd for elastic distributed jobs: try it locally, "
        "join a rendezvous from a shell script, inspect or close a run, or serve a "
        "development etcd.",
        epilog="Exit codes: 0 ok, 1 failure, 2 usage error, 3 not found (a run or host), "
        "130 interrupted. "
        f"Run '{PROG} COMMAND --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _global_options(parser, suppress=False)
    commands = parser.add_subparsers(
        dest="command",
        metavar="{demo,join,status,close,delete,exclude,include,serve}",
        title="commands",
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
    _rendezvous_options(demo, DEMO_DEFAULTS)
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
    _option_flags(join.add_argument_group("rank policies"), "join")
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
    _rendezvous_options(join)
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
    close.add_argument(
        "--force",
        action="store_true",
        help="close a run that has no keys yet (without it, that is an error: a mistyped id)",
    )
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
    # The one rendezvous option of delete: how long it watches a dynamic run's state.
    keep_alive = option("keep_alive_interval")
    delete.add_argument(
        keep_alive.flag,
        dest=keep_alive.name,
        metavar=keep_alive.metavar,
        help="the keep-alive interval of etcd-rdzv-dynamic runs: how long a quiet "
        f"rendezvous state means no live node (default: {keep_alive.default}, torch's)",
    )
    _etcd_options(delete)

    excl = add(
        "exclude",
        cmd_exclude,
        "keep a host out of a run's rounds",
        "Exclude a host (a node's host_id) from the run: its nodes do not join (under "
        "torchrun its agent exits 0 with the reason), a member on it leaves at the "
        "members' next rendezvous, and the others re-form without it. Until 'include', "
        "or for --for.",
    )
    excl.add_argument("--run-id", type=_run_id, required=True, metavar="ID", help="run id")
    excl.add_argument(
        "--host", type=host, required=True, metavar="HOST", help="the host_id to exclude"
    )
    excl.add_argument(
        "--reason", type=reason, metavar="TEXT", help="why (shown by status and in the error)"
    )
    excl.add_argument(
        "--for",
        dest="seconds",
        type=duration,
        metavar="DURATION",
        help="exclude for this long (90s, 30m, 12h, 2d; default: until included)",
    )
    excl.add_argument(
        "--force",
        action="store_true",
        help="exclude a host the run has not seen (one that has not joined yet), or from "
        "a run that has no keys yet (without it, both are errors: a mistyped name)",
    )
    _etcd_options(excl)

    incl = add(
        "include",
        cmd_include,
        "let an excluded host join a run again",
        "Remove a host's exclusion from the run: its nodes join again.",
    )
    incl.add_argument("--run-id", type=_run_id, required=True, metavar="ID", help="run id")
    incl.add_argument(
        "--host", type=host, required=True, metavar="HOST", help="the host_id to include"
    )
    _etcd_options(incl)

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
    _rendezvous_options(node, DEMO_DEFAULTS)
    _etcd_options(node)
    return parser
