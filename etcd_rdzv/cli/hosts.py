"""``etcd-rdzv exclude`` and ``include``: keep a host out of a run's rounds, or let it
back in (the work is :mod:`etcd_rdzv.rendezvous.hosts`; this module connects and
reports)."""

from __future__ import annotations

import argparse
import re

from ..params import host_id_error
from ..rendezvous.hosts import MAX_REASON, exclude, include
from ._common import EXIT_OK, Out, client, parameters
from .status import printable

__all__ = ["cmd_exclude", "cmd_include", "duration", "host"]

_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"^([0-9]{1,9})([smhd]?)$")


def duration(text: str) -> int:
    """``--for``: whole seconds, or a number with ``s``, ``m``, ``h`` or ``d``."""
    match = _DURATION.match(text.strip())
    if match is None or int(match[1]) == 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: a positive whole number of seconds, or with "
            "s, m, h or d (90s, 30m, 12h, 2d)"
        )
    return int(match[1]) * _UNITS[match[2]]


def host(text: str) -> str:
    """``--host``: a host id as nodes name themselves (option ``host_id``)."""
    problem = host_id_error(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text[:80]!r} is not a host id: {problem}")
    return text


def reason(text: str) -> str:
    """``--reason``: at most ``MAX_REASON`` characters."""
    if len(text) > MAX_REASON:
        raise argparse.ArgumentTypeError(f"at most {MAX_REASON} characters, got {len(text)}")
    return text


def cmd_exclude(args: argparse.Namespace, out: Out) -> int:
    """Exclude ``--host`` from ``--run-id`` (for ``--for`` seconds, or until included)."""
    params, settings = parameters(args)
    kv = client(settings.client)
    out.progress(f"connected to etcd at {params.endpoint}")
    try:
        exclude(
            kv,
            settings.client.key_prefix,
            settings.run_id,
            args.host,
            args.reason or "",
            seconds=args.seconds,
        )
    finally:
        kv.close()
    until = f" for {args.seconds}s" if args.seconds else " until included"
    out.result(
        f"host {printable(args.host)} excluded from run {printable(settings.run_id)}{until}: "
        "its nodes do not join, members on it leave at their next rendezvous"
    )
    return EXIT_OK


def cmd_include(args: argparse.Namespace, out: Out) -> int:
    """Let ``--host`` join ``--run-id`` again."""
    params, settings = parameters(args)
    kv = client(settings.client)
    out.progress(f"connected to etcd at {params.endpoint}")
    try:
        was = include(kv, settings.client.key_prefix, settings.run_id, args.host)
    finally:
        kv.close()
    note = "" if was else " (it was not excluded)"
    out.result(f"host {printable(args.host)} may join run {printable(settings.run_id)}{note}")
    return EXIT_OK
