"""The ``etcd-rdzv`` command lines that error messages and hints suggest.

Every text that tells a user to run one of our commands builds the command here, so
the flags it names always exist and quote the same way. Imports nothing of the
package above :mod:`etcd_rdzv.config.params`.
"""

from __future__ import annotations

import shlex

from .config.params import DEFAULT_API, DEFAULT_KEY_PREFIX

__all__ = ["closed_message", "delete_command", "include_command", "serve_command"]


def delete_command(run_id: str, key_prefix: str, api: str, *, force: bool = False) -> str:
    """``etcd-rdzv delete`` for one run, naming only the options that differ from the
    defaults (``--api`` always when ``api`` is not the default)."""
    command = f"etcd-rdzv delete --run-id {shlex.quote(run_id)}"
    if key_prefix != DEFAULT_KEY_PREFIX:
        command += f" --key-prefix {shlex.quote(key_prefix)}"
    if api != DEFAULT_API:
        command += f" --api {api}"
    if force:
        command += " --force"
    return command


def include_command(run_id: str, host: str, key_prefix: str, api: str) -> str:
    """``etcd-rdzv include`` of one host into one run."""
    command = f"etcd-rdzv include --run-id {shlex.quote(run_id)} --host {shlex.quote(host)}"
    if key_prefix != DEFAULT_KEY_PREFIX:
        command += f" --key-prefix {shlex.quote(key_prefix)}"
    if api != DEFAULT_API:
        command += f" --api {api}"
    return command


def serve_command(port: int | None = None) -> str:
    """``etcd-rdzv serve``, on ``port`` when given."""
    return "etcd-rdzv serve" if port is None else f"etcd-rdzv serve --port {port}"


def closed_message(run_id: str, key_prefix: str, api: str) -> str:
    """The error of a join into a closed run, with what to do about it."""
    return (
        f"The rendezvous of run {run_id!r} is closed. To start the job again, use a new "
        f"run id (torchrun: --rdzv-id), or delete the closed run first: "
        f"{delete_command(run_id, key_prefix, api)} (with the job's etcd options)."
    )
