"""python-etcd's connection pool, over :mod:`._http` instead of urllib3.

python-etcd sends every request through its client's ``http`` attribute, a urllib3
``PoolManager``: ``request`` (GET and DELETE, the parameters in the query),
``request_encode_body`` (PUT and POST, the parameters form-encoded), ``urlopen`` (a
body as given) and ``clear``; it reads the answer's ``status``, ``data``,
``getheader()`` and ``getheaders()``. :class:`Pool` offers that surface over the
transport of the v3 layer, so python-etcd still speaks the v2 protocol (its URLs,
parameters, errors and results) while a request costs the client about what a v3
request does. urllib3 and ``http.client`` parse each request's URL and each
answer's headers (the latter with the ``email`` package) through several layers:
that was most of a v2 node's CPU in a rendezvous of 1024 node processes
(``benchmarks/NOTES.md``).

Errors keep the types python-etcd sorts. An answer whose body did not come within
the timeout is urllib3's ``ReadTimeoutError`` (to python-etcd, a long poll that found
nothing, as etcd sends a watch's headers at once; any other request, a failed one).
No answer at all within the timeout (a frozen member) is the transport's
``TimeoutError``: a failed request, also for a long poll, so the watch moves to
another endpoint, as it did when urllib3 raised ``MaxRetryError`` there. A connection
that could not be made is :class:`~._failover.ConnectFailed`, an ``OSError`` (the
request was never sent); everything else is the transport's ``OSError`` or
``http.client.HTTPException``.
Like urllib3 as this package configures it, the pool neither retries nor follows
redirects.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode, urlsplit

import urllib3.exceptions as u3exc
from urllib3.util import parse_url

from ._http import Transport

__all__ = ["Answer", "Pool"]

#: A URL that needs no percent-encoding (this package's keys are base64 or plain
#: names). Any other goes through urllib3's own encoding, as python-etcd's URLs did.
_PLAIN_URL = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@/?\[\]]*")


class Answer:
    """An answer as python-etcd reads one: ``status``, ``data`` (the whole body) and
    its headers by name."""

    __slots__ = ("_headers", "data", "status")

    def __init__(self, status: int, data: bytes, headers: Mapping[bytes, bytes]) -> None:
        self.status = status
        self.data = data
        self._headers = headers

    def getheader(self, name: str, default: str | None = None) -> str | None:
        value = self._headers.get(name.lower().encode("latin-1"))
        return default if value is None else value.decode("latin-1")

    def getheaders(self) -> dict[str, str]:
        """Every header, by lower-case name (python-etcd asks for lower-case names)."""
        return {k.decode("latin-1"): v.decode("latin-1") for k, v in self._headers.items()}


class Pool:
    """The part of urllib3's ``PoolManager`` that python-etcd uses, over ``transport``.
    Thread-safe, as the transport is. Every request needs a timeout (python-etcd
    passes ``None`` only for a request of timeout 0, which this package never makes).
    """

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def request(
        self,
        method: str,
        url: str,
        fields: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
        **_options: Any,
    ) -> Answer:
        """``method`` with ``fields`` in the URL's query (python-etcd: GET, DELETE)."""
        if fields:
            url = f"{url}{'&' if '?' in url else '?'}{urlencode(fields)}"
        return self._send(method, url, b"", headers, timeout)

    def request_encode_body(
        self,
        method: str,
        url: str,
        fields: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
        **_options: Any,
    ) -> Answer:
        """``method`` with ``fields`` form-encoded in the body (python-etcd: PUT, POST)."""
        body = urlencode(fields or {}).encode("ascii")
        sent = {**(headers or {}), "Content-Type": "application/x-www-form-urlencoded"}
        return self._send(method, url, body, sent, timeout)

    def urlopen(
        self,
        method: str,
        url: str,
        body: bytes | str | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
        **_options: Any,
    ) -> Answer:
        """``method`` with ``body`` as it is (python-etcd: a JSON body)."""
        data = body.encode("utf-8") if isinstance(body, str) else (body or b"")
        return self._send(method, url, data, headers, timeout)

    def clear(self) -> None:
        """Close the idle connections."""
        self._transport.close()

    def _send(
        self,
        method: str,
        url: str,
        body: bytes,
        headers: Mapping[str, str] | None,
        timeout: float | None,
    ) -> Answer:
        if timeout is None or isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise ValueError(f"a v2 request needs a timeout in seconds, got {timeout!r}")
        if not _PLAIN_URL.fullmatch(url):
            url = parse_url(url).url
        parts = urlsplit(url)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        # No answer at all by the deadline (a frozen member) is a failed request: the
        # transport's TimeoutError, an OSError. An answer whose body does not come by
        # then is a long poll that found nothing (etcd sends a watch's headers at
        # once): urllib3's ReadTimeoutError, which python-etcd reports as such.
        resp, _ = self._transport.request(
            f"{parts.scheme}://{parts.netloc}",
            path or "/",
            body,
            dict(headers or {}),
            float(timeout),
            method=method,
            stream=True,
        )
        try:
            data = resp.read()
        except TimeoutError as exc:
            raise u3exc.ReadTimeoutError(
                None,  # type: ignore[arg-type]  # no urllib3 pool here
                url,
                f"Read timed out. (read timeout={timeout})",
            ) from exc
        finally:
            resp.close()
        return Answer(resp.status, data, resp.headers)
