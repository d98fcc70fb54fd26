"""What every command of ``etcd-rdzv`` shares: output, exit codes, and the way from
arguments to validated settings and to the library's objects.

A command builds its :class:`~etcd_rdzv.config.params.RendezvousParameters` with
:func:`parameters`, which parses them once with
:meth:`etcd_rdzv.config.params.Settings.from_params` (a bad value is a usage error naming the
flag), and reaches etcd only through :func:`client` and :func:`handler`, which take
those settings.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, field
from typing import IO, Any, NoReturn

from .._factory import handler_from_settings
from .._kv import KV
from ..client import connect
from ..config._options import (
    DEFAULT_ENDPOINT,
    ENV_API,
    ENV_ENDPOINT,
    ENV_PASSWORD,
    HANDLER_NAME,
    OPTIONS,
    STATIC_HANDLER_NAME,
    Option,
    flags,
)
from ..config.params import ClientConfig, RendezvousParameters, Settings, parse_endpoints
from ..rendezvous import EtcdRendezvousHandler

__all__ = [
    "BACKEND",
    "DEFAULT_ENDPOINT",
    "ENV_API",
    "ENV_ENDPOINT",
    "ENV_PASSWORD",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_USAGE",
    "PROG",
    "NotFound",
    "Out",
    "client",
    "closest",
    "endpoint_of",
    "handler",
    "one_line",
    "parameters",
    "usage_error",
]

PROG = "etcd-rdzv"
BACKEND = HANDLER_NAME  # the native handler's name, as torchrun knows it

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_INTERRUPTED = 130


class NotFound(Exception):
    """What a command was told to act on does not exist (a run with no keys, a host
    the run never saw): exit code 3, the message lists what does exist."""


def closest(given: str, known: list[str], shown: int = 10) -> str:
    """``known`` as a short list (at most ``shown`` names), and the one closest to
    ``given`` if one is close: ``a, b, c (and 4 more); did you mean 'b'?``."""
    import difflib

    text = ", ".join(known[:shown]) + (
        f" (and {len(known) - shown} more)" if len(known) > shown else ""
    )
    close = difflib.get_close_matches(given, known, n=1, cutoff=0.6)
    return text + (f"; did you mean {close[0]!r}?" if close else "")


# Rendezvous option names (as in error messages of the library) -> our flags.
_FLAGS = {"endpoint": "--endpoint", **flags()}


# -- output ------------------------------------------------------------------------------


@dataclass
class Out:
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


def one_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, with a hint when there is more."""
    text = str(exc).strip() or type(exc).__name__
    first, _, rest = text.partition("\n")
    return first + (" (more with --debug)" if rest.strip() else "")


# -- from arguments to settings ----------------------------------------------------------


def usage_error(args: argparse.Namespace, message: str) -> NoReturn:
    """Exit with status 2 and ``message``, the library's option names turned into flags."""
    for option, flag in _FLAGS.items():
        # Quoted names, and bare names with an underscore (no English word has one).
        bare = "?" if "_" in option else ""
        message = re.sub(rf"(?<![\w-])'{bare}{option}'{bare}(?![\w-])", flag, message)
    parser: argparse.ArgumentParser = args.parser_
    parser.error(message)  # exits with status 2


def _from_environment(args: argparse.Namespace, opt: Option) -> str | None:
    """The value of ``opt``'s command-line variable (checked), or ``None``."""
    if opt.cli_env is None:
        return None
    text = os.environ.get(opt.cli_env, "")
    if opt.absent(text):
        return None
    try:
        opt.parse(text)
    except ValueError:
        usage_error(args, f"${opt.cli_env} must be {opt.requirement}, got {text.strip()!r}")
    return text


def endpoint_of(args: argparse.Namespace) -> str:
    """``--endpoint``, else ``$ETCD_RDZV_ENDPOINT`` (checked), else the default."""
    given: str | None = args.endpoint
    if given:
        return given
    env = os.environ.get(ENV_ENDPOINT, "").strip()
    if env:
        try:
            parse_endpoints(env)
        except ValueError as exc:
            usage_error(args, f"${ENV_ENDPOINT}: {exc}")
        return env
    return DEFAULT_ENDPOINT


def parameters(
    args: argparse.Namespace,
    endpoint: str | None = None,
    *,
    min_nodes: int = 1,
    max_nodes: int = 1,
    local_addr: str | None = None,
) -> tuple[RendezvousParameters, Settings]:
    """The rendezvous parameters of a command, and its settings parsed from them once.

    The parameters carry the options whose flags the command has (those given, and
    those the command has its own default for) and, for a flag not given, the value of
    its command-line variable (``$ETCD_RDZV_API``); ``endpoint`` defaults to
    :func:`endpoint_of`. With ``--rank``: the static handler, the world ``max_nodes``.
    A bad value is a usage error naming the flag. No network I/O.
    """
    if max_nodes < min_nodes:
        usage_error(
            args, f"argument --max-nodes: must be >= --min-nodes ({min_nodes}), got {max_nodes}"
        )
    config: dict[str, Any] = {}
    for opt in OPTIONS:
        value = getattr(args, opt.name, None)
        if value is None and hasattr(args, opt.name):
            value = _from_environment(args, opt)
        if value is not None:
            config[opt.name] = value
    params = RendezvousParameters(
        STATIC_HANDLER_NAME if "rank" in config else BACKEND,
        endpoint if endpoint is not None else endpoint_of(args),
        getattr(args, "run_id", None) or "-",
        min_nodes,
        max_nodes,
        local_addr,
        **config,
    )
    try:
        settings = Settings.from_params(params)
    except ValueError as exc:
        usage_error(args, str(exc))
    return params, settings


# -- the library's objects ---------------------------------------------------------------


def client(config: ClientConfig) -> KV:
    """A client of etcd for ``config``; etcd is probed once.

    Raises:
        RendezvousConnectionError: etcd did not answer or refused us.
    """
    return connect(config)


def handler(settings: Settings, *, use_torch: bool = False) -> EtcdRendezvousHandler:
    """The native handler of ``settings`` (probes etcd); torch only with ``use_torch``.

    Raises:
        RendezvousConnectionError: etcd did not answer or refused us.
    """
    return handler_from_settings(settings, use_torch=use_torch)
