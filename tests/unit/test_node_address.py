"""The address a node publishes: a loopback default in a job that may span hosts is
warned about, with how to set it; an explicit loopback address is mentioned once at
INFO (a single-host test job is not noisy); nothing is said otherwise."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator

import pytest

from etcd_rdzv.config import _node
from etcd_rdzv.config._node import node_address


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    """Each test starts with nothing mentioned yet in this process."""
    saved = set(_node._told)
    _node._told.clear()
    yield
    _node._told.clear()
    _node._told.update(saved)


def _records(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [
        (r.levelno, r.getMessage()) for r in caplog.records if r.name == "etcd_rdzv.config._node"
    ]


@pytest.mark.parametrize("fqdn", ["localhost", "127.0.0.1", "::1"])
def test_a_loopback_default_in_a_multi_host_job_is_warned_about(
    fqdn: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(socket, "getfqdn", lambda *a: fqdn)
    caplog.set_level(logging.DEBUG, logger="etcd_rdzv")
    assert node_address(None, 2, "job1") == fqdn
    [(level, message)] = _records(caplog)
    assert level == logging.WARNING
    assert repr(fqdn) in message and "run job1" in message
    assert "nodes on other hosts cannot reach it" in message
    for how in ("torchrun --local-addr", "local_addr in RendezvousParameters"):
        assert how in message
    assert "etcd-rdzv join --local-addr" in message
    # Warned each time a handler is built with it: it is a real problem every time.
    assert node_address("", 2, "job1") == fqdn
    assert [level for level, _ in _records(caplog)] == [logging.WARNING, logging.WARNING]


def test_a_single_node_job_is_not_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(socket, "getfqdn", lambda *a: "localhost")
    caplog.set_level(logging.DEBUG, logger="etcd_rdzv")
    assert node_address(None, 1) == "localhost"
    assert node_address("127.0.0.1", 1) == "127.0.0.1"
    assert _records(caplog) == []


@pytest.mark.parametrize("given", ["127.0.0.1", "localhost", "::1", "[::1]", "127.0.1.1"])
def test_an_explicit_loopback_address_is_mentioned_once_at_info(
    given: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="etcd_rdzv")
    for _ in range(3):
        assert node_address(given, 4, "t") == given
    [(level, message)] = _records(caplog)
    assert level == logging.INFO
    assert repr(given) in message and "given as local_addr" in message


@pytest.mark.parametrize("addr", ["10.1.2.3", "192.0.2.7", "2001:db8::1"])
def test_a_reachable_address_says_nothing(
    addr: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(socket, "getfqdn", lambda *a: addr)
    caplog.set_level(logging.DEBUG, logger="etcd_rdzv")
    assert node_address(None, 8) == addr
    assert node_address(addr, 8) == addr
    assert _records(caplog) == []
