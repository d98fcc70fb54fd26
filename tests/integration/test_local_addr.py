"""The native handler publishes the address ``config._node.node_address`` chose, and a
loopback default in a job that may span hosts is warned about when the handler is
built (the rules themselves: ``tests/unit/test_node_address.py``)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousParameters
from etcd_rdzv.runs.status import read_run

Params = Callable[..., RendezvousParameters]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "etcd_rdzv.config._node" and r.levelno >= logging.WARNING
    ]


def test_a_loopback_default_is_warned_about_and_is_what_the_node_publishes(
    etcd_api_params: Params,
    etcd_key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(socket, "getfqdn", lambda *a: "localhost")
    caplog.set_level(logging.INFO, logger="etcd_rdzv")
    params = etcd_api_params("loop", min_nodes=1, max_nodes=2, last_call_timeout=1)
    handler = etcd_rdzv.create_handler(params)
    try:
        [warning] = _warnings(caplog)
        assert "'localhost'" in warning and "--local-addr" in warning
        handler.next_rendezvous()
        kv = etcd_rdzv.create_client(params)
        try:
            [member] = read_run(kv, etcd_key_prefix, "loop").members
        finally:
            kv.close()
        assert member.addr == "localhost"
    finally:
        handler.shutdown()


def test_an_explicit_loopback_address_is_not_warned_about(
    etcd_api_params: Params, etcd_key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="etcd_rdzv")
    params = etcd_api_params("given", min_nodes=1, max_nodes=2, last_call_timeout=1)
    params.local_addr = "127.0.0.1"
    handler = etcd_rdzv.create_handler(params)
    try:
        assert _warnings(caplog) == []
        handler.next_rendezvous()
        kv = etcd_rdzv.create_client(params)
        try:
            [member] = read_run(kv, etcd_key_prefix, "given").members
        finally:
            kv.close()
        assert member.addr == "127.0.0.1"
    finally:
        handler.shutdown()
