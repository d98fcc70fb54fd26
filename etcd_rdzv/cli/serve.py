"""``etcd-rdzv serve``: a single-member development etcd in the foreground."""

from __future__ import annotations

import argparse
import os
import socket
import time

from ._common import ENV_ENDPOINT, EXIT_FAILURE, EXIT_OK, Out

__all__ = ["cmd_serve"]


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


def cmd_serve(args: argparse.Namespace, out: Out) -> int:
    """Run etcd until Ctrl-C or SIGTERM (then ``0``); ``1`` if it exits by itself."""
    from ..testing import EtcdServer

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
            f"{time.monotonic() - started:.2f}s; v2 API {'on' if args.v2 else 'off (v3 only)'}"
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
