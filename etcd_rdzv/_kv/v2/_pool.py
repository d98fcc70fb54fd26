"""python-etcd's connection pool, over :mod:`._http` instead of urllib3.

python-etcd sends every request through its client's ``http`` attribute, a urllib3
``PoolManager``: ``request`` (GET and DELETE, the parameters in the query),
``request_encode_body`` (PUT and POST, the parameters form-encoded), ``urlopen`` (a
body as given) and ``clear``; it reads the answer's ``status``, ``data``,
``getheader()`` and ``getheaders()``. :class:`Pool` offers that surface over the
client's transport, so python-etcd still speaks the v2 protocol (its URLs,
parameters, errors and results) while a request costs the client about what a v3
request does, and its answers are bounded like every other (size, deadline,
nesting). urllib3 and ``http.client`` parse each request's URL and each answer's
headers (the latter with the ``email`` package) through several layers: that was
most of a v2 node's CPU in a rendezvous of 1024 node processes
(``benchmarks/NOTES.md``).

**Answers are checked before python-etcd sees them** (:func:`check_answer`): python-etcd
decodes any JSON and turns a dict of the wrong shape into attribute errors, or a
status without etcd's error body into ``"None : None"``. An answer to ``/v2/keys``
must be etcd's: a result (``action``, ``node`` objects whose fields have etcd's
types) or an error (``errorCode``/``message``), or etcd's plain ``404 page not
found`` (no v2 API there). Anything else, such as a proxy's 503, fails as
:class:`~._http.BadResponse` naming the endpoint and the status. A result is decoded
once: the check keeps it (:attr:`Answer.parsed`), and :mod:`._requests` builds
python-etcd's result from it instead of letting python-etcd decode the body again.

**Errors keep the types python-etcd sorts.** An answer whose body did not come within
the timeout is :class:`ReadTimedOut`, a urllib3 ``ReadTimeoutError`` (to python-etcd,
a long poll that found nothing, as etcd sends a watch's headers at once; any other
request, a failed one). No answer at all within the timeout (a frozen member) is the
transport's ``TimeoutError``: a failed request, also for a long poll, so the watch
moves to another endpoint. A connection that could not be made is
:class:`~._failover.ConnectFailed`, an ``OSError`` (the request was never sent);
everything else is the transport's ``OSError`` or ``http.client.HTTPException``
(``BadResponse`` among them). python-etcd wraps all of those in its
``EtcdConnectionFailed``.

**Keyword arguments python-etcd passes** are taken by name, and no others:
``preload_content`` is accepted and has no effect (every body is read whole, within
the transport's bound, as python-etcd reads it at once anyway); ``redirect=True`` and
``encode_multipart=True`` are refused with ``ValueError``: the pool follows no
redirect (build python-etcd's client with ``allow_redirect=False``; etcd's client
URLs answer themselves) and form-encodes bodies only. Nothing is retried.

**A request stuck behind a dead leader is given up** (:mod:`.._stall`): a result's
``X-Raft-Term`` header is noted, and a request that waits for its answer (all but a
long poll, and a long poll until its headers came) raises
:class:`~.._stall.Stalled` (an ``OSError``, which python-etcd wraps like any failed
request) once the term went up since it was sent: in another answer to this client,
or in the member's answer to a read of the root directory (served by the member
itself, without the leader) asked after the client's patience. A client whose first
answer has no term (an error, such as a fresh run's 404s) reads the root directory
once to learn it: its next requests would go unchecked otherwise. **One held by a
frozen member is given up** as :class:`~.._stall.Lost` (a lost answer: the next
endpoint), with no term needed; the check lasts until the body came.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlencode, urlsplit

import urllib3.exceptions as u3exc
from urllib3.util import parse_url

from .._http import BadResponse, Transport
from .._json import loads, too_deep
from .._stall import ASK, SETTLE, Terms, number

__all__ = ["Answer", "Pool", "ReadTimedOut", "check_answer"]

log = logging.getLogger(__name__)

#: A URL that needs no percent-encoding (this package's keys are base64 or plain
#: names). Any other goes through urllib3's own encoding, as python-etcd's URLs did.
_PLAIN_URL = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@/?\[\]]*")
_KEYS_PATH = "/v2/keys"
_NO_V2_API = b"404 page not found"  # what etcd without --enable-v2 answers
#: What the member is asked for its raft term: the root directory, which always
#: exists, read from the member's own copy (its listing names the top-level keys only).
_TERM_PATH = "/v2/keys/"


class ReadTimedOut(u3exc.ReadTimeoutError):
    """urllib3's ``ReadTimeoutError`` (the type python-etcd tells a long poll that
    found nothing by), for a request that went over no urllib3 pool."""

    def __init__(self, url: str, message: str) -> None:
        # Not urllib3's __init__, which names a pool: there is none.
        Exception.__init__(self, f"{url}: {message}")
        self.url = url
        self._message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.url, self._message))


class Answer:
    """An answer as python-etcd reads one: ``status``, ``data`` (the whole body) and
    its headers by name; and ``parsed``, the body of a result (a 200 or 201 from
    ``/v2/keys``) as checked JSON, ``None`` for any other answer."""

    __slots__ = ("_headers", "data", "parsed", "status")

    def __init__(
        self, status: int, data: bytes, headers: Mapping[bytes, bytes], parsed: Any = None
    ) -> None:
        self.status = status
        self.data = data
        self._headers = headers
        self.parsed = parsed

    def header(self, name: bytes) -> bytes | None:
        """The value of the header ``name`` (lower-case), as it came."""
        return self._headers.get(name)

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

    def __init__(self, transport: Transport, urls: Sequence[str] = ()) -> None:
        self._transport = transport
        #: The raft terms of this client's answers (one pool per client, whose
        #: endpoints' base URLs are ``urls``).
        self.terms = Terms(self._member_term, urls)
        self._primed = False  # the term was asked for once, the first answer having none

    def request(
        self,
        method: str,
        url: str,
        fields: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
        *,
        redirect: bool = False,
        preload_content: bool = True,
    ) -> Answer:
        """``method`` with ``fields`` in the URL's query (python-etcd: GET, DELETE)."""
        _no_redirect(redirect)
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
        *,
        encode_multipart: bool = False,
        redirect: bool = False,
        preload_content: bool = True,
    ) -> Answer:
        """``method`` with ``fields`` form-encoded in the body (python-etcd: PUT, POST)."""
        _no_redirect(redirect)
        if encode_multipart:
            raise ValueError("this pool form-encodes request bodies only (encode_multipart=False)")
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
        *,
        redirect: bool = False,
        preload_content: bool = True,
    ) -> Answer:
        """``method`` with ``body`` as it is (python-etcd: a JSON body)."""
        _no_redirect(redirect)
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
        where = f"{parts.scheme}://{parts.netloc}"
        path = parts.path or "/"
        sent_headers = dict(headers or {})
        target = path + (f"?{parts.query}" if parts.query else "")
        # A long poll waits for an event, not for the leader (etcd sends its headers
        # at once): its time says nothing about etcd's latency.
        polls = "wait=true" in parts.query
        terms = self.terms
        began = time.monotonic()
        # Checked until its answer came (see the module): for a long poll, until its
        # headers came, which etcd sends at once. No answer by the deadline, or a body
        # not come by then, is a failed request (the transport's TimeoutError, an
        # OSError); but a long poll's body not come by then is a poll that found
        # nothing: ReadTimedOut, which python-etcd reports as such.
        resp, whole = self._transport.request(
            where,
            target,
            body,
            sent_headers,
            float(timeout),
            method=method,
            stream=polls,
            check=terms.checker(
                where, sent_headers, f"{'watch' if polls else method} {path}", began + timeout
            ),
            check_every=SETTLE,  # the check says when to look next
        )
        if polls:
            try:
                data = resp.read()
            except TimeoutError as exc:
                raise ReadTimedOut(url, f"Read timed out. (read timeout={timeout})") from exc
            finally:
                resp.close()
        else:
            data = whole or b""
        parsed = check_answer(where, path, resp.status, data, resp.headers)
        terms.note(number(resp.headers.get(b"x-raft-term")))
        if not polls:
            terms.took(time.monotonic() - began)
        if not terms.term and not self._primed:
            self._prime(where, sent_headers, float(timeout))
        return Answer(resp.status, data, resp.headers, parsed)

    def _prime(self, url: str, headers: dict[str, str], timeout: float) -> None:
        """Learn the raft term once, when this client's first answer had none (an
        error, such as the 404 of a key not written yet: a fresh run's first reads);
        without it, the requests that follow could not be checked (see the module)."""
        self._primed = True
        try:
            # Bounded like a question of the check: a member that froze meanwhile does
            # not hold the caller for its whole timeout.
            self.terms.note(self._member_term(url, headers, min(timeout, ASK / 2)))
        except Exception as exc:  # no answer is no term: the next result brings one
            log.debug("the raft term of %s: %s", url, exc)

    def _member_term(self, url: str, headers: dict[str, str], timeout: float) -> int:
        """The raft term of the member at ``url`` (0 if its answer has none): from
        its answer to a read of the root directory, which it serves from its own copy."""
        auth = {k: v for k, v in headers.items() if k.lower() == "authorization"}
        resp, data = self._transport.request(url, _TERM_PATH, b"", auth, timeout, method="GET")
        check_answer(url, _TERM_PATH, resp.status, data or b"", resp.headers)
        return number(resp.headers.get(b"x-raft-term")) if resp.status == 200 else 0


def _no_redirect(redirect: bool) -> None:
    if redirect:
        raise ValueError(
            "this pool follows no redirects: build python-etcd's client with allow_redirect=False"
        )


# -- what etcd's v2 answers hold ---------------------------------------------------------

_NODE_FIELDS: dict[str, type] = {
    "key": str,
    "value": str,
    "dir": bool,
    "ttl": int,
    "expiration": str,
    "modifiedIndex": int,
    "createdIndex": int,
    "nodes": list,
}
_ERROR_FIELDS: dict[str, type] = {"errorCode": int, "message": str, "cause": str, "index": int}


def check_answer(
    where: str, path: str, status: int, data: bytes, headers: Mapping[bytes, bytes]
) -> Any:
    """Check an answer from ``where`` to ``path`` before python-etcd decodes it: its
    JSON nesting always, and for ``/v2/keys`` that it is etcd's (see the module).

    Returns:
        A result's JSON (a 200 or 201 from ``/v2/keys``), decoded; ``None`` for any
        other answer.

    Raises:
        BadResponse: it is not, naming ``where`` and the status.
    """
    if not path.startswith(_KEYS_PATH):
        if too_deep(data):
            loads(data, where)  # raises, with the message every answer gets
        return None
    index = headers.get(b"x-etcd-index")
    if index is not None and not (index.isdigit() and len(index) <= 20):
        raise BadResponse(f"{where} answered an invalid X-Etcd-Index: {index[:80]!r}")
    if status in (200, 201):
        answer = loads(data, where)
        if (
            isinstance(answer, dict)
            and isinstance(answer.get("action"), str)
            and _is_node(answer.get("node"), top=True)
            and ("prevNode" not in answer or _is_node(answer["prevNode"], top=True))
        ):
            return answer
        raise BadResponse(f"{where} answered HTTP {status} that is not etcd's: {data[:200]!r}")
    if status == 404 and data.startswith(_NO_V2_API):
        return None  # etcd without the v2 API: python-etcd's error says so, and v2.py reads it
    try:
        answer = loads(data, where)
    except BadResponse:
        answer = None
    if (
        isinstance(answer, dict)
        and ("errorCode" in answer or "message" in answer)
        and all(
            isinstance(answer[name], kind) and not (kind is int and isinstance(answer[name], bool))
            for name, kind in _ERROR_FIELDS.items()
            if name in answer
        )
    ):
        return None
    raise BadResponse(
        f"{where} answered HTTP {status} without etcd's error: {data[:200]!r} (a proxy, "
        "or not etcd)"
    )


def _is_node(node: Any, top: bool = False) -> bool:
    """Whether ``node`` is a v2 node as etcd sends one: known fields of etcd's types,
    children that are nodes too, an index on every node but the root.

    ``node`` is decoded JSON, whose values are exactly ``str``, ``int``, ``bool``,
    ``float``, ``list``, ``dict`` or ``None``: so a type is compared, not tested with
    ``isinstance`` (an ``int`` field then refuses ``true`` at no extra cost), and only
    the fields the node has are looked at.
    """
    if type(node) is not dict:
        return False
    for name, value in node.items():
        kind = _NODE_FIELDS.get(name)
        if kind is not None and type(value) is not kind and value is not None:
            return False
    if node.get("key", "/") != "/" and node.get("modifiedIndex") is None:
        return False
    if not top and type(node.get("key")) is not str:
        return False
    children = node.get("nodes")
    return not children or all(_is_node(child) for child in children)
