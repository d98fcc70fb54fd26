"""The one table of rendezvous options: each is declared here once.

A declaration (:class:`Option`) holds an option's name, kind, default, bounds, reader,
environment variable, command-line flag and help. From the table come the parsing of
simple values (:meth:`Option.parse`; the rules that join several options live in
:mod:`etcd_rdzv.config.params`), which settings object reads each option (its
``reader``: :func:`read_by`), the options torch's dynamic handler ignores, the check
for unknown options (:func:`unknown_options`), the flags of ``etcd-rdzv`` and the table
in ``docs/configuration.md`` (:mod:`etcd_rdzv.config.docs`). A unit test
(``tests/unit/test_options.py``) keeps the settings classes' fields equal to the table
and fails when the package reads an option the table does not declare.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ._values import (
    as_bool,
    as_int,
    as_number,
    check_api_installed,
    check_health_check,
    check_key_prefix,
    readable_file,
)

__all__ = [
    "DEFAULT_ENDPOINT",
    "DYNAMIC_HANDLER_NAME",
    "ENV_API",
    "ENV_ENDPOINT",
    "ENV_HOST_ID",
    "ENV_NODE_GROUP",
    "ENV_PASSWORD",
    "HANDLER_NAME",
    "OPTIONS",
    "STATIC_HANDLER_NAME",
    "TORCH_OPTIONS",
    "Option",
    "ParamsLike",
    "as_bool",
    "as_int",
    "as_number",
    "option",
    "read_by",
    "readable_file",
    "unknown_options",
]

#: The torchrun names of the handlers: the native one, the static one (each node's
#: rank given) and torch's dynamic handler over our backend (``etcd_rdzv.torch``).
HANDLER_NAME = "etcd-rdzv"
STATIC_HANDLER_NAME = "etcd-rdzv-static"
DYNAMIC_HANDLER_NAME = "etcd-rdzv-dynamic"

#: Read by the library for ``password`` (with a ``username``), ``node_group`` and
#: ``host_id``.
ENV_PASSWORD = "ETCD_RDZV_PASSWORD"
ENV_NODE_GROUP = "ETCD_RDZV_NODE_GROUP"
ENV_HOST_ID = "ETCD_RDZV_HOST_ID"
#: Read by the command line only, for ``--api`` and ``--endpoint``.
ENV_API = "ETCD_RDZV_API"
ENV_ENDPOINT = "ETCD_RDZV_ENDPOINT"
#: The command line's endpoint when neither --endpoint nor $ETCD_RDZV_ENDPOINT is given.
DEFAULT_ENDPOINT = "127.0.0.1:2379"

Kind = Literal["int", "number", "bool", "choice", "text", "file"]
#: Who reads an option, and so which settings object of :mod:`etcd_rdzv.config.params`
#: holds its value: ``client`` (``ClientConfig``: every factory), ``store`` (``Settings``:
#: the stores), ``handler`` (``HandlerSettings``: every handler, torch's dynamic one too),
#: ``native`` (``HandlerSettings``: etcd_rdzv's own handlers only; given to torch's
#: dynamic handler it is warned about), ``static`` (``HandlerSettings``: the static
#: handler only).
Reader = Literal["client", "store", "handler", "native", "static"]
#: Which commands of ``etcd-rdzv`` have a flag for an option (``None``: none do).
CliGroup = Literal["etcd", "rendezvous", "join"]


class ParamsLike(Protocol):
    """What we read from rendezvous parameters: ours or torch's ``RendezvousParameters``."""

    backend: str
    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    local_addr: str | None

    def get(self, key: str, default: Any = None) -> Any: ...


@dataclass(frozen=True)
class Option:
    """One rendezvous option, declared once.

    ``help`` is one line, as ``etcd-rdzv --help`` shows it (option names in backticks
    become flags there); ``details`` follow it in the documentation only.
    """

    name: str
    kind: Kind
    default: Any
    reader: Reader
    help: str
    details: str = ""
    #: The least value of an ``int`` or ``number`` option.
    minimum: int | None = None
    #: The values of a ``choice`` option, lower case.
    choices: tuple[str, ...] = ()
    #: What a number counts (``seconds``, ``bytes``), in errors and help.
    unit: str = ""
    #: What a value must be, in errors and the documentation; empty: from the kind.
    expect: str = ""
    #: A variable the library reads when the option is absent.
    env: str | None = None
    #: A variable only the command line reads when the flag is absent.
    cli_env: str | None = None
    #: The commands of ``etcd-rdzv`` with a flag for the option.
    cli: CliGroup | None = None
    metavar: str | None = None
    #: Whether an empty string means the default of a string option (else, and for
    #: numbers and booleans, it is a bad value).
    blank_is_default: bool = True
    #: The parsing of a ``text`` option whose values have a form (else taken as given);
    #: of a ``choice`` option, what a value needs beyond being one of the choices
    #: (``api=v2``: the ``v2`` extra installed).
    check: Callable[[Any], Any] | None = None
    #: Whether the reader's settings object has a field of the option's name (else a
    #: rule of :mod:`etcd_rdzv.config.params` folds it into another option's field).
    field: bool = True
    #: Whether the field's value comes from a rule of :mod:`etcd_rdzv.config.params`
    #: that joins several inputs (other options, the environment, the node counts),
    #: not from :meth:`parse` alone.
    rule: bool = False

    @property
    def flag(self) -> str:
        """The command-line flag, ``--read-timeout`` for ``read_timeout``."""
        return "--" + self.name.replace("_", "-")

    @property
    def requirement(self) -> str:
        """What a value must be: ``a positive integer (seconds)``, ``'http' or 'https'``."""
        if self.expect:
            return self.expect
        if self.kind == "int":
            names = {0: "a non-negative integer", 1: "a positive integer"}
            text = names.get(self.minimum or 0, f"an integer >= {self.minimum}")
            return f"{text} ({self.unit})" if self.unit else text
        if self.kind == "number":
            names = {0: "a non-negative number"}
            text = names.get(self.minimum or 0, f"a number >= {self.minimum}")
            return f"{text} ({self.unit})" if self.unit else text
        if self.kind == "bool":
            return "a boolean"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "file":
            return "a readable file"
        return "a string"

    def absent(self, raw: Any) -> bool:
        """Whether ``raw`` means "not given": ``None``, or a blank string where allowed."""
        if raw is None:
            return True
        blank = isinstance(raw, str) and not raw.strip()
        # A blank number or boolean is a bad value, as torch's get_as_int makes it.
        return blank and self.blank_is_default and self.kind not in ("int", "number", "bool")

    def parse(self, raw: Any) -> Any:
        """The value of this option given as ``raw`` (``None``: not given).

        Raises:
            ValueError: naming the option and the bad value.
        """
        if self.absent(raw):
            return self.default
        if self.kind == "int":
            value = as_int(self.name, raw)
            if value is None or (self.minimum is not None and value < self.minimum):
                raise ValueError(f"Option {self.name!r} must be {self.requirement}, got {value!r}.")
            return value
        if self.kind == "number":
            number = as_number(self.name, raw)
            if number is None or (self.minimum is not None and number < self.minimum):
                raise ValueError(f"Option {self.name!r} must be {self.requirement}, got {raw!r}.")
            return number
        if self.kind == "bool":
            return as_bool(self.name, raw)
        if self.kind == "choice":
            text = str(raw).strip().lower()
            if text not in self.choices:
                raise ValueError(f"Option {self.name!r} must be {self.requirement}, got {raw!r}.")
            return text if self.check is None else self.check(text)
        if self.kind == "file":
            return readable_file(self.name, raw)
        return raw if self.check is None else self.check(raw)

    def get(self, params: Any) -> Any:
        """The value of this option in rendezvous parameters ``params``."""
        return self.parse(params.get(self.name))


OPTIONS: tuple[Option, ...] = (
    # -- the client -------------------------------------------------------------------
    Option(
        "protocol", "choice", "http", "client",
        "how to talk to etcd: `http` or `https` (case-insensitive)",
        choices=("http", "https"), expect="'http' or 'https'", cli="etcd",
        blank_is_default=False,
    ),
    Option(
        "read_timeout", "int", 60, "client", "bound of each request to etcd",
        "Watches are re-armed every `read_timeout` until their own deadline. It also "
        "bounds the probe that `create_client` / `create_backend` make: all endpoints "
        "together get `read_timeout` to answer. A request that a frozen member holds "
        "goes to the next endpoint after about 10 s, whatever this says.",
        minimum=1, unit="seconds", cli="etcd", metavar="SECONDS",
    ),
    Option(
        "ca_cert", "file", None, "client", "CA bundle that verifies etcd's certificate (https)",
        "Without it, TLS verifies against the system CAs.",
        cli="etcd", metavar="FILE",
    ),
    Option(
        "ssl_cert", "file", None, "client",
        "client certificate (PEM), for etcd's client-certificate auth (https)",
        cli="etcd", metavar="FILE",
    ),
    Option(
        "ssl_cert_key", "file", None, "client",
        "private key of `ssl_cert`, when it is not in that file",
        "Needs `ssl_cert`.", cli="etcd", metavar="FILE",
    ),
    Option(
        "tls_insecure", "bool", False, "client",
        "do NOT verify etcd's certificate and host name (https; logs a warning)",
        "The WARNING (logger `etcd_rdzv.client._connect`) comes each time a client is built.",
        cli="etcd",
    ),
    Option(
        "username", "text", None, "client", "the etcd user; goes with `password`",
        cli="etcd", metavar="USER",
    ),
    Option(
        "password", "text", None, "client",
        "password of `username` (prefer `password_file` or the variable: command lines "
        "are visible to other users)",
        "Never printed in `repr()` or logs. But torch's launcher logs every "
        "`--rdzv-conf` value at INFO: under torchrun use `password_file` or the "
        "variable. The variable is read only with a `username` and neither `password` "
        "nor `password_file`.",
        env=ENV_PASSWORD, cli="etcd", metavar="PASSWORD", rule=True,
    ),
    Option(
        "password_file", "file", None, "client",
        "file whose first line is the password of `username` (excludes `password`)",
        cli="etcd", metavar="FILE", field=False,
    ),
    Option(
        "key_prefix", "text", "/etcd_rdzv", "client", "the etcd directory that holds every run",
        "Not `/`, no `//`; a trailing `/` is dropped.",
        expect="an absolute etcd path of letters, digits, `/`, `.`, `_`, `-`",
        cli="etcd", metavar="PATH", blank_is_default=False, check=check_key_prefix,
    ),
    Option(
        "api", "choice", "v3", "client",
        "the etcd API of the run: `v3` (etcd 3.4 or newer; the only API of etcd 3.6) or `v2` "
        "(etcd started with --enable-v2); every node of a job and the commands that look "
        "at it must use the same",
        "Case-insensitive. etcd keeps the two keyspaces apart, nothing switches "
        "automatically, and a node whose run has keys in the other keyspace and none "
        "established in its own is refused, writing nothing. `v2` needs the `v2` extra "
        "(`pip install 'etcd-rdzv[v2]'`: python-etcd and urllib3). See [etcd APIs](api.md).",
        choices=("v2", "v3"), cli_env=ENV_API, cli="etcd", check=check_api_installed,
    ),
    Option(
        "max_response_bytes", "int", 64 * 1024 * 1024, "client",
        "the largest answer from etcd read whole, and the largest watch event, in bytes; "
        "a larger answer fails with a connection error naming the endpoint",
        minimum=65536, unit="bytes", cli="etcd", metavar="BYTES",
    ),
    # -- the stores -------------------------------------------------------------------
    Option(
        "store_ttl", "int", 7200, "store",
        "seconds a store key lives after its last write; `0`: no expiry",
        "Without expiry, keys stay until `EtcdStore.clear()`. Read by `create_backend` "
        "and by the handlers for their rounds' stores.",
        minimum=0, unit="seconds",
    ),
    # -- the handlers ("handler": torch's dynamic handler reads it too) --------------
    Option(
        "join_timeout", "int", 600, "handler",
        "seconds within which a rendezvous must complete",
        "The native handler retries failed etcd requests (back-off 0.5 s to 4 s) within "
        "it, so an etcd outage shorter than this costs time, not the job.",
        minimum=1, unit="seconds", cli="rendezvous", metavar="SECONDS",
    ),
    Option(
        "last_call_timeout", "int", 30, "handler",
        "extra seconds to wait for more nodes once `min_nodes` have joined",
        minimum=0, unit="seconds", cli="rendezvous", metavar="SECONDS",
    ),
    Option(
        "rejoin_grace", "number", 1.0, "native",
        "seconds a re-forming group waits for members of the previous round that have "
        "not re-joined yet (their keys still alive), before it completes without them",
        "A group re-forms after a completed round when a member died, left or lost its "
        "worker: once every member whose key is still alive has re-joined (and the "
        "spares), the round completes at once, without the last call. A member that "
        "has not re-joined within this grace is left out (a dead host's key would "
        "otherwise be waited for until its TTL runs out); if it lives, it joins later "
        "as a waiting node, which costs the others one more restart. Fractions of a "
        "second are allowed (`0.3`: survivors that re-join in their own processes, "
        "[in-process](inprocess.md), are back within milliseconds). See "
        "[recovery](handler.md#recovery).",
        minimum=0, unit="seconds", cli="rendezvous", metavar="SECONDS",
    ),
    Option(
        "close_timeout", "int", 30, "handler",
        "seconds that closing may take",
        "That is `shutdown()` (closing the run under torchrun, then deleting the node's "
        "keys) and the clean-up of a handler dropped without `shutdown()`.",
        minimum=1, unit="seconds", cli="rendezvous", metavar="SECONDS",
    ),
    Option(
        "heartbeat_timeout", "int", 5, "handler",
        "seconds one heartbeat (the renewal of a node's keys) may take; at most half "
        "the time between heartbeats is used",
        "A beat may also take what its lease has left, less half a second, up to the "
        "time between heartbeats, where that is longer (a loaded etcd answers late; a "
        "beat given up is only sent again, on v2 over a new connection). A beat that "
        "fails at once is tried again a quarter of that time later, one that runs out "
        "once half of what its lease has left has passed, so a slow etcd cannot "
        "stretch a beat past the keys' TTL "
        "(`keep_alive_interval` x "
        "`keep_alive_max_attempt`).",
        minimum=1, unit="seconds", cli="rendezvous", metavar="SECONDS",
    ),
    Option(
        "keep_alive_interval", "int", 3, "handler",
        "seconds between a node's keep-alive heartbeats (renewals of its lease), or "
        "half the node TTL where that is longer",
        "A renewal keeps the node alive for its whole TTL (`keep_alive_interval` x "
        "`keep_alive_max_attempt`), so the node renews once half of it has passed: "
        "every 4.5 s with the defaults. On v3 one request per beat renews every key of "
        "the node. See [recovery](handler.md#recovery) for the faster setting.",
        minimum=1, unit="seconds", cli="rendezvous", metavar="SECONDS",
    ),
    Option(
        "keep_alive_max_attempt", "int", 3, "handler",
        "with `keep_alive_interval`, how long a node lives without a heartbeat",
        "A node whose last heartbeat is older than `keep_alive_interval` x "
        "`keep_alive_max_attempt` (its TTL) is dropped.",
        minimum=1, cli="rendezvous", metavar="N",
    ),
    Option(
        "node_group", "text", None, "native",
        "this node's group (a rack, a switch, an NVLink domain): ranks are contiguous "
        "within a group",
        "Leading and trailing spaces are dropped. Groups take ranks in the order of their "
        "names, nodes without a group after them. Nodes may name different groups; a "
        "value from the environment is checked as strictly, and its error names the "
        "variable. See [rank policies](handler.md#rank-policies).",
        expect="1 to 128 printable ASCII characters, no spaces",
        env=ENV_NODE_GROUP, cli="join", metavar="NAME", rule=True,
    ),
    Option(
        "host_id", "text", None, "native",
        "this node's host: a restarted agent on the same host is the same host in "
        "status and in the host lists",
        "Default: the host of `local_addr` (torchrun's `--local-addr`) if given, else "
        "this machine's host name. Set it where host names repeat or change (containers, "
        "several agents on one machine). See [hosts](operations.md#hosts).",
        expect="1 to 253 printable ASCII characters, no spaces or slashes",
        env=ENV_HOST_ID, cli="join", metavar="HOST", rule=True,
    ),
    Option(
        "node_unit", "int", 1, "native",
        "the world size is a multiple of this; nodes left over wait as spares",
        "The world is the largest multiple the live nodes allow, between `min_nodes` "
        "(rounded up to a multiple) and `max_nodes` (rounded down). A unit with no "
        "multiple between them is a `ValueError` naming all three. Every node of a job "
        "should use the same value (the coordinator's decides). See "
        "[rank policies](handler.md#rank-policies).",
        minimum=1, cli="join", metavar="N", rule=True,
    ),
    Option(
        "health_check", "text", None, "native",
        "a check run before each join: a command line (no shell) or "
        "python:<module>:<function>; a node whose check fails does not join",
        "A command passes when it exits 0; a callable when it returns anything but "
        "`False`. A failing check is recorded under the run (shown by `etcd-rdzv "
        "status`), logged at WARNING and run again every few seconds within "
        "`join_timeout`; then the join fails with an error naming the check, the host and "
        "why. See [health checks](operations.md#health-checks).",
        expect="a command line, or python:<module>:<function>",
        cli="join", metavar="CHECK", check=check_health_check,
    ),
    Option(
        "health_check_timeout", "int", 60, "native",
        "seconds one run of `health_check` may take (a command is then killed, with its "
        "process group)",
        minimum=1, unit="seconds", cli="join", metavar="SECONDS",
    ),
    Option(
        "quarantine_deaths", "int", None, "native",
        "quarantine: a host whose agents died this many times within "
        "`quarantine_window` is excluded for `quarantine_time` (off when unset)",
        "A death is an agent that ended without leaving (killed, frozen, its host lost), "
        "not one that shut down or exited. Its host's next agent finds it when it starts, "
        "records it under the run and, at this many, excludes the host (`by: quarantine`, "
        "shown by `etcd-rdzv status`) and exits as an excluded host does. Host ids must "
        "then be one per agent. See [quarantine](operations.md#quarantine).",
        minimum=1, cli="join", metavar="K",
    ),
    Option(
        "quarantine_window", "int", 3600, "native",
        "seconds within which `quarantine_deaths` deaths quarantine a host",
        minimum=1, unit="seconds", cli="join", metavar="SECONDS",
    ),
    Option(
        "quarantine_time", "int", 3600, "native",
        "seconds a quarantined host stays excluded (an operator's `include` ends it "
        "sooner)",
        minimum=1, unit="seconds", cli="join", metavar="SECONDS",
    ),
    Option(
        "restart_closed_run", "bool", True, "native",
        "a job started again with the run id of a finished (closed) job starts a new run "
        "under it, once no node of the finished job is alive",
        "The first node of the new job deletes the closed run's rounds and stores (one "
        "transaction on v3) and writes a new incarnation; nodes of the finished job get "
        "RendezvousClosedError and never join the new one. While a node of the finished "
        "job is alive the new node waits up to one node TTL, then gets "
        "RendezvousClosedError. `false` (`etcd-rdzv join --no-restart-closed-run`): a "
        "closed run refuses every node until its marker expires (2 h) or `etcd-rdzv "
        "delete`. See "
        "[a job started again](handler.md#a-job-started-again).",
        cli="join",
    ),
    # -- the static handler -----------------------------------------------------------
    Option(
        "rank", "int", None, "static",
        "the static rendezvous: this node's rank, below `max_nodes` (the world is that many "
        "nodes, each with the rank it was given)",
        "When absent, the first of `$SLURM_NODEID`, `$JOB_COMPLETION_INDEX`, "
        "`$GROUP_RANK`, `$NODE_RANK` that is set; none of them is a `ValueError`. See "
        "[the static handler](handler.md#the-static-handler-etcd-rdzv-static).",
        expect="an integer in 0..max_nodes-1", cli="join", metavar="R", rule=True,
    ),
)  # fmt: skip

_BY_NAME = {o.name: o for o in OPTIONS}

#: Options torch's launcher or torch's own handlers put into ``rdzv_configs``: known,
#: so never warned about, though etcd_rdzv does not read them.
TORCH_OPTIONS = frozenset(
    {"timeout", "is_host", "store_type", "use_libuv", "cacert", "cert", "key"}
)


def option(name: str) -> Option:
    """The declaration of option ``name``."""
    return _BY_NAME[name]


def read_by(*readers: Reader) -> tuple[Option, ...]:
    """The options that ``readers`` read, in the table's order."""
    return tuple(o for o in OPTIONS if o.reader in readers)


def unknown_options(names: Iterable[str]) -> list[str]:
    """The names among ``names`` that no one reads, each with the closest known one."""
    known = sorted(_BY_NAME)
    found = []
    for name in sorted(names):
        if name in _BY_NAME or name in TORCH_OPTIONS:
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        found.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    return found


def flags() -> Mapping[str, str]:
    """Option name -> command-line flag, for every option that has one."""
    return {o.name: o.flag for o in OPTIONS if o.cli is not None}
