"""``etcd-rdzv exclude`` and ``include``: keep a host out of a run's rounds, or let it
back in (the work is :mod:`etcd_rdzv.admission.hosts`; this module connects, checks
that the run and the host exist, and reports)."""

from __future__ import annotations

import argparse
import re

from ..admission.hosts import MAX_REASON, exclude, include
from ..config.params import host_id_error
from ..runs.status import hosts_seen, read_run
from ._common import EXIT_OK, NotFound, Out, client, closest, parameters
from .status import human, missing_run, printable

__all__ = ["cmd_exclude", "cmd_include", "duration", "host"]

_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}  # as status shows them
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
    """Exclude ``--host`` from ``--run-id`` (for ``--for`` seconds, or until included).

    Refused (:class:`NotFound`) when the run has no keys or has never seen the host,
    unless ``--force``: a typo (``gpu-7`` for ``gpu-07``) must not pass for an
    exclusion. Excluding a host before it ever joined is what ``--force`` is for.
    """
    params, settings = parameters(args)
    kv = client(settings.client)
    out.progress(f"connected to etcd at {params.endpoint}")
    prefix, run_id, shown = settings.client.key_prefix, settings.run_id, printable(args.host)
    note = ""
    try:
        status = read_run(kv, prefix, run_id)
        seen = hosts_seen(status)
        if not status.exists:
            if not args.force:
                raise NotFound(
                    missing_run(kv, settings, status)
                    + " (--force excludes the host all the same, before the run starts)"
                )
            note = " (forced: the run has no keys yet)"
        elif args.host not in seen:
            if not args.force:
                known = (
                    f"the hosts it has seen: {closest(args.host, seen)}"
                    if seen
                    else ("it has seen no host yet")
                )
                raise NotFound(
                    f"run {printable(run_id)!r} has never seen host {shown!r}; {known} "
                    "(--force excludes a host before it joins)"
                )
            note = " (forced: the run has not seen this host)"
        exclude(kv, prefix, run_id, args.host, args.reason or "", seconds=args.seconds)
    finally:
        kv.close()
    until = f" for {human(args.seconds)}" if args.seconds else " until included"
    out.result(
        f"host {shown} excluded from run {printable(run_id)}{until}: "
        f"its nodes do not join, members on it leave at their next rendezvous{note}"
    )
    return EXIT_OK


def cmd_include(args: argparse.Namespace, out: Out) -> int:
    """Let ``--host`` join ``--run-id`` again (idempotent: a host not excluded is not an
    error, but the hosts that are are named, with the closest)."""
    params, settings = parameters(args)
    kv = client(settings.client)
    out.progress(f"connected to etcd at {params.endpoint}")
    try:
        was = include(kv, settings.client.key_prefix, settings.run_id, args.host)
        excluded = (
            []
            if was
            else [
                e.host for e in read_run(kv, settings.client.key_prefix, settings.run_id).excluded
            ]
        )
    finally:
        kv.close()
    note = "" if was else " (it was not excluded)"
    if excluded:  # a typo, perhaps: the host meant is still out
        out.warning(
            f"excluded from the run: {closest(args.host, [printable(h) for h in excluded])}"
        )
    out.result(f"host {printable(args.host)} may join run {printable(settings.run_id)}{note}")
    return EXIT_OK
