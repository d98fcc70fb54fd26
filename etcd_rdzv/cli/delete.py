"""``etcd-rdzv delete``: remove every key of a run, so that its id can be used again.

The work is the library's (:func:`etcd_rdzv.runs.delete.delete_run`: the checks
for live nodes and the one delete); this module connects and reports.
"""

from __future__ import annotations

import argparse
import dataclasses

from ..runs.delete import delete_run
from ._common import EXIT_OK, Out, client, parameters

__all__ = ["cmd_delete"]


def cmd_delete(args: argparse.Namespace, out: Out) -> int:
    """Delete ``--run-id`` (refused while nodes are alive, unless ``--force``)."""
    params, settings = parameters(args)
    # Not tied to the run: the client factory refuses a run that has keys in the other
    # API's keyspace, and deleting such keys is what this command is for.
    kv = client(dataclasses.replace(settings.client, run_id=None))
    api = settings.client.api
    out.progress(f"connected to etcd at {params.endpoint} (api {api})")
    try:
        deleted = delete_run(
            kv,
            settings.client.key_prefix,
            settings.run_id,
            force=args.force,
            keep_alive_interval=settings.handler.keep_alive_interval,
            on_wait=out.progress,
        )
    finally:
        kv.close()
    if deleted.keys == 0:
        other = "v2" if api == "v3" else "v3"
        out.result(
            f"run {settings.run_id} has no keys under {deleted.directory}/ in etcd's {api} "
            f"keyspace: nothing to delete (a run of api={other} needs --api {other})"
        )
    else:
        forced = " (forced)" if args.force else ""
        out.result(
            f"run {settings.run_id} deleted{forced}: {deleted.keys} key(s) under "
            f"{deleted.directory}/ in etcd's {api} keyspace"
        )
    return EXIT_OK
