"""Rendezvous parameters and the validated client configuration parsed from them.

Configuration is parsed once, at the edge, into frozen objects. Every error names the
option and the bad value, and is raised before any network call.
"""

from __future__ import annotations

import difflib
import ipaddress
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from . import _keys

__all__ = [
    "DEFAULT_API",
    "DEFAULT_KEY_PREFIX",
    "DEFAULT_PORT",
    "DEFAULT_STORE_TTL",
    "ENV_NODE_GROUP",
    "ENV_PASSWORD",
    "KNOWN_OPTIONS",
    "MAX_NODE_GROUP",
    "RANK_VARIABLES",
    "STATIC_HANDLER_NAME",
    "ClientConfig",
    "Endpoint",
    "HandlerSettings",
    "ParamsLike",
    "RendezvousParameters",
    "Settings",
    "int_option",
    "node_group_error",
    "parse_endpoints",
    "static_rank",
]

log = logging.getLogger(__name__)

DEFAULT_PORT = 2379
DEFAULT_READ_TIMEOUT = 60
DEFAULT_KEY_PREFIX = "/etcd_rdzv"
DEFAULT_STORE_TTL = 7200  # seconds a store key lives after its last write
SUPPORTED_APIS = ("v2", "v3")
#: The default etcd API: v3 works on every etcd >= 3.4 and is the only API of etcd 3.6.
DEFAULT_API = "v3"
#: The environment variable read for the etcd password when neither ``password`` nor
#: ``password_file`` is given (and ``username`` is).
ENV_PASSWORD = "ETCD_RDZV_PASSWORD"
#: The torchrun name of torch's dynamic handler over our backend (``etcd_rdzv.torch``),
#: which reads neither ``node_group`` nor ``node_unit``.
_DYNAMIC_HANDLER_NAME = "etcd-rdzv-dynamic"
#: The environment variable read for ``node_group`` when the option is not given.
ENV_NODE_GROUP = "ETCD_RDZV_NODE_GROUP"
#: Characters in a ``node_group``.
MAX_NODE_GROUP = 128
#: The torchrun name of the static handler (each node's rank given); ``create_handler``
#: builds it for parameters with this backend name.
STATIC_HANDLER_NAME = "etcd-rdzv-static"

#: Options etcd_rdzv reads (docs/configuration.md has the table).
OPTIONS = frozenset(
    {
        # the client
        "protocol",
        "read_timeout",
        "ca_cert",
        "ssl_cert",
        "ssl_cert_key",
        "tls_insecure",
        "username",
        "password",
        "password_file",
        "key_prefix",
        "api",
        # the store
        "store_ttl",
        # the native handler
        "join_timeout",
        "last_call_timeout",
        "close_timeout",
        "heartbeat_timeout",
        "keep_alive_interval",
        "keep_alive_max_attempt",
        "node_group",
        "node_unit",
        # the static handler
        "rank",
    }
)
#: Options torch's launcher or torch's own handlers put into ``rdzv_configs``: known,
#: so never warned about, though etcd_rdzv does not read them.
TORCH_OPTIONS = frozenset(
    {"timeout", "is_host", "store_type", "use_libuv", "cacert", "cert", "key"}
)
KNOWN_OPTIONS = OPTIONS | TORCH_OPTIONS

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


def _password(params: ParamsLike, has_user: bool) -> str | None:
    """The etcd password: option ``password``, else the first line of the file that
    ``password_file`` names, else ``$ETCD_RDZV_PASSWORD`` (only with a user). torch's
    launcher logs every ``--rdzv-conf`` value at INFO: the file or the variable keep
    the secret out of job logs."""
    password = params.get("password")
    path = params.get("password_file")
    if password not in (None, "") and path not in (None, ""):
        raise ValueError("Options 'password' and 'password_file' exclude each other; give one.")
    if path not in (None, ""):
        _readable_file("password_file", path)
        with open(path, encoding="utf-8") as f:
            text = f.read().splitlines()
        if not text or not text[0]:
            raise ValueError(
                f"Option 'password_file': file {path!r} has no password on its first line."
            )
        return text[0]
    if password in (None, "") and has_user:
        return os.environ.get(ENV_PASSWORD) or None
    return None if password in (None, "") else str(password)


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
    api: str = DEFAULT_API
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
        password = _password(params, username not in (None, ""))
        if (username in (None, "")) != (password in (None, "")):
            missing = "password" if password in (None, "") else "username"
            raise ValueError(
                f"Options 'username' and 'password' go together; {missing!r} is missing "
                f"(the password may also come from 'password_file' or ${ENV_PASSWORD})."
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

        raw_api = params.get("api")
        api = DEFAULT_API if raw_api in (None, "") else str(raw_api).strip().lower()
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


def unknown_options(params: ParamsLike) -> list[str]:
    """The options of ``params`` that etcd_rdzv does not know, each with a hint."""
    config = getattr(params, "config", None)
    if not isinstance(config, dict):
        return []
    found = []
    for name in sorted(str(k) for k in config):
        if name in KNOWN_OPTIONS:
            continue
        close = difflib.get_close_matches(name, sorted(OPTIONS), n=1, cutoff=0.75)
        found.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    return found


@dataclass(frozen=True)
class HandlerSettings:
    """Validated options of the native handler (seconds). Build with :meth:`from_params`."""

    run_id: str
    min_nodes: int
    max_nodes: int
    key_prefix: str
    join_timeout: int = 600
    last_call_timeout: int = 30
    close_timeout: int = 30
    heartbeat_timeout: int = 5
    keep_alive_interval: int = 5
    keep_alive_max_attempt: int = 3
    #: The static handler: this node's fixed rank (``None``: the native handler, ranks
    #: by arrival). The world size is then ``max_nodes``.
    rank: int | None = None
    #: Where ``rank`` came from: ``"option rank"`` or the environment variable's name.
    rank_source: str = ""
    #: This node's group (a rack, a switch, an NVLink domain): ranks are contiguous
    #: within a group. ``None``: no group. Always ``None`` for the static handler.
    node_group: str | None = None
    #: The world size is a multiple of this. Always 1 for the static handler.
    node_unit: int = 1

    @property
    def node_ttl(self) -> int:
        """Seconds a node's key lives without a heartbeat: then it counts as dead."""
        return self.keep_alive_interval * self.keep_alive_max_attempt

    @classmethod
    def from_params(
        cls, params: ParamsLike, key_prefix: str, *, static: bool = False
    ) -> HandlerSettings:
        """Raises ValueError naming the option and value; no network I/O.

        ``static``: the static handler, whose node needs a rank (:func:`static_rank`).
        """
        _keys.run_dir(key_prefix, params.run_id)  # validates the run id
        if params.min_nodes < 1 or params.max_nodes < params.min_nodes:
            raise ValueError(
                f"Need 1 <= min_nodes <= max_nodes, got min_nodes={params.min_nodes!r}, "
                f"max_nodes={params.max_nodes!r}."
            )
        return cls(
            run_id=params.run_id,
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            key_prefix=key_prefix,
            join_timeout=int_option(params, "join_timeout", 600, 1),
            last_call_timeout=int_option(params, "last_call_timeout", 30, 0),
            close_timeout=int_option(params, "close_timeout", 30, 1),
            heartbeat_timeout=int_option(params, "heartbeat_timeout", 5, 1),
            keep_alive_interval=int_option(params, "keep_alive_interval", 5, 1),
            keep_alive_max_attempt=int_option(params, "keep_alive_max_attempt", 3, 1),
            **_static_fields(params, static),
            **_policy_fields(params, static),
        )


def node_group_error(value: object) -> str | None:
    """Why ``value`` is not a node group (``None``: it is one): a group is 1 to
    :data:`MAX_NODE_GROUP` printable ASCII characters, no spaces."""
    if not isinstance(value, str):
        return f"a string, not {type(value).__name__}"
    if not 1 <= len(value) <= MAX_NODE_GROUP:
        return f"1 to {MAX_NODE_GROUP} characters long, not {len(value)}"
    if not all("!" <= c <= "~" for c in value):
        return "printable ASCII without spaces"
    return None


def _node_group(params: ParamsLike, environ: Mapping[str, str]) -> str | None:
    value: Any = params.get("node_group")
    source = "Option 'node_group'"
    if value is None or value == "":
        value = environ.get(ENV_NODE_GROUP, "").strip()
        source = f"${ENV_NODE_GROUP}"
        if not value:
            return None
    elif isinstance(value, str):
        value = value.strip()
    problem = node_group_error(value)
    if problem is not None:
        raise ValueError(f"{source} must be {problem}, got {value!r}.")
    text: str = value
    return text


def _policy_fields(
    params: ParamsLike, static: bool, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``node_group`` and ``node_unit``, validated; dropped (with a warning when given
    as options) for the static handler, where every node brings its own rank."""
    env = os.environ if environ is None else environ
    unit = int_option(params, "node_unit", 1, 1)
    if static:
        given = [
            name
            for name in ("node_group", "node_unit")
            if params.get(name) not in (None, "") and (name, unit) != ("node_unit", 1)
        ]
        if given:
            _node_group(params, {})  # a bad value is still an error
            log.warning(
                "run %s: option(s) %s are ignored by the static handler (etcd-rdzv-static): "
                "each node's rank is given, and the world is max_nodes",
                params.run_id,
                ", ".join(repr(n) for n in given),
            )
        return {}
    low = -(-params.min_nodes // unit) * unit
    if unit > params.max_nodes or low > params.max_nodes:
        raise ValueError(
            f"Option 'node_unit' must allow a world size that is a multiple of it between "
            f"min_nodes and max_nodes, got node_unit={unit} with min_nodes="
            f"{params.min_nodes}, max_nodes={params.max_nodes}."
        )
    return {"node_group": _node_group(params, env), "node_unit": unit}


#: Environment variables a scheduler sets to a node's index, in the order tried when
#: the ``rank`` option is absent: Slurm, Kubernetes indexed Jobs, torch/other launchers.
RANK_VARIABLES = ("SLURM_NODEID", "JOB_COMPLETION_INDEX", "GROUP_RANK", "NODE_RANK")


def static_rank(params: ParamsLike, environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """The static handler's rank for this node and where it came from.

    The ``rank`` option first, then the first of :data:`RANK_VARIABLES` that is set.
    The world size is ``max_nodes``.

    Raises:
        ValueError: no rank anywhere, or one that is not an integer in
            ``0..max_nodes-1``, naming the option or variable and its value.
    """
    env = os.environ if environ is None else environ
    value: Any = params.get("rank")
    source = "option rank"
    if value is None or (isinstance(value, str) and not value.strip()):
        for name in RANK_VARIABLES:
            if env.get(name, "").strip():
                value, source = env[name], f"${name}"
                break
        else:
            raise ValueError(
                "The static rendezvous needs this node's rank: give the option 'rank' "
                "(torchrun: --rdzv-conf=rank=N) or set one of "
                + ", ".join(f"${n}" for n in RANK_VARIABLES)
                + "."
            )
    text = value.strip() if isinstance(value, str) else value
    if isinstance(text, str) and re.fullmatch(r"[0-9]{1,9}", text):
        rank: Any = int(text)
    else:
        rank = text
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < params.max_nodes:
        raise ValueError(
            f"The static rank from {source} must be an integer in 0..{params.max_nodes - 1} "
            f"(the world size is max_nodes={params.max_nodes}), got {value!r}."
        )
    return rank, source


def _static_fields(params: ParamsLike, static: bool) -> dict[str, Any]:
    if not static:
        return {}
    rank, source = static_rank(params)
    return {"rank": rank, "rank_source": source}


@dataclass(frozen=True)
class Settings:
    """Every option of one set of rendezvous parameters, parsed once.

    ``client`` configures the etcd client, ``handler`` the native handler, and
    ``store_ttl`` the stores (seconds a key lives after its last write, ``0``: no
    expiry). The factories (:func:`etcd_rdzv.create_backend`,
    :func:`etcd_rdzv.create_handler`) and the CLI build their objects from it.
    """

    client: ClientConfig
    handler: HandlerSettings
    store_ttl: int = DEFAULT_STORE_TTL
    backend: str = ""
    local_addr: str | None = None

    @property
    def run_id(self) -> str:
        return self.handler.run_id

    @classmethod
    def from_params(cls, params: ParamsLike, *, static: bool | None = None) -> Settings:
        """Validate every option of ``params``; warn about options nobody reads.

        ``static``: for the static handler, which needs a rank; by default when
        ``params.backend`` is ``etcd-rdzv-static``.

        Raises:
            ValueError: naming the option and its bad value; no network I/O happens.
        """
        if static is None:
            static = params.backend == STATIC_HANDLER_NAME
        client = ClientConfig.from_params(params)
        handler = HandlerSettings.from_params(params, client.key_prefix, static=static)
        store_ttl = int_option(params, "store_ttl", DEFAULT_STORE_TTL, 0)
        unknown = unknown_options(params)
        if not static and params.get("rank") not in (None, ""):
            log.warning(
                "run %s: option 'rank' is read by the static handler (etcd-rdzv-static) "
                "only; this handler assigns ranks itself",
                params.run_id,
            )
        policies = [n for n in ("node_group", "node_unit") if params.get(n) not in (None, "")]
        if params.backend == _DYNAMIC_HANDLER_NAME and policies:
            log.warning(
                "run %s: option(s) %s are read by the native handler (etcd-rdzv) only; "
                "torch's dynamic handler ranks nodes itself",
                params.run_id,
                ", ".join(repr(n) for n in policies),
            )
        if unknown:
            log.warning(
                "run %s: unknown rendezvous option(s) %s are ignored",
                params.run_id,
                ", ".join(unknown),
            )
        return cls(client, handler, store_ttl, params.backend, params.local_addr)
