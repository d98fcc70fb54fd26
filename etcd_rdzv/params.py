"""Rendezvous parameters and the validated client configuration parsed from them.

Configuration is parsed once, at the edge, into frozen objects. Every error names the
option and the bad value, and is raised before any network call.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "DEFAULT_KEY_PREFIX",
    "DEFAULT_PORT",
    "ClientConfig",
    "Endpoint",
    "ParamsLike",
    "RendezvousParameters",
    "int_option",
    "parse_endpoints",
]

DEFAULT_PORT = 2379
DEFAULT_READ_TIMEOUT = 60
DEFAULT_KEY_PREFIX = "/etcd_rdzv"
SUPPORTED_APIS = ("v2", "v3")

_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")
_TRUE = {"1", "true", "t", "yes", "y"}
_FALSE = {"0", "false", "f", "no", "n"}


class ParamsLike(Protocol):
    """What we read from rendezvous parameters: ours or torch's ``RendezvousParameters``."""

    backend: str
    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    local_addr: str | None

    def get(self, key: str, default: Any = None) -> Any: ...


class RendezvousParameters:
    """Parameters of a rendezvous, with the constructor of torch's class of the same name.

    Args:
        backend: The registered handler name (for example ``etcd-rdzv-dynamic``).
        endpoint: etcd endpoints, ``host[:port][,host[:port]...]``; IPv6 in brackets.
        run_id: The id of the run; nodes with the same run id meet.
        min_nodes: The minimum number of nodes (at least 1).
        max_nodes: The maximum number of nodes (at least ``min_nodes``).
        local_addr: The address of this node, if known.
        **kwargs: Further options (see ``docs/configuration.md``).

    Raises:
        ValueError: if ``backend`` is empty or the node counts are invalid. (An empty
            ``run_id`` is rejected when a backend or store is created from these.)
    """

    def __init__(
        self,
        backend: str,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not backend:
            raise ValueError("The rendezvous backend name must be a non-empty string.")
        if min_nodes < 1:
            raise ValueError(f"min_nodes must be at least 1, got {min_nodes!r}.")
        if max_nodes < min_nodes:
            raise ValueError(
                f"max_nodes ({max_nodes!r}) must be at least min_nodes ({min_nodes!r})."
            )
        self.backend = backend
        self.endpoint = endpoint
        self.run_id = run_id
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.local_addr = local_addr
        self.config: dict[str, Any] = kwargs

    def get(self, key: str, default: Any = None) -> Any:
        """Return the option ``key``, or ``default`` when it is not set."""
        return self.config.get(key, default)

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None:
        """Return the option ``key`` as a bool (accepts 1/0, true/false, yes/no, t/f, y/n)."""
        return _as_bool(key, self.get(key, default))

    def get_as_int(self, key: str, default: int | None = None) -> int | None:
        """Return the option ``key`` as an int."""
        return _as_int(key, self.get(key, default))

    def __repr__(self) -> str:
        shown = {k: ("***" if k == "password" else v) for k, v in self.config.items()}
        return (
            f"RendezvousParameters(backend={self.backend!r}, endpoint={self.endpoint!r}, "
            f"run_id={self.run_id!r}, min_nodes={self.min_nodes}, max_nodes={self.max_nodes}, "
            f"local_addr={self.local_addr!r}, config={shown!r})"
        )


def _as_bool(key: str, value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        if value.strip().lower() in _TRUE:
            return True
        if value.strip().lower() in _FALSE:
            return False
    raise ValueError(f"Option {key!r} must be a boolean (true/false), got {value!r}.")


def _as_int(key: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"Option {key!r} must be an integer, got {value!r}.")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ValueError(f"Option {key!r} must be an integer, got {value!r}.")


def int_option(params: ParamsLike, option: str, default: int, minimum: int) -> int:
    """The integer option ``option`` of ``params``, at least ``minimum``.

    Raises:
        ValueError: naming the option and the bad value.
    """
    value = _as_int(option, params.get(option, default))
    if value is None or value < minimum:
        kind = {0: "a non-negative integer", 1: "a positive integer"}.get(
            minimum, f"an integer >= {minimum}"
        )
        raise ValueError(f"Option {option!r} must be {kind}, got {value!r}.")
    return value


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


def _readable_file(option: str, path: Any) -> str:
    if not isinstance(path, str) or not path:
        raise ValueError(f"Option {option!r} must be a file path, got {path!r}.")
    if not os.path.isfile(path):
        raise ValueError(f"Option {option!r}: file {path!r} does not exist.")
    if not os.access(path, os.R_OK):
        raise ValueError(f"Option {option!r}: file {path!r} is not readable.")
    return path


@dataclass(frozen=True)
class ClientConfig:
    """Validated settings of an etcd client. Build it with :meth:`from_params`.

    ``run_id`` is the run the client is built for (``None``: not tied to one); the
    client factory uses it for one check at connect: that the run has no keys in the
    other API's keyspace (nodes on different APIs would never see each other).
    """

    endpoints: tuple[Endpoint, ...]
    protocol: str = "http"
    read_timeout: int = DEFAULT_READ_TIMEOUT
    ca_cert: str | None = None
    ssl_cert: str | None = None
    ssl_cert_key: str | None = None
    tls_insecure: bool = False
    username: str | None = None
    password: str | None = None
    key_prefix: str = DEFAULT_KEY_PREFIX
    api: str = "v2"
    run_id: str | None = None

    def __repr__(self) -> str:
        # Never print the password.
        return (
            f"ClientConfig(endpoints={self.urls()!r}, read_timeout={self.read_timeout}, "
            f"ca_cert={self.ca_cert!r}, ssl_cert={self.ssl_cert!r}, "
            f"tls_insecure={self.tls_insecure}, username={self.username!r}, "
            f"key_prefix={self.key_prefix!r}, api={self.api!r}, run_id={self.run_id!r})"
        )

    def urls(self) -> list[str]:
        """The base URL of every endpoint, in the configured order."""
        return [e.url(self.protocol) for e in self.endpoints]

    @classmethod
    def from_params(cls, params: ParamsLike) -> ClientConfig:
        """Validate the client options of ``params``.

        Raises:
            ValueError: naming the option and its bad value; no network I/O happens.
        """
        endpoints = parse_endpoints(params.endpoint)

        raw_protocol = params.get("protocol", "http")
        protocol = str(raw_protocol).strip().lower() if raw_protocol is not None else "http"
        if protocol not in ("http", "https"):
            raise ValueError(f"Option 'protocol' must be 'http' or 'https', got {raw_protocol!r}.")

        read_timeout = _as_int("read_timeout", params.get("read_timeout", DEFAULT_READ_TIMEOUT))
        if read_timeout is None or read_timeout <= 0:
            raise ValueError(
                f"Option 'read_timeout' must be a positive integer (seconds), got {read_timeout!r}."
            )

        tls = {k: params.get(k) for k in ("ca_cert", "ssl_cert", "ssl_cert_key")}
        tls = {k: v for k, v in tls.items() if v not in (None, "")}
        tls_insecure = bool(_as_bool("tls_insecure", params.get("tls_insecure", False)))
        if protocol == "http" and (tls or tls_insecure):
            names = ", ".join(sorted(tls)) or "tls_insecure"
            raise ValueError(f"Option(s) {names} need protocol 'https', but protocol is 'http'.")
        for option, path in tls.items():
            _readable_file(option, path)
        if "ssl_cert_key" in tls and "ssl_cert" not in tls:
            raise ValueError("Option 'ssl_cert_key' is set but 'ssl_cert' is not.")

        username = params.get("username")
        password = params.get("password")
        if (username in (None, "")) != (password in (None, "")):
            missing = "password" if password in (None, "") else "username"
            raise ValueError(
                f"Options 'username' and 'password' go together; {missing!r} is missing."
            )

        key_prefix = params.get("key_prefix", DEFAULT_KEY_PREFIX)
        if (
            not isinstance(key_prefix, str)
            or not key_prefix.startswith("/")
            or key_prefix == "/"
            or "//" in key_prefix
            or any(not (c.isascii() and (c.isalnum() or c in "/._-")) for c in key_prefix)
        ):
            raise ValueError(
                "Option 'key_prefix' must be an absolute etcd path such as '/etcd_rdzv' "
                f"(letters, digits, '/', '.', '_', '-'), got {key_prefix!r}."
            )

        api = str(params.get("api", "v2")).strip().lower()
        if api not in SUPPORTED_APIS:
            raise ValueError(
                f"Option 'api' must be one of {', '.join(SUPPORTED_APIS)}, "
                f"got {params.get('api')!r}."
            )

        return cls(
            endpoints=endpoints,
            protocol=protocol,
            read_timeout=read_timeout,
            ca_cert=tls.get("ca_cert"),
            ssl_cert=tls.get("ssl_cert"),
            ssl_cert_key=tls.get("ssl_cert_key"),
            tls_insecure=tls_insecure,
            username=username or None,
            password=password or None,
            key_prefix=key_prefix.rstrip("/"),
            api=api,
            run_id=params.run_id if isinstance(params.run_id, str) and params.run_id else None,
        )
