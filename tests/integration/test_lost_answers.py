"""Writes whose answer is lost are applied exactly once, on both APIs.

A small TCP proxy stands between one client and etcd. Armed, it forwards the next
compare-and-set request, lets etcd apply it, lets another client write over the key,
and then cuts the connection instead of passing etcd's answer on: the client cannot
know whether its write happened, and by the time it reads the key back, the value is
no longer its own. The store must still recognise its write (the value carries the
tags of the writes before it) and not apply it a second time.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

import etcd_rdzv
from etcd_rdzv import RendezvousParameters
from etcd_rdzv.testing import EtcdServer

pytestmark = pytest.mark.etcd_variants("v2", "v3")


class LosingProxy:
    """Forwards TCP to ``upstream``; :meth:`arm` makes it lose one answer."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self._marker: bytes | None = None
        self._on_loss: Callable[[], None] = lambda: None
        self._lock = threading.Lock()
        self.lost = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, marker: bytes, on_loss: Callable[[], None]) -> None:
        """Lose the answer to the next request containing ``marker``, after calling
        ``on_loss`` (etcd has applied the request by then)."""
        with self._lock:
            self._marker, self._on_loss = marker, on_loss

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.upstream)
        losing = threading.Event()

        def up() -> None:
            with contextlib.suppress(OSError):
                while data := client.recv(65536):
                    with self._lock:
                        if self._marker is not None and self._marker in data:
                            self._marker = None
                            losing.set()
                    upstream.sendall(data)
            with contextlib.suppress(OSError):
                upstream.shutdown(socket.SHUT_WR)

        threading.Thread(target=up, daemon=True).start()
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                if losing.is_set():  # etcd answered: the write is applied
                    self._on_loss()
                    self.lost += 1
                    # The client sees its connection end without an answer.
                    client.shutdown(socket.SHUT_RDWR)
                    break
                client.sendall(data)
        client.close()
        upstream.close()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def proxy(etcd_api_server: EtcdServer) -> Iterator[LosingProxy]:
    host, port = etcd_api_server.endpoint.rsplit(":", 1)
    p = LosingProxy((host, int(port)))
    yield p
    p.close()


def test_add_whose_answer_is_lost_is_applied_once_though_overwritten(
    proxy: LosingProxy,
    etcd_api_params: Callable[..., RendezvousParameters],
    etcd_api: str,
) -> None:
    direct = etcd_api_params("lost", read_timeout=5)
    _, other = etcd_rdzv.create_backend(direct)
    through = etcd_api_params("lost", read_timeout=5)
    through.endpoint = f"127.0.0.1:{proxy.port}"
    _, mine = etcd_rdzv.create_backend(through)

    assert other.add("n", 10) == 10
    assert mine.add("n", 1) == 11  # through the proxy; on v3 this also grants the lease
    marker = b"prevIndex=" if etcd_api == "v2" else b"/v3/kv/txn"
    proxy.arm(marker, lambda: other.add("n", 100))  # 12 -> 112 behind our back

    assert mine.add("n", 1) == 12  # applied once, recognised under the later write
    assert proxy.lost == 1
    assert other.get("n") == b"112"  # not 113: no second application
    assert mine.add("n", 1) == 113

    # append: the same, with bytes that would show a duplicate
    other.set("log", "a")
    proxy.arm(marker, lambda: other.append("log", "c"))
    mine.append("log", "b")
    assert proxy.lost == 2
    assert other.get("log") == b"abc"
