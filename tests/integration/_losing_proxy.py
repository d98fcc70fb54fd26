"""A TCP proxy in front of etcd that loses one answer: etcd applies a request, its
client never learns it did (or is told something else)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

from etcd_rdzv.testing import EtcdServer


class LosingProxy:
    """Forwards TCP to ``upstream``; :meth:`arm` makes it lose one answer."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self._marker: bytes | None = None
        self._on_loss: Callable[[], None] = lambda: None
        self._reply = b""
        self._lock = threading.Lock()
        self.lost = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, marker: bytes, on_loss: Callable[[], None], reply: bytes = b"") -> None:
        """Lose the answer to the next request containing ``marker``, after calling
        ``on_loss`` (etcd has applied the request by then): the client gets
        ``reply`` instead, and then its connection is cut."""
        with self._lock:
            self._marker, self._on_loss, self._reply = marker, on_loss, reply

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
                    if self._reply:
                        client.sendall(self._reply)
                    # The client sees its connection end without (etcd's) answer.
                    client.shutdown(socket.SHUT_RDWR)
                    break
                client.sendall(data)
        client.close()
        upstream.close()

    def close(self) -> None:
        self.listener.close()


@contextlib.contextmanager
def in_front_of(server: EtcdServer) -> Iterator[LosingProxy]:
    """A :class:`LosingProxy` to ``server`` while the block runs."""
    host, port = server.endpoint.rsplit(":", 1)
    proxy = LosingProxy((host, int(port)))
    try:
        yield proxy
    finally:
        proxy.close()
