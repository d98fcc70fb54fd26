"""The ``etcd-rdzv`` command line: demo, join, status, close, delete, a development etcd.

Results go to stdout, progress to stderr. Exit codes: ``0`` success, ``1`` failure
(etcd unreachable, rendezvous closed or timed out, etcd did not start), ``2`` usage
error (a bad option; argparse's convention), ``3`` not found (``status``, ``close`` or
``exclude`` of a run with no keys, ``exclude`` of a host the run never saw; the
message lists what exists), ``130`` interrupted (Ctrl-C, SIGTERM).
Errors are one line, ``etcd-rdzv: error: ...``; ``--debug`` adds the traceback and
debug logs.

The CLI never imports torch: :func:`etcd_rdzv.create_handler` builds the native
handler without it, because importing torch costs seconds per process and the CLI needs
the round and the peer addresses, which torch's ``RendezvousInfo`` does not carry.
``demo --torch`` builds torch's flavour, to show that path.

This module holds :func:`main` and the error reporting; :mod:`._parser` the parser
(its option flags come from the option table); each command lives in its own module:
:mod:`.join`, :mod:`.status` (status and close), :mod:`.delete`, :mod:`.demo`,
:mod:`.serve`; :mod:`._common` holds what they share (output, exit codes, the way from
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
from collections.abc import Sequence
from types import FrameType

from ..errors import LOGGED_AND_RAISED, RendezvousError
from ._common import (
    ENV_API,
    ENV_ENDPOINT,
    ENV_PASSWORD,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    NotFound,
    Out,
    one_line,
)
from ._parser import build_parser

__all__ = ["ENV_API", "ENV_ENDPOINT", "ENV_PASSWORD", "build_parser", "main"]


class _Interrupted(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that cleanup (``finally``) runs."""


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
    except NotFound as exc:  # a run id or host that does not exist: say what does
        out.error(str(exc))
        return EXIT_NOT_FOUND
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
