"""Rendezvous parameters and the settings parsed from them, once.

Every option is declared once, in :mod:`etcd_rdzv.config._options` (name, kind, default,
bounds, reader, environment variable, flag, help); this module turns rendezvous
parameters into frozen, validated objects with it: :class:`ClientConfig`,
:class:`HandlerSettings` and, holding both, :class:`Settings`. Each object reads the
options of its readers from the table (:func:`~etcd_rdzv.config._options.read_by`):
every one is parsed by its declaration, except those the table marks ``rule``: a rule
here joins several inputs for them (the password; a node's rank, group, unit and
host). The fields stay written out, for the type checker; a unit test keeps
them equal to the table. Every error names the option and the bad value, and is
raised before any network call.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from .. import _keys
from ._endpoints import DEFAULT_PORT, Endpoint, parse_endpoints
from ._node import (
    MAX_NODE_GROUP,
    RANK_VARIABLES,
    _policy_fields,
    _static_fields,
    host_id,
    host_id_error,
    node_group_error,
    static_rank,
)
from ._options import (
    DYNAMIC_HANDLER_NAME,
    ENV_HOST_ID,
    ENV_NODE_GROUP,
    ENV_PASSWORD,
    HANDLER_NAME,
    OPTIONS,
    STATIC_HANDLER_NAME,
    TORCH_OPTIONS,
    Option,
    ParamsLike,
    as_bool,
    as_int,
    option,
    read_by,
    unknown_options,
)

__all__ = [
    "DEFAULT_API",
    "DEFAULT_KEY_PREFIX",
    "DEFAULT_PORT",
    "DEFAULT_STORE_TTL",
    "DYNAMIC_HANDLER_NAME",
    "ENV_HOST_ID",
    "ENV_NODE_GROUP",
    "ENV_PASSWORD",
    "HANDLER_NAME",
    "KNOWN_OPTIONS",
    "LEAVE_GRACE",
    "MAX_NODE_GROUP",
    "RANK_VARIABLES",
    "STATIC_HANDLER_NAME",
    "ClientConfig",
    "Endpoint",
    "HandlerSettings",
    "ParamsLike",
    "RendezvousParameters",
    "Settings",
    "host_id_error",
    "node_group_error",
    "parse_endpoints",
    "static_rank",
]

log = logging.getLogger(__name__)

# The defaults below are the table's (etcd_rdzv.config._options), named for their importers.
DEFAULT_READ_TIMEOUT: int = option("read_timeout").default
DEFAULT_KEY_PREFIX: str = option("key_prefix").default
#: Seconds a store key lives after its last write.
DEFAULT_STORE_TTL: int = option("store_ttl").default
SUPPORTED_APIS: tuple[str, ...] = option("api").choices
#: The default etcd API: v3 works on every etcd >= 3.4 and is the only API of etcd 3.6.
DEFAULT_API: str = option("api").default
#: Seconds past ``join_timeout`` a node that gives up has for deleting its keys on the way out.
LEAVE_GRACE = 2.0
#: Every option name etcd_rdzv knows: the ones it reads and torch's (never warned about).
KNOWN_OPTIONS = frozenset(o.name for o in OPTIONS) | TORCH_OPTIONS
_TLS_FILES = ("ca_cert", "ssl_cert", "ssl_cert_key")
#: The options each settings object reads, from the table's readers.
_CLIENT_OPTIONS = read_by("client")
_STORE_OPTIONS = read_by("store")
_HANDLER_OPTIONS = read_by("handler", "native", "static")
#: The options only etcd_rdzv's handlers read: given to torch's dynamic handler, they
#: are named in a WARNING.
_NATIVE_ONLY = tuple(o.name for o in read_by("native"))


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
        return as_bool(key, self.get(key, default))

    def get_as_int(self, key: str, default: int | None = None) -> int | None:
        """Return the option ``key`` as an int."""
        return as_int(key, self.get(key, default))

    def __repr__(self) -> str:
        shown = {k: ("***" if k == "password" else v) for k, v in self.config.items()}
        return (
            f"RendezvousParameters(backend={self.backend!r}, endpoint={self.endpoint!r}, "
            f"run_id={self.run_id!r}, min_nodes={self.min_nodes}, max_nodes={self.max_nodes}, "
            f"local_addr={self.local_addr!r}, config={shown!r})"
        )


def _password(params: ParamsLike, has_user: bool) -> str | None:
    """The etcd password: option ``password``, else the first line of the file that
    ``password_file`` names, else ``$ETCD_RDZV_PASSWORD`` (only with a user). torch's
    launcher logs every ``--rdzv-conf`` value at INFO: the file or the variable keep
    the secret out of job logs."""
    password = option("password").get(params)
    given_file = params.get("password_file")
    if password is not None and not option("password_file").absent(given_file):
        raise ValueError("Options 'password' and 'password_file' exclude each other; give one.")
    path = option("password_file").parse(given_file)
    if path is not None:
        with open(path, encoding="utf-8") as f:
            text = f.read().splitlines()
        if not text or not text[0]:
            raise ValueError(
                f"Option 'password_file': file {path!r} has no password on its first line."
            )
        return str(text[0])
    if password is None and has_user:
        return os.environ.get(ENV_PASSWORD) or None
    return None if password is None else str(password)


@dataclass(frozen=True)
class ClientConfig:
    """Validated settings of an etcd client. Build it with :meth:`from_params`.

    ``run_id`` is the run the client is built for (``None``: not tied to one); the
    client factory uses it for one check at connect: that the run does not live in the
    other API's keyspace only (nodes on different APIs would never see each other).
    """

    endpoints: tuple[Endpoint, ...]
    protocol: str = option("protocol").default
    read_timeout: int = DEFAULT_READ_TIMEOUT
    ca_cert: str | None = None
    ssl_cert: str | None = None
    ssl_cert_key: str | None = None
    tls_insecure: bool = option("tls_insecure").default
    username: str | None = None
    password: str | None = None
    key_prefix: str = DEFAULT_KEY_PREFIX
    api: str = DEFAULT_API
    run_id: str | None = None
    #: The largest answer read whole, and the largest watch event, in bytes.
    max_response_bytes: int = option("max_response_bytes").default

    def __repr__(self) -> str:
        # Never print the password.
        return (
            f"ClientConfig(endpoints={self.urls()!r}, read_timeout={self.read_timeout}, "
            f"ca_cert={self.ca_cert!r}, ssl_cert={self.ssl_cert!r}, "
            f"tls_insecure={self.tls_insecure}, username={self.username!r}, "
            f"key_prefix={self.key_prefix!r}, api={self.api!r}, run_id={self.run_id!r}, "
            f"max_response_bytes={self.max_response_bytes})"
        )

    def urls(self) -> list[str]:
        """The base URL of every endpoint, in the configured order."""
        return [e.url(self.protocol) for e in self.endpoints]

    @classmethod
    def from_params(cls, params: ParamsLike) -> ClientConfig:
        """Validate the client options of ``params``; warn about options nobody reads.

        Raises:
            ValueError: naming the option and its bad value; no network I/O happens.
        """
        config = _client_config(params)
        _warn_unknown(params)
        return config


def _client_config(params: ParamsLike) -> ClientConfig:
    endpoints = parse_endpoints(params.endpoint)
    joined = _client_rules(params)
    return ClientConfig(
        endpoints=endpoints,
        run_id=params.run_id if isinstance(params.run_id, str) and params.run_id else None,
        **_read(params, _CLIENT_OPTIONS, joined),
    )


def _client_rules(params: ParamsLike) -> dict[str, Any]:
    """The checks that join several client options (TLS needs https, a key needs its
    certificate, a user needs a password), and the password, from one of three places.
    The TLS files are opened after these checks, by their declarations."""
    protocol: str = option("protocol").get(params)
    tls = [k for k in _TLS_FILES if not option(k).absent(params.get(k))]
    tls_insecure = bool(option("tls_insecure").get(params))
    if protocol == "http" and (tls or tls_insecure):
        names = ", ".join(sorted(tls)) or "tls_insecure"
        raise ValueError(f"Option(s) {names} need protocol 'https', but protocol is 'http'.")
    if "ssl_cert_key" in tls and "ssl_cert" not in tls:
        raise ValueError("Option 'ssl_cert_key' is set but 'ssl_cert' is not.")
    username = option("username").get(params)
    password = _password(params, username is not None)
    if (username is None) != (password in (None, "")):
        missing = "password" if password in (None, "") else "username"
        raise ValueError(
            f"Options 'username' and 'password' go together; {missing!r} is missing "
            f"(the password may also come from 'password_file' or ${ENV_PASSWORD})."
        )
    return {"password": password or None}


def _read(
    params: ParamsLike, options: tuple[Option, ...], joined: dict[str, Any]
) -> dict[str, Any]:
    """The field values of ``options``: a declared rule's from ``joined`` (with the
    fields that are not options a rule derives), every other option's parsed by its
    declaration. So a new option needs only its declaration and its field.

    Raises:
        RuntimeError: the rules and the table disagree (a bug, not bad input).
    """
    ruled = {o.name for o in options if o.field and o.rule}
    overridden = {o.name for o in options if not o.rule} & joined.keys()
    if ruled - joined.keys() or overridden:
        raise RuntimeError(
            f"etcd_rdzv.config: the rules gave {sorted(joined)}; the table declares "
            f"rule=True for exactly {sorted(ruled)} of these options"
        )
    values = {o.name: o.get(params) for o in options if o.field and not o.rule}
    return values | joined


def _warn_unknown(params: ParamsLike) -> None:
    """A WARNING naming the options of ``params`` nobody reads, with the closest names."""
    config = getattr(params, "config", None)
    if not isinstance(config, dict):
        return
    unknown = unknown_options(str(k) for k in config)
    if unknown:
        log.warning(
            "run %s: unknown rendezvous option(s) %s are ignored",
            params.run_id,
            ", ".join(unknown),
        )


@dataclass(frozen=True)
class HandlerSettings:
    """Validated options of the native handler (seconds). Build with :meth:`from_params`."""

    run_id: str
    min_nodes: int
    max_nodes: int
    key_prefix: str
    join_timeout: int = option("join_timeout").default
    last_call_timeout: int = option("last_call_timeout").default
    rejoin_grace: float = option("rejoin_grace").default
    close_timeout: int = option("close_timeout").default
    heartbeat_timeout: int = option("heartbeat_timeout").default
    keep_alive_interval: int = option("keep_alive_interval").default
    keep_alive_max_attempt: int = option("keep_alive_max_attempt").default
    #: The static handler: this node's fixed rank (``None``: the native handler, ranks
    #: by arrival). The world size is then ``max_nodes``.
    rank: int | None = None
    #: Where ``rank`` came from: ``"option rank"`` or the environment variable's name.
    rank_source: str = ""
    #: This node's group (a rack, a switch, an NVLink domain): ranks are contiguous
    #: within a group. ``None``: no group. Always ``None`` for the static handler.
    node_group: str | None = None
    #: The world size is a multiple of this. Always 1 for the static handler.
    node_unit: int = option("node_unit").default
    #: This node's host (option ``host_id``, else ``local_addr``'s host, else the
    #: host name): what the host lists name, and what status groups nodes by.
    host_id: str = ""
    #: The health check run before each join (``None``: none), and its bound.
    health_check: str | None = None
    health_check_timeout: int = option("health_check_timeout").default
    #: Quarantine (see :mod:`etcd_rdzv.admission.quarantine`): this many deaths of the
    #: host's agents within ``quarantine_window`` seconds exclude it for
    #: ``quarantine_time`` seconds (``None``: off).
    quarantine_deaths: int | None = None
    quarantine_window: int = option("quarantine_window").default
    quarantine_time: int = option("quarantine_time").default
    #: Whether a new job may start the run again once it is closed and no node of the
    #: job that closed it is alive (see :mod:`etcd_rdzv.rendezvous.incarnation`).
    restart_closed_run: bool = option("restart_closed_run").default

    @property
    def node_ttl(self) -> int:
        """Seconds a node's key lives without a heartbeat: then it counts as dead."""
        return self.keep_alive_interval * self.keep_alive_max_attempt

    @property
    def renew_every(self) -> float:
        """Seconds between a node's heartbeats (renewals of its lease):
        ``keep_alive_interval``, or half the node TTL where that is longer.

        A renewal keeps the node alive for a whole TTL, so renewing once half of it
        has passed keeps the detection time (the TTL) and leaves half a TTL for a beat:
        a loaded etcd's late answer, or a failed beat tried again
        (:class:`~etcd_rdzv.rendezvous.heart.Heart` gives a beat up to what its lease
        has left, less half a second). Renewing at a third of
        it, as the defaults (3 s x 3) did, costs etcd and the nodes half as much again
        for nothing a node can see: at 4,096 nodes on one machine the renewals alone
        stretched the first round from about 18 s (no renewals in it) to 40-55 s
        (docs/benchmarks.md)."""
        return max(float(self.keep_alive_interval), self.node_ttl / 2)

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
        joined = {
            **_static_fields(params, static),
            **_policy_fields(params, static),
            "host_id": host_id(params),
        }
        return cls(
            run_id=params.run_id,
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            key_prefix=key_prefix,
            **_read(params, _HANDLER_OPTIONS, joined),
        )


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

    def value(self, name: str) -> Any:
        """The parsed value of the declared option ``name`` (``None`` for an option
        without a field of its own: ``password_file``, whose password is
        ``client.password``)."""
        declared = option(name)
        if not declared.field:
            return None
        owners: dict[str, Any] = {"client": self.client, "store": self}
        return getattr(owners.get(declared.reader, self.handler), name)

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
        client = _client_config(params)
        handler = HandlerSettings.from_params(params, client.key_prefix, static=static)
        stores = _read(params, _STORE_OPTIONS, {})
        if not static and params.get("rank") not in (None, ""):
            log.warning(
                "run %s: option 'rank' is read by the static handler (%s) only; this "
                "handler assigns ranks itself",
                params.run_id,
                STATIC_HANDLER_NAME,
            )
        policies = [n for n in _NATIVE_ONLY if params.get(n) not in (None, "")]
        if params.backend == DYNAMIC_HANDLER_NAME and policies:
            log.warning(
                "run %s: option(s) %s are read by the native handler (%s) only; torch's "
                "dynamic handler ignores them (it ranks nodes itself and keeps no host out)",
                params.run_id,
                ", ".join(repr(n) for n in policies),
                HANDLER_NAME,
            )
        _warn_unknown(params)
        return cls(
            client,
            handler,
            backend=params.backend,
            local_addr=params.local_addr,
            **stores,
        )
