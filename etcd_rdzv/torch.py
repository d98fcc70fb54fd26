"""PyTorch integration; the only module of etcd_rdzv that imports torch.

Importing it (``create_backend`` does when torch is installed; ``create_handler`` only
with ``use_torch=True``):

* provides :class:`TorchEtcdStore` (a real ``torch.distributed.Store``: it works with
  ``PrefixStore`` and ``init_process_group``) and :class:`TorchEtcdRendezvousBackend`;
* provides :func:`create_dynamic_handler`, behind the ``torchrun.handlers`` entry point
  ``etcd-rdzv-dynamic``: torch's own ``DynamicRendezvousHandler`` over our backend and
  store;
* provides :func:`create_native_handler` and :func:`create_static_handler`, behind the
  entry points ``etcd-rdzv`` and ``etcd-rdzv-static``: our native handler as torch's
  ``RendezvousHandler`` (:class:`TorchEtcdRendezvousHandler`), which records torch's
  rendezvous events as torch's own handler does;
* provides :class:`GracefulExit`: what the handlers built by the ``torchrun`` entry points
  raise instead of ``RendezvousGracefulExitError``, so that a spare's torchrun exits 0
  when the job ends;
* provides :func:`init_group` and :func:`destroy_groups`, the process-group calls of
  :mod:`etcd_rdzv.inprocess` (a default group on a round's store; every group torn down).

Our exceptions are torch's types without this module: :mod:`etcd_rdzv.errors` gives
every error built in a process where torch's classes are loaded their torch flavour,
whoever built the raising object and whatever was imported first. This module does not
take part in that (importing it merely loads torch's classes).
"""

# ruff: noqa: E402  (torch's version is checked before anything of torch.distributed)
from __future__ import annotations

import itertools
import logging
import os
import sys
from datetime import timedelta
from types import FrameType
from typing import Any

import torch

from ._torch_range import check_torch_version

# Before anything of torch.distributed: an unsupported torch is one clear sentence,
# never an AttributeError or a KeyError from inside torch.
check_torch_version(torch.__version__)

from torch.distributed.distributed_c10d import Store as TorchStore
from torch.distributed.elastic.events import construct_and_record_rdzv_event
from torch.distributed.elastic.events.api import NodeState
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (
    RendezvousGracefulExitError as TorchGracefulExitError,
)
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    create_handler,
)

from .backend import EtcdRendezvousBackend
from .config.params import DYNAMIC_HANDLER_NAME, ParamsLike, Settings
from .errors import RendezvousGracefulExitError
from .rendezvous import EtcdRendezvousHandler
from .rendezvous.listener import HandlerEvent, Listener
from .store import EtcdStore

__all__ = [
    "DYNAMIC_HANDLER_NAME",
    "GracefulExit",
    "TorchEtcdRendezvousBackend",
    "TorchEtcdRendezvousHandler",
    "TorchEtcdStore",
    "build_native_handler",
    "create_dynamic_handler",
    "create_native_handler",
    "create_static_handler",
    "destroy_groups",
    "exit_gracefully",
    "init_group",
    "launcher_max_restarts",
    "warn_without_restarts",
]

log = logging.getLogger(__name__)

_LAUNCHER = "torch.distributed.launcher.api"  # the module of torch's launch_agent()


def launcher_max_restarts() -> int | None:
    """The ``max_restarts`` of torch's launcher that is building a handler now:
    torchrun's ``--max-restarts`` (or ``$PET_MAX_RESTARTS``, as torchrun reads it), or
    the ``LaunchConfig`` given to ``elastic_launch``.

    Read from the ``config`` of the ``launch_agent()`` call on this thread's stack
    (torch's launcher builds the handler inside it, torch 2.6 to 2.15 at least), so it
    is the value torch's agent will use, however it was given. ``None`` when no such
    call is on the stack (a handler built by hand, a launcher of one's own) or its
    config holds no integer ``max_restarts``.
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "launch_agent" and frame.f_globals.get("__name__") == _LAUNCHER:
            value = getattr(frame.f_locals.get("config"), "max_restarts", None)
            return value if type(value) is int else None
        frame = frame.f_back
    return None


def warn_without_restarts(run_id: str, max_nodes: int) -> int | None:
    """Warn, once per handler built, when torch's launcher will not restart failed
    workers (``max_restarts`` 0, torchrun's default) in a job that may span nodes:
    the first worker failure then ends the job instead of re-forming the group.
    Returns the launcher's ``max_restarts`` (``None``: not under torch's launcher)."""
    restarts = launcher_max_restarts()
    if restarts == 0 and max_nodes > 1:
        log.warning(
            "run %s: torchrun's --max-restarts is 0 (its default): when a worker fails "
            "(a host killed, a worker crashed), this agent ends the job instead of "
            "re-forming the group with the nodes left, and closes the run for every "
            "node. For elastic recovery set --max-restarts=N, N the number of failures "
            "the job may survive (e.g. 3; PET_MAX_RESTARTS where Kubeflow sets it).",
            run_id,
        )
    return restarts


class TorchEtcdStore(EtcdStore, TorchStore):
    """:class:`~etcd_rdzv.EtcdStore` that is also a ``torch.distributed.Store``."""

    # torch sets the timeout on the C++ side directly (PrefixStore.set_timeout and
    # torch.distributed's store_timeout() forward to it past Python), so the C++ value
    # is the one source of truth. ``None`` (wait forever) is stored as a century.
    # A C++ timeout of 0 keeps our meaning: do not wait.
    _FOREVER = timedelta(days=365 * 100)

    @property
    def _timeout_s(self) -> float | None:
        cpp: timedelta = TorchStore.__dict__["timeout"].__get__(self)
        return None if cpp >= self._FOREVER else cpp.total_seconds()

    @_timeout_s.setter
    def _timeout_s(self, seconds: float | None) -> None:
        cpp = self._FOREVER if seconds is None else timedelta(seconds=seconds)
        TorchStore.set_timeout(self, cpp)

    # torch's C++ side calls these names on Python stores (PrefixStore, process groups).
    def getNumKeys(self) -> int:
        return self.num_keys()

    def deleteKey(self, key: str) -> bool:
        return self.delete_key(key)

    def has_extended_api(self) -> bool:
        """We implement ``append``, ``multi_get`` and ``multi_set`` natively."""
        return True

    def clone(self) -> TorchEtcdStore:
        """This store itself: it is thread-safe (one etcd client shared by every
        thread, no per-call state on the object), which is what torch asks of a clone.

        A new Python object would not do: torch's C++ side (``PrefixStore.clone``,
        process groups) keeps only the C++ half of what a Python ``clone`` returns, so
        the Python half, where every method lives, would be collected as soon as the
        call returned, and the next call through the clone fail ("Not implemented").
        The clone therefore shares the timeout with this store.
        """
        return self


class TorchEtcdRendezvousBackend(EtcdRendezvousBackend, RendezvousBackend):
    """:class:`~etcd_rdzv.EtcdRendezvousBackend` that is also torch's ``RendezvousBackend``."""


class GracefulExit(SystemExit):
    """A node leaves the rendezvous gracefully and its process should exit with status 0.

    Raised by ``next_rendezvous()`` of a handler passed to :func:`exit_gracefully` (the
    ``torchrun`` entry points pass theirs) where the handler would raise
    ``RendezvousGracefulExitError`` (the error is its ``__cause__``): the run was
    closed while this node (a spare, or a node waiting for the next round) waited, so
    the job ended without it. A handler built by hand keeps raising the error.

    Why not the error: torch's agent catches ``RendezvousGracefulExitError`` and then
    returns ``None`` from ``agent.run()``, on which torch's launcher (``launch_agent``,
    torch 2.13 to 2.15 at least) calls ``result.is_failed()``: the node's torchrun
    exits 1 with an ``AttributeError`` traceback, and Kubernetes restarts the pod or
    fails the job. A ``SystemExit`` is no ``Exception``: torch's agent and launcher do
    not catch it (their ``finally`` blocks still stop the agent and call the handler's
    ``shutdown()``), and torchrun's ``main`` (``@record``) turns a ``SystemExit`` with
    code 0 into a normal return, so torchrun exits 0 without a traceback.

    ``code`` is 0; ``str()`` is the error's message.
    """

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.code = 0  # not the message: a string code would exit 1 and print it


def create_dynamic_handler(params: ParamsLike) -> RendezvousHandler:
    """torch's ``DynamicRendezvousHandler`` over our backend and store.

    Reads torch's handler options (``join_timeout``, ``last_call_timeout``,
    ``close_timeout``, ``heartbeat_timeout``, ``keep_alive_interval``,
    ``keep_alive_max_attempt``) besides ours.
    """
    backend, store = TorchEtcdRendezvousBackend.from_settings(
        Settings.from_params(params), TorchEtcdStore
    )
    handler: RendezvousHandler = create_handler(store, backend, params)  # type: ignore[arg-type]
    return handler


def exit_gracefully(handler: RendezvousHandler) -> RendezvousHandler:
    """``handler`` (made by :func:`create_dynamic_handler` or one of ours), its
    ``next_rendezvous()`` raising :class:`GracefulExit` where it would raise
    ``RendezvousGracefulExitError``, so that torchrun exits 0 (the ``torchrun`` entry
    points call it). Returns ``handler`` itself.

    Raises:
        TypeError: a handler of another type.
    """
    if isinstance(handler, TorchEtcdRendezvousHandler):
        handler.exit_gracefully = True
    elif type(handler) is DynamicRendezvousHandler:
        # torch's create_handler builds this class, so the instance becomes one of a
        # subclass that adds one method and no state (the same layout).
        handler.__class__ = _GracefulDynamicHandler
    elif not isinstance(handler, _GracefulDynamicHandler):
        raise TypeError(f"exit_gracefully() takes one of our handlers, not {type(handler)}")
    return handler


class _GracefulDynamicHandler(DynamicRendezvousHandler):
    """torch's ``DynamicRendezvousHandler`` whose graceful exit is :class:`GracefulExit`
    (torch's handler raises ``RendezvousGracefulExitError`` for a spare, a node in its
    redundancy list, when the run is closed)."""

    def next_rendezvous(self) -> RendezvousInfo:
        try:
            return super().next_rendezvous()
        except TorchGracefulExitError as exc:
            raise _graceful_exit(self.get_run_id(), str(self._this_node), exc) from exc


def _graceful_exit(run_id: str, node: str, exc: BaseException) -> GracefulExit:
    log.info("run %s: node %s leaves, its process exits with status 0: %s", run_id, node, exc)
    return GracefulExit(str(exc))


class TorchEtcdRendezvousHandler(EtcdRendezvousHandler, RendezvousHandler):
    """The native handler as torch's ``RendezvousHandler`` (torchrun name ``etcd-rdzv``).

    It records torch's rendezvous events (``torch.distributed.elastic.events``,
    destination ``dynamic_rendezvous``) where torch's ``DynamicRendezvousHandler``
    does: joining a round (``RUNNING``), the round complete (``SUCCEEDED``, with the
    rank), a failed join (``FAILED``; ``SUCCEEDED`` for a graceful exit), closing the
    run and leaving it (``SUCCEEDED``), and ``is_closed``/``set_closed``/``shutdown``
    failing (``FAILED``). An event is named ``TorchEtcdRendezvousHandler.<method>``
    after the public method it belongs to; ``local_id`` numbers the handlers of a
    process in creation order, as torch numbers its nodes.
    """

    _local_ids = itertools.count()

    #: Raise :class:`GracefulExit` (a ``SystemExit`` with code 0) instead of
    #: ``RendezvousGracefulExitError`` from :meth:`next_rendezvous`: torchrun then exits
    #: 0. The ``torchrun`` entry points set it; a handler built by hand raises the error.
    exit_gracefully = False

    #: The ``max_restarts`` of torch's launcher that built this handler (``None``: not
    #: known); the ``torchrun`` entry points set it (:func:`warn_without_restarts`).
    launcher_restarts: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: This handler's number among the handlers of its process (torch's local_id).
        self.local_id = next(TorchEtcdRendezvousHandler._local_ids)
        self.add_listener(_TorchEvents(self.local_id, self.address))

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round; torch's ``RendezvousInfo`` with bootstrap store info.

        Rank 0 picks a free port on its address and publishes ``MASTER_ADDR`` and
        ``MASTER_PORT`` in the round's store; workers bootstrap from those.

        Raises:
            GracefulExit: with :attr:`exit_gracefully`, where the plain handler raises
                ``RendezvousGracefulExitError``. Other errors as the plain handler.
        """
        try:
            result = EtcdRendezvousHandler.next_rendezvous(self)
        except (RendezvousGracefulExitError, TorchGracefulExitError) as exc:
            if not self.exit_gracefully:
                raise
            raise _graceful_exit(self.get_run_id(), self.node_id, exc) from exc
        bootstrap = RendezvousStoreInfo.build(result.rank, result.store, local_addr=self.address)
        return RendezvousInfo(result.store, result.rank, result.world_size, bootstrap)

    def shutdown(self) -> bool:
        """Leave, as :meth:`EtcdRendezvousHandler.shutdown`; but never close the run
        while the agent dies of a signal.

        torch's launcher does not call ``shutdown()`` when its agent dies of a signal
        (``launch_agent``: closing the run there "prevents any additional scaling
        events"). torch 2.6 and 2.7 call it anyway, from the agent's own ``_shutdown()``,
        while the agent handles the ``SignalException`` that torch's signal handler
        raised (added by pytorch#117066, removed in 2.8 by pytorch#152525): with
        :attr:`close_on_shutdown` a SIGTERMed agent would close the run for every
        other node. Called while that exception is handled, this handler leaves
        (deletes its key, so the others regroup at once) without closing the run.
        """
        if self.close_on_shutdown and isinstance(sys.exc_info()[1], SignalException):
            log.info(
                "run %s: node %s leaves without closing the run: its agent dies of a signal",
                self.get_run_id(),
                self.node_id,
            )
            self.close_on_shutdown = False  # the process ends; later calls leave alike
        elif self.close_on_shutdown and isinstance(sys.exc_info()[1], ChildFailedError):
            self._warn_giving_up()
        return EtcdRendezvousHandler.shutdown(self)

    def _warn_giving_up(self) -> None:
        """torch's launcher shuts down while its agent's workers failed for good: the
        run is closed for members that are alive and could have gone on."""
        peers = self.live_peers()
        if not peers:
            return
        restarts = self.launcher_restarts
        if restarts is None:
            why = "its launcher does not restart them"
        elif restarts == 0:
            why = "torchrun's --max-restarts is 0"
        else:
            why = f"the {restarts} restart(s) of torchrun's --max-restarts were used up"
        log.warning(
            "run %s: node %s closes the run for every node: its workers failed and %s, "
            "so the job ends, and the %d other member(s) of round %d, still alive, stop "
            "too. For the group to re-form without a failed node, set torchrun "
            "--max-restarts=N (N > 0: the failures the job may survive).",
            self.get_run_id(),
            self.node_id,
            why,
            peers,
            self.round,
        )


class _TorchEvents(Listener):
    """Records each event of one handler as torch's rendezvous event. Holds neither
    the handler nor anything of it."""

    def __init__(self, local_id: int, hostname: str) -> None:
        self._local_id, self._hostname = local_id, hostname

    def on_event(self, event: HandlerEvent) -> None:
        try:
            construct_and_record_rdzv_event(
                name=f"{TorchEtcdRendezvousHandler.__name__}.{event.method}",
                run_id=event.run_id,
                message=event.message,
                node_state=NodeState[event.state],
                hostname=self._hostname,
                pid=os.getpid(),
                local_id=self._local_id,
                rank=event.rank,
            )
        except Exception:  # an event recorder that fails must not fail the rendezvous
            log.warning(
                "run %s: node %s could not record a torch rendezvous event (%s: %s)",
                event.run_id,
                event.node_id,
                event.state,
                event.message,
                exc_info=True,
            )


def build_native_handler(settings: Settings) -> TorchEtcdRendezvousHandler:
    """The native handler of ``settings`` (validated) as torch's ``RendezvousHandler``."""
    handler = TorchEtcdRendezvousHandler.from_settings(settings, TorchEtcdStore)
    assert isinstance(handler, TorchEtcdRendezvousHandler)
    return handler


def create_native_handler(params: ParamsLike) -> TorchEtcdRendezvousHandler:
    """Our native handler as torch's ``RendezvousHandler`` (torchrun name ``etcd-rdzv``):
    ``next_rendezvous()`` returns torch's ``RendezvousInfo`` and the round's store is a
    ``torch.distributed.Store``.

    Raises:
        ValueError: a bad option, before any network call.
        RendezvousConnectionError: etcd is unreachable or refused us.
    """
    return build_native_handler(Settings.from_params(params))


def create_static_handler(params: ParamsLike) -> TorchEtcdRendezvousHandler:
    """The static handler as torch's ``RendezvousHandler`` (torchrun name
    ``etcd-rdzv-static``): a fixed world of ``max_nodes`` nodes, each with the rank it
    was given (:func:`etcd_rdzv.config.params.static_rank`).

    Raises:
        ValueError: a bad option or a missing or bad rank, before any network call.
        RendezvousConnectionError: etcd is unreachable or refused us.
    """
    return build_native_handler(Settings.from_params(params, static=True))


# -- process groups of etcd_rdzv.inprocess ---------------------------------------------


def init_group(
    store: TorchEtcdStore, rank: int, world_size: int, backend: str, timeout: float, **kwargs: Any
) -> None:
    """Build torch's default process group on ``store`` (a :class:`TorchEtcdStore`),
    with collectives bounded by ``timeout`` seconds; ``kwargs`` go to
    ``init_process_group`` as given.

    Raises:
        RuntimeError: torch's, e.g. a default group already exists.
    """
    import torch.distributed as dist

    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
        **kwargs,
    )


def destroy_groups() -> None:
    """Tear every process group of this process down (NCCL's communicators aborted
    first, as a blocked NCCL collective returns only then); nothing when none exists.
    Errors of torch's teardown are logged, never raised: the caller goes on to a new
    group either way."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    world = dist.distributed_c10d._world
    for group in list(world.pg_map):
        try:
            if dist.get_backend(group) == "nccl":
                group.abort()
        except Exception as exc:  # torch's teardown of a broken group
            log.info("aborting a process group failed: %s", exc)
    try:
        dist.destroy_process_group()
    except Exception as exc:
        log.info("destroying the process groups failed: %s", exc)
