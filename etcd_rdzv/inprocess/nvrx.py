"""NVIDIA's in-process restart (``nvidia-resiliency-ext``'s ``inprocess.Wrapper``)
with no single host: its stores on etcd.

NVRx's ``Wrapper`` coordinates its ranks through a store that, by default, rank 0
hosts (a ``TCPStore``), and its basic example builds the application's process group
on another TCPStore of rank 0: when rank 0's process or host dies, every other rank
fails with it. Here both live in etcd:

* :class:`EtcdWrapperStore`, the Wrapper's ``store_factory``: a
  :class:`~etcd_rdzv.torch.TorchEtcdStore` (a real ``torch.distributed.Store``, which
  NVRx wraps in torch's ``PrefixStore``) that is also NVRx's ``StoreMixin``, at
  ``<key_prefix>/<run>/store/nvrx/<job>/wrapper/``, on a client of its own;
* :func:`pg_store`, the store for the wrapped function's process group in the
  Wrapper's restart iteration, ``.../nvrx/<job>/pg<I>/``, on the same client.

NVRx builds the store twice per rank (``store_factory(**store_kwargs)``), in the rank
and in its monitor daemon, which it forks *before* the first build: the constructor
is where the client is made (no thread, no connection before it). NVRx never deletes
its keys, and its first barrier counts arrivals with ``add``: a second launch on the
same keys would overflow it, so each launch needs its own ``job`` (given, or from
the scheduler's variables, :func:`job_from_env`). Keys expire ``store_ttl`` seconds
after their last write, 7 days unless given: NVRx reads some keys long after it wrote
them (a rank's initial rank, written when a restart iteration starts, is read when a
host dies, maybe days later), which the package's default of 2 h would break.

NVRx is imported here, when this module is imported (never by ``import etcd_rdzv``);
it has no type hints, so what crosses to it is ``Any``.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from .. import _keys
from ..admission.health import ENV_RUN_ID
from ..client import connect
from ..config._options import ENV_ENDPOINT, option, read_by
from ..config.params import HANDLER_NAME, ClientConfig, RendezvousParameters
from ..store import DEFAULT_STORE_TIMEOUT
from ..torch import TorchEtcdStore

try:
    from nvidia_resiliency_ext.inprocess.store import StoreMixin
except ImportError as exc:
    raise ImportError(
        "etcd_rdzv.inprocess.nvrx needs NVIDIA's resiliency extension, which cannot be "
        f"imported ({exc}): pip install 'etcd-rdzv[nvrx]' (nvidia-resiliency-ext >= 0.4.1; "
        "its release 0.4.1 installs on Python 3.10 to 3.12 only)."
    ) from exc

__all__ = [
    "JOB_VARIABLES",
    "NVRX_STORE_TTL",
    "EtcdWrapperStore",
    "job_from_env",
    "pg_store",
]

log = logging.getLogger(__name__)

#: Where the job id comes from when ``job`` is not given, the first set pair wins:
#: the scheduler's job id, and how often the job was started again under it.
JOB_VARIABLES = (
    ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"),
    ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"),
)
#: torchrun's run id when none is given: the same for every launch, so no job id.
_TORCHRUN_DEFAULT_RUN_ID = "none"
_DIGITS = re.compile(r"[0-9]{1,9}\Z")
#: Seconds an NVRx key lives after its last write unless ``store_ttl`` is given: longer
#: than a restart iteration lasts (NVRx reads keys of the iteration's start at a fault).
NVRX_STORE_TTL = 7 * 24 * 3600
#: The options of the store besides ``endpoint``, ``run_id``, ``job`` and ``timeout``.
_OPTIONS = frozenset(o.name for o in read_by("client", "store"))


def job_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The job id the scheduler gives every rank of one launch alike:
    ``slurm-<SLURM_JOB_ID>.<SLURM_RESTART_COUNT>``, else
    ``torchelastic-<TORCHELASTIC_RUN_ID>.<TORCHELASTIC_RESTART_COUNT>`` (a restart
    count that is not set counts as 0); ``None`` when neither job id is set (torchrun's
    default run id ``none`` is not one). ``environ``: ``os.environ`` by default."""
    env = os.environ if environ is None else environ
    for name, restarts in JOB_VARIABLES:
        value = env.get(name, "").strip()
        if value and value != _TORCHRUN_DEFAULT_RUN_ID:
            scheduler = name.split("_", 1)[0].lower()
            return f"{scheduler}-{value}.{env.get(restarts, '').strip() or '0'}"
    return None


def _given(value: str | None, variable: str, name: str, what: str) -> str:
    if value is None:
        value = os.environ.get(variable, "").strip()
    if not isinstance(value, str) or not value.strip():
        raise ValueError(
            f"Option {name!r} of EtcdWrapperStore is missing: give {what} in the "
            f"Wrapper's store_kwargs ({name}=...) or set ${variable}."
        )
    return value


class EtcdWrapperStore(TorchEtcdStore, StoreMixin):  # type: ignore[misc]  # NVRx: untyped
    """NVRx's Wrapper store on etcd: pass the class as the ``Wrapper``'s
    ``store_factory`` and these arguments as its ``store_kwargs``.

    No rank hosts it; a rank's death is reported by its NVRx monitor daemon (its
    process killed) or after NVRx's ``heartbeat_timeout`` (its host gone). Timeouts
    raise ``torch.distributed.DistStoreError`` (our
    :class:`~etcd_rdzv.StoreTimeoutError`), which is what NVRx's waits catch.
    ``critical_ranks`` is empty: no rank waits for the others at the end.

    Args:
        endpoint: etcd endpoints, ``host[:port][,host[:port]...]``; default
            ``$ETCD_RDZV_ENDPOINT``.
        run_id: the run; default ``$ETCD_RDZV_RUN_ID`` (as ``etcd-rdzv join --export``
            prints it).
        job: this launch of the job, the same on every rank and new for each launch
            (NVRx never deletes its keys); default :func:`job_from_env`.
        timeout: the default timeout of blocking calls (300 s, as NVRx's TCPStore).
        **options: the client's options (``key_prefix``, ``api``, ``protocol``,
            ``read_timeout``, TLS files, ``username``/``password``, ...) and
            ``store_ttl`` (here 7 days unless given: :data:`NVRX_STORE_TTL`), as in
            docs/configuration.md.

    Raises:
        ValueError: a missing run id, endpoint or job id, or a bad option (named), before
            any network call.
        RendezvousConnectionError: etcd is unreachable or refused us.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        run_id: str | None = None,
        job: str | None = None,
        timeout: timedelta | float | None = DEFAULT_STORE_TIMEOUT,
        **options: Any,
    ) -> None:
        endpoint = _given(endpoint, ENV_ENDPOINT, "endpoint", "etcd's endpoints")
        run_id = _given(run_id, ENV_RUN_ID, "run_id", "the run id")
        if job is None:
            job = job_from_env()
        if not isinstance(job, str) or not job.strip():
            variables = ", ".join(f"${name}" for name, _ in JOB_VARIABLES)
            raise ValueError(
                f"Option 'job' of EtcdWrapperStore is missing: give each launch of the "
                f"job an id of its own in the Wrapper's store_kwargs (job=...), or run "
                f"it where {variables} is set. NVRx never deletes its keys, so a second "
                f"launch on the same keys would fail its first barrier."
            )
        unknown = sorted(set(options) - _OPTIONS)
        if unknown:
            raise ValueError(
                f"EtcdWrapperStore got unknown option(s) {', '.join(map(repr, unknown))}; "
                f"it takes endpoint, run_id, job, timeout and {', '.join(sorted(_OPTIONS))}."
            )
        params = RendezvousParameters(HANDLER_NAME, endpoint, run_id, 1, 1, **options)
        config = ClientConfig.from_params(params)
        ttl: int = option("store_ttl").get(params) if "store_ttl" in options else NVRX_STORE_TTL
        prefix = _keys.nvrx_dir(config.key_prefix, run_id, job)
        kv = connect(config)
        try:
            super().__init__(kv, prefix + "/wrapper", timeout=timeout, ttl=ttl)
        except BaseException:
            kv.close()
            raise
        self._job_dir = prefix
        self._job = job
        self._run_id = run_id
        # torch keeps only the C++ half of a Python store it is given (a process group
        # on it): the Python half, where every method lives, is kept alive here.
        self._pg: TorchEtcdStore | None = None
        log.debug("run %s: NVRx store of job %s at %s", run_id, job, self.prefix)

    @property
    def job(self) -> str:
        """The job id the keys are under."""
        return self._job

    def pg_store(self, iteration: int) -> TorchEtcdStore:
        """A store for the process group of the Wrapper's restart iteration
        ``iteration``, fresh for each iteration (torch names its groups' keys the
        same way in every group it builds after ``destroy_process_group``): the same
        client, timeout and TTL as this store. Kept referenced by this store until the
        next iteration's is made.

        Raises:
            ValueError: ``iteration`` is not a non-negative integer.
        """
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise ValueError(
                f"The restart iteration must be a non-negative integer, got {iteration!r}."
            )
        store = TorchEtcdStore(
            self._kv, f"{self._job_dir}/pg{iteration}", timeout=self._timeout_s, ttl=self._ttl or 0
        )
        self._pg = store
        return store

    def wait(self, keys: Sequence[str | bytes], timeout: timedelta | None = None) -> None:
        """Wait until every key in ``keys`` is set, watching those keys only.

        NVRx never uses the store's queues, which :meth:`EtcdStore.wait
        <etcd_rdzv.EtcdStore.wait>` covers with a watch of the store's whole
        directory. Here every rank's monitor thread waits once a second, and every
        rank's heartbeat is written into that directory once a second: a watch of the
        directory would wake each waiting rank at every heartbeat of every rank (N²
        watch requests a second at N ranks).

        Raises:
            StoreTimeoutError: (torch's ``DistStoreError``) naming the keys still missing.
        """
        self._await_all(list(keys), timeout, use_default=timeout is None)

    def termination_barrier(self, ranks: Iterable[Any], **kwargs: Any) -> None:
        """NVRx's termination barrier, with each rank an integer.

        NVRx 0.4.1's sibling monitor passes the initial ranks of the ranks it found
        dead (a killed host) as it read them from the store, as bytes: NVRx's barrier
        would record ``b'0'`` for rank 0, and every rank that reaches the barrier later
        (each rank, when it exits) would fail to read it back (``ValueError: invalid
        literal for int()``). Rank numbers are read here strictly instead.

        Raises:
            ValueError: a rank that is not a non-negative integer (or its digits).
        """
        StoreMixin.reentrant_barrier(
            self, ranks=[_rank(r) for r in ranks], group_name=self.TERMINATION_BARRIER, **kwargs
        )

    def clone(self) -> EtcdWrapperStore:
        """This store itself (see :meth:`etcd_rdzv.torch.TorchEtcdStore.clone`)."""
        return self

    def __repr__(self) -> str:
        return f"EtcdWrapperStore(prefix={self.prefix!r}, job={self._job!r})"


def _rank(value: Any) -> int:
    """A rank given as an integer, or as the ASCII digits NVRx stored it with."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    if isinstance(text, str) and _DIGITS.match(text):
        return int(text)
    raise ValueError(f"NVRx passed a rank that is not a non-negative integer: {value!r}.")


def pg_store(call_wrapper: Any) -> TorchEtcdStore:
    """The store for the wrapped function's process group in the current restart
    iteration: give the function a parameter annotated
    ``Optional[inprocess.CallWrapper]`` and pass it here, then
    ``torch.distributed.init_process_group(..., store=pg_store(call_wrapper))``.

    It replaces NVRx's example's ``TCPStore(MASTER_ADDR, MASTER_PORT + 2 + iteration)``,
    which rank 0 hosts.

    Raises:
        TypeError: the Wrapper's store is not an :class:`EtcdWrapperStore` (its
            ``store_factory`` must be that class), or no ``CallWrapper`` was given.
    """
    base = getattr(call_wrapper, "base_store", None)
    if not isinstance(base, EtcdWrapperStore):
        raise TypeError(
            "pg_store() needs the CallWrapper of a Wrapper built with "
            "store_factory=EtcdWrapperStore; got a CallWrapper whose store is "
            f"{type(base).__name__} (pass the parameter annotated "
            "Optional[inprocess.CallWrapper])."
        )
    return base.pg_store(call_wrapper.iteration)
