"""Who a node is in a job: the static handler's ``rank``, the native handler's rank
policies ``node_group`` and ``node_unit``, every node's ``host_id`` (options declared in
:mod:`etcd_rdzv.config._options`; re-exported by :mod:`etcd_rdzv.config.params`), and
the address it publishes to the others (:func:`node_address`)."""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import threading
from collections.abc import Mapping
from typing import Any

from ._options import ENV_HOST_ID, ENV_NODE_GROUP, STATIC_HANDLER_NAME, ParamsLike, option

__all__ = [
    "MAX_HOST_ID",
    "MAX_NODE_GROUP",
    "RANK_VARIABLES",
    "host_id",
    "host_id_error",
    "node_address",
    "node_group_error",
    "static_rank",
]

# The warnings keep the logger they always had: the one of etcd_rdzv.config.params.
log = logging.getLogger("etcd_rdzv.config.params")
_address_log = logging.getLogger(__name__)

#: Characters in a ``node_group``.
MAX_NODE_GROUP = 128


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


#: Characters in a ``host_id`` (a DNS name has at most 253).
MAX_HOST_ID = 253


def host_id_error(value: object) -> str | None:
    """What is wrong with ``value`` as a host identity; ``None`` if nothing."""
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_HOST_ID:
        return f"1 to {MAX_HOST_ID} characters"
    if not value.isascii() or not value.isprintable() or " " in value or "/" in value:
        return "printable ASCII, no spaces or slashes"
    return None


def _host_of(addr: str) -> str:
    """The host part of ``host``, ``host:port`` or ``[v6]:port``."""
    if addr.startswith("["):
        return addr[1:].split("]", 1)[0]
    if addr.count(":") == 1:
        return addr.split(":", 1)[0]
    return addr


def host_id(params: ParamsLike, environ: Mapping[str, str] | None = None) -> str:
    """This node's host identity: option ``host_id`` (or its environment variable),
    else the host of ``local_addr``, else this machine's host name. No network I/O."""
    env = os.environ if environ is None else environ
    value: Any = params.get("host_id")
    source = "Option 'host_id'"
    if value in (None, "") and env.get(ENV_HOST_ID):
        value, source = env[ENV_HOST_ID], f"Environment variable {ENV_HOST_ID}"
    if value in (None, ""):
        value, source = _host_of(params.local_addr or "") or socket.gethostname(), "The host"
        if host_id_error(value) is not None:
            value = socket.gethostname()
    problem = host_id_error(value)
    if problem is not None:
        raise ValueError(f"{source} must be {problem}, got {str(value)[:80]!r}.")
    return str(value)


def _policy_fields(
    params: ParamsLike, static: bool, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``node_group`` and ``node_unit``, validated; the defaults (with a warning when
    given as options) for the static handler, where every node brings its own rank."""
    env = os.environ if environ is None else environ
    unit_option = option("node_unit")
    unit: int = unit_option.get(params)
    if static:
        given = [
            name
            for name in ("node_group", "node_unit")
            if params.get(name) not in (None, "")
            and (name != "node_unit" or unit != unit_option.default)
        ]
        if given:
            _node_group(params, {})  # a bad value is still an error
            log.warning(
                "run %s: option(s) %s are ignored by the static handler (%s): each node's rank "
                "is given, and the world is max_nodes",
                params.run_id,
                ", ".join(repr(n) for n in given),
                STATIC_HANDLER_NAME,
            )
        return {"node_group": None, "node_unit": unit_option.default}
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
    """``rank`` and where it came from: the static handler's; none for the others (a
    ``rank`` given to them is only warned about)."""
    if not static:
        return {"rank": None, "rank_source": ""}
    rank, source = static_rank(params)
    return {"rank": rank, "rank_source": source}


_told: set[str] = set()  # explicit loopback addresses already mentioned (once each)
_told_lock = threading.Lock()


def node_address(local_addr: str | None, max_nodes: int, run_id: str = "") -> str:
    """The address this node publishes to the others (rank 0's is ``MASTER_ADDR``):
    ``local_addr``, or this host's fully qualified name.

    When it resolves only to loopback addresses and the job may span hosts
    (``max_nodes > 1``), peers on other hosts could not reach it: a WARNING says so and
    how to set it, when the address is the default; an address given explicitly (a
    single-host test job on ``127.0.0.1``) is mentioned once per process at INFO.
    """
    explicit = bool(local_addr)
    addr = local_addr or socket.getfqdn()
    if max_nodes <= 1 or not _loopback_only(addr):
        return addr
    if explicit:
        with _told_lock:
            if addr in _told:
                return addr
            _told.add(addr)
        _address_log.info(
            "run %s: this node publishes the loopback address %r, given as local_addr: "
            "fine on one host; nodes on other hosts could not reach it",
            run_id,
            addr,
        )
        return addr
    _address_log.warning(
        "run %s: this node's address %r (the default, this host's name) resolves to a "
        "loopback address: nodes on other hosts cannot reach it (rank 0's address is "
        "MASTER_ADDR). Set the address the others can reach: torchrun --local-addr, "
        "local_addr in RendezvousParameters, or etcd-rdzv join --local-addr.",
        run_id,
        addr,
    )
    return addr


def _loopback_only(addr: str) -> bool:
    """Whether ``addr`` (an IP address or a host name) resolves only to loopback
    addresses here. A name that does not resolve is not judged (``False``)."""
    text = addr.strip("[]")
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        pass
    try:
        found = {info[4][0] for info in socket.getaddrinfo(text, None)}
    except (OSError, UnicodeError):
        return False
    loopback = []
    for ip in found:
        try:
            loopback.append(ipaddress.ip_address(str(ip).split("%", 1)[0]).is_loopback)
        except ValueError:
            return False
    return bool(loopback) and all(loopback)
