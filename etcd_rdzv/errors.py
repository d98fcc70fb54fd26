"""Exceptions raised by etcd_rdzv.

Every error this package raises on purpose is a :class:`RendezvousError` (or a
``ValueError`` for bad configuration, raised before any network call)::

    RendezvousError
    ├── RendezvousConnectionError   etcd unreachable, refused, timed out, auth failed
    ├── RendezvousStateError        the state under the run's key is corrupt or foreign
    ├── RendezvousTimeoutError      an operation did not finish within its timeout
    │   └── StoreTimeoutError       a store ``get``/``wait`` timed out (also a LookupError)
    ├── RendezvousClosedError       the rendezvous was closed
    └── RendezvousGracefulExitError a node was not admitted and leaves gracefully

The names match ``torch.distributed.elastic.rendezvous``. When the torch integration
is active (:mod:`etcd_rdzv.torch` imported, which :func:`etcd_rdzv.create_backend`
does when torch is installed), constructing one of these classes yields an instance
of a subclass that is *also* the matching torch exception, so torch's own handlers and
agents catch them by their types. All exceptions here pickle (torch moves errors
between processes).
"""

from __future__ import annotations

from typing import Any, cast

__all__ = [
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "StoreTimeoutError",
]

# Maps one of our classes to a subclass that also derives from torch's class of the
# same name. Filled in by etcd_rdzv.torch; empty when torch is not in use.
_torch_flavours: dict[type[BaseException], type[BaseException]] = {}


class RendezvousError(Exception):
    """Root of every error etcd_rdzv raises on purpose."""

    def __new__(cls, *args: Any, **kwargs: Any) -> RendezvousError:
        flavour = _torch_flavours.get(cls, cls)
        return cast("RendezvousError", super().__new__(flavour, *args))


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
