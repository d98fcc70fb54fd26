"""What every command of ``etcd-rdzv`` shares: output, exit codes, and the way from
arguments to validated settings and to the library's objects.

A command builds its :class:`~etcd_rdzv.params.RendezvousParameters` once with
:func:`parameters`, which validates them once with
:meth:`etcd_rdzv.params.Settings.from_params` (a bad value is a usage error naming the
flag), and reaches etcd only through :func:`client` and :func:`handler`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, field
from typing import IO, Any, NoReturn

from .._factory import create_handler
from .._kv import KV
from ..client import connect
from ..params import (
    DEFAULT_API,
    STATIC_HANDLER_NAME,
    SUPPORTED_APIS,
    ClientConfig,
    RendezvousParameters,
    Settings,
    parse_endpoints,
)
from ..rendezvous import EtcdRendezvousHandler

__all__ = [
    "BACKEND",
    "DEFAULT_ENDPOINT",
    "ENV_API",
    "ENV_ENDPOINT",
    "ENV_PASSWORD",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "PROG",
    "Out",
    "client",
    "endpoint_of",
    "handler",
    "one_line",
    "parameters",
    "usage_error",
]

PROG = "etcd-rdzv"
BACKEND = "etcd-rdzv"  # the native handler's name, as torchrun knows it
DEFAULT_ENDPOINT = "127.0.0.1:2379"
ENV_ENDPOINT = "ETCD_RDZV_ENDPOINT"
ENV_PASSWORD = "ETCD_RDZV_PASSWORD"
ENV_API = "ETCD_RDZV_API"

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

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
    "node_group": "--node-group",
    "node_unit": "--node-unit",
}


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


def api_of(args: argparse.Namespace) -> str:
    """``--api``, else ``$ETCD_RDZV_API`` (checked), else v3."""
    given: str | None = getattr(args, "api", None)
    if given:
        return given
    env = os.environ.get(ENV_API, "").strip()
    if not env:
        return DEFAULT_API
    if env.lower() not in SUPPORTED_APIS:
        usage_error(args, f"${ENV_API} must be one of {', '.join(SUPPORTED_APIS)}, got {env!r}")
    return env.lower()


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
    rank: int | None = None,
) -> tuple[RendezvousParameters, Settings]:
    """The rendezvous parameters of a command, and its settings parsed from them once.

    The parameters carry the etcd options and, where the command has them, the
    rendezvous options; ``endpoint`` defaults to :func:`endpoint_of`. With ``rank``:
    the static handler, this node's rank given, the world ``max_nodes``. A bad value
    is a usage error naming the flag. No network I/O.
    """
    if max_nodes < min_nodes:
        usage_error(
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
        "api": api_of(args),
    }
    for option in (
        "join_timeout",
        "last_call_timeout",
        "keep_alive_interval",
        "node_group",
        "node_unit",
    ):
        if hasattr(args, option):
            config[option] = getattr(args, option)
    if rank is not None:
        config["rank"] = rank
    params = RendezvousParameters(
        BACKEND if rank is None else STATIC_HANDLER_NAME,
        endpoint if endpoint is not None else endpoint_of(args),
        getattr(args, "run_id", None) or "-",
        min_nodes,
        max_nodes,
        local_addr,
        **{k: v for k, v in config.items() if v is not None},
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


def handler(params: RendezvousParameters, *, use_torch: bool = False) -> EtcdRendezvousHandler:
    """The native handler for ``params`` (probes etcd); torch only with ``use_torch``.

    Raises:
        RendezvousConnectionError: etcd did not answer or refused us.
    """
    return create_handler(params, use_torch=use_torch)
