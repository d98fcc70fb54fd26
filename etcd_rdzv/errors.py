"""Exceptions raised by etcd_rdzv.

Every error this package raises on purpose is a :class:`RendezvousError` (or a
``ValueError`` for bad configuration, raised before any network call)::

    RendezvousError
    ├── RendezvousConnectionError   etcd unreachable, refused, timed out, auth failed
    ├── RendezvousStateError        the state under the run's key is corrupt or foreign
    ├── RendezvousTimeoutError      an operation did not finish within its timeout
    │   └── StoreTimeoutError       a store ``get``/``wait`` timed out (also a LookupError)
    ├── StoreQueueEmptyError        a non-blocking ``queue_pop`` found the queue empty
    ├── RendezvousClosedError       the rendezvous was closed
    └── RendezvousGracefulExitError a node was not admitted and leaves gracefully

**torch's types.** Each class stands for torch's class of the same name in
``torch.distributed.elastic.rendezvous``; ``StoreTimeoutError`` also for
``torch.distributed.DistStoreError`` and ``StoreQueueEmptyError`` only for
``torch.distributed.QueueEmptyError`` (what c10d's stores raise). Constructing one of
these classes (or a subclass) in a process where those torch classes are loaded
yields an instance of a subclass that is *also* the torch classes, so torch's own
handlers and agents catch it by their types, however the raising object was built
(a factory, a constructor called by hand) and whatever was imported first. Code that
catches by a torch type has imported it before the code it guards runs (normally at
the top of its module, as torch's does), so it gets the torch flavour; ``except
etcd_rdzv.RendezvousStateError`` works either way.

The torch classes are looked up in ``sys.modules`` when an error is built: this module
imports neither torch nor :mod:`etcd_rdzv.torch`, so building an error never imports
anything, and a program that does not import torch never loads it. One flavour class
is made per (class, torch classes) and reused, also across threads. Flavour classes
are named ``Torch<Name>`` and are not importable; they pickle as the class they
flavour, so the receiving process builds its own flavour (torch's type if torch is
loaded there). All exceptions here pickle (torch moves errors between processes).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, cast

__all__ = [  # the exception classes only (LOGGED_AND_RAISED is a log mark)
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "StoreQueueEmptyError",
    "StoreTimeoutError",
]

log = logging.getLogger(__name__)

#: The attribute set (true) on a log record whose message the package raises right
#: after: a front end that reports the exception itself (the CLI) may drop the record.
LOGGED_AND_RAISED = "etcd_rdzv_raised"


class RendezvousError(Exception):
    """Root of every error etcd_rdzv raises on purpose."""

    def __new__(cls, *args: Any, **kwargs: Any) -> RendezvousError:
        return cast("RendezvousError", super().__new__(_flavour_of(cls), *args))

    def __reduce__(self) -> tuple[Any, ...]:
        # As the class it was raised as, not its torch flavour (which is not importable):
        # unpickling constructs that class, so the receiver picks its own flavour.
        plain = vars(type(self)).get("_etcd_rdzv_flavour_of", type(self))
        return (plain, self.args, self.__dict__ or None)


class RendezvousConnectionError(RendezvousError):
    """etcd could not be reached, refused the request, or did not answer in time."""


class RendezvousStateError(RendezvousError):
    """The rendezvous state stored in etcd is corrupt or not ours."""


class RendezvousTimeoutError(RendezvousError):
    """An operation did not complete within its timeout."""


class RendezvousClosedError(RendezvousError):
    """The rendezvous is closed."""


class RendezvousGracefulExitError(RendezvousError):
    """A node was not admitted and exits gracefully; not a failure."""


class StoreTimeoutError(RendezvousTimeoutError, LookupError):
    """A store ``get``/``wait``/``multi_get`` did not see its keys within the timeout.

    Also a ``LookupError`` because torch's store contract documents that type for
    missing keys after a timeout.
    """


class StoreQueueEmptyError(RendezvousError, LookupError):
    """A non-blocking ``queue_pop`` found the queue empty (torch: ``QueueEmptyError``)."""


# -- torch flavours ---------------------------------------------------------------------

_RDZV_API = "torch.distributed.elastic.rendezvous.api"
_C10D = "torch.distributed"

# The torch classes each of ours stands for, as (module, attribute). Looked up in
# sys.modules only: a module nobody imported holds no class anybody could catch by.
_TORCH_TWINS: dict[type[RendezvousError], tuple[tuple[str, str], ...]] = {
    RendezvousError: ((_RDZV_API, "RendezvousError"),),
    RendezvousConnectionError: ((_RDZV_API, "RendezvousConnectionError"),),
    RendezvousStateError: ((_RDZV_API, "RendezvousStateError"),),
    RendezvousTimeoutError: ((_RDZV_API, "RendezvousTimeoutError"),),
    RendezvousClosedError: ((_RDZV_API, "RendezvousClosedError"),),
    RendezvousGracefulExitError: ((_RDZV_API, "RendezvousGracefulExitError"),),
    StoreTimeoutError: ((_RDZV_API, "RendezvousTimeoutError"), (_C10D, "DistStoreError")),
    StoreQueueEmptyError: ((_C10D, "QueueEmptyError"),),
}

# (our class, torch classes) -> the flavour. Filled with setdefault, which is atomic: two
# threads racing may both build a class, but both use the one stored first, so each key
# has one class (type(a) is type(b) for two errors of one kind; pickle round trips).
# No lock: none to deadlock on in a forked child, or if building a class raised an error.
_flavours: dict[tuple[type, tuple[type, ...]], type] = {}


def _loaded_twins(cls: type) -> tuple[type, ...]:
    """The torch classes ``cls`` stands for that are loaded and not yet its bases."""
    # The nearest class in the MRO with an entry: a subclass of ours (or a flavour,
    # built again by pickle or copy) stands for what its parent stands for.
    names = next((_TORCH_TWINS[k] for k in cls.__mro__ if k in _TORCH_TWINS), ())
    found: list[type] = []
    for module_name, attribute in names:
        module = sys.modules.get(module_name)
        # getattr: a module still being imported may not define the class yet.
        twin = getattr(module, attribute, None) if module is not None else None
        if isinstance(twin, type) and issubclass(twin, BaseException) and not issubclass(cls, twin):
            found.append(twin)
    return tuple(found)


def _flavour_of(cls: type) -> type:
    """``cls``, or its torch flavour when torch's matching classes are loaded."""
    twins = _loaded_twins(cls)
    if not twins:
        return cls
    key = (cls, twins)
    flavour = _flavours.get(key)
    if flavour is None:
        flavour = _flavours.setdefault(key, _make_flavour(cls, twins))
    return flavour


def _make_flavour(cls: type, twins: tuple[type, ...]) -> type:
    name = f"Torch{cls.__name__}"
    namespace = {
        "__module__": cls.__module__,
        "__qualname__": f"Torch{cls.__qualname__}",
        "__doc__": f"{cls.__name__}, also torch's "
        + ", ".join(f"{t.__module__}.{t.__qualname__}" for t in twins)
        + ".",
        "_etcd_rdzv_flavour_of": cls,
    }
    try:
        return type(name, (cls, *twins), namespace)
    except TypeError as exc:
        # A future torch class that cannot be combined with ours (a layout conflict):
        # raise our plain class rather than fail while building an error.
        log.warning("%s cannot also be torch's %s: %s", cls.__name__, twins, exc)
        return cls
