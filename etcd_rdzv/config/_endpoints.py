"""etcd client endpoints: ``host[:port][,host[:port]...]``, IPv6 in brackets."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

__all__ = ["DEFAULT_PORT", "Endpoint", "parse_endpoints"]

DEFAULT_PORT = 2379

_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")


@dataclass(frozen=True)
class Endpoint:
    """One etcd client endpoint."""

    host: str
    port: int

    def netloc(self) -> str:
        """``host:port``, with IPv6 addresses in brackets."""
        if ":" in self.host:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"

    def url(self, protocol: str) -> str:
        """The base URL of this endpoint for ``protocol`` (``http`` or ``https``)."""
        return f"{protocol}://{self.netloc()}"


def _parse_port(text: str, item: str) -> int:
    if not text.isdigit():
        raise ValueError(f"Option 'endpoint': port {text!r} in {item!r} is not a number.")
    port = int(text)
    if not 1 <= port <= 65535:
        raise ValueError(f"Option 'endpoint': port {port} in {item!r} is out of range (1-65535).")
    return port


def _parse_one(item: str) -> Endpoint:
    if "://" in item:
        raise ValueError(
            f"Option 'endpoint': {item!r} has a URL scheme; give host[:port] and set the "
            "scheme with the 'protocol' option (http or https)."
        )
    if item.startswith("["):
        close = item.find("]")
        if close < 0:
            raise ValueError(
                f"Option 'endpoint': {item!r} has no closing ']' for its IPv6 address."
            )
        host, rest = item[1:close], item[close + 1 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(
                f"Option 'endpoint': {host!r} in {item!r} is not an IPv6 address."
            ) from None
        if not rest:
            return Endpoint(host, DEFAULT_PORT)
        if not rest.startswith(":"):
            raise ValueError(f"Option 'endpoint': unexpected {rest!r} after ']' in {item!r}.")
        return Endpoint(host, _parse_port(rest[1:], item))
    if item.count(":") > 1:
        raise ValueError(
            f"Option 'endpoint': {item!r} looks like an IPv6 address; write it in brackets, "
            "for example [::1]:2379."
        )
    host, sep, port_text = item.partition(":")
    if not _HOSTNAME.match(host):
        raise ValueError(f"Option 'endpoint': {host!r} in {item!r} is not a valid host name.")
    return Endpoint(host, _parse_port(port_text, item) if sep else DEFAULT_PORT)


def parse_endpoints(text: str | None) -> tuple[Endpoint, ...]:
    """Parse ``host[:port][,host[:port]...]``; an empty string means ``localhost:2379``.

    Raises:
        ValueError: naming the ``endpoint`` option and the bad part.
    """
    if text is None or not str(text).strip():
        return (Endpoint("localhost", DEFAULT_PORT),)
    endpoints: list[Endpoint] = []
    for raw in str(text).split(","):
        item = raw.strip()
        if not item:
            raise ValueError(f"Option 'endpoint': empty entry in {text!r}.")
        endpoint = _parse_one(item)
        if endpoint in endpoints:
            raise ValueError(f"Option 'endpoint': {item!r} is listed twice in {text!r}.")
        endpoints.append(endpoint)
    return tuple(endpoints)
