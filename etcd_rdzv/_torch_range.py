"""The torch releases this package supports, declared once (``pyproject.toml``'s
``torch`` extra, the README, ``docs/testing.md`` and ``tox.ini`` are checked against it
by a unit test), and the check that :mod:`etcd_rdzv.torch` makes before it touches torch.

The oldest is 2.6: it is the first release whose ``torchrun`` finds rendezvous
handlers through the ``torchrun.handlers`` entry points (pytorch#132633); on 2.5 and
older, ``torchrun --rdzv-backend=etcd-rdzv`` fails inside torch ("not registered"),
and ``RendezvousStoreInfo.build`` (2.4) takes no ``local_addr``. CI runs
``tests/torch`` on the two edges of the range (:data:`EDGES`: the oldest supported
release and the newest tested) besides the pinned one; ``.ci/run`` reads the versions
from here. How to move the newest when torch releases is in ``docs/testing.md``
("torch releases").

Imports nothing of torch: the version is passed in.
"""

from __future__ import annotations

import re

__all__ = [
    "EDGES",
    "NEWEST_TESTED",
    "OLDEST",
    "OLDEST_TESTED",
    "check_torch_version",
    "release_of",
]

#: The oldest supported torch release (major, minor).
OLDEST = (2, 6)
#: The release of :data:`OLDEST` that ``tests/torch`` runs on in CI.
OLDEST_TESTED = "2.6.0"
#: The newest torch release ``tests/torch`` runs on in CI.
NEWEST_TESTED = "2.15.0"
#: The releases CI runs ``tests/torch`` on besides the pinned one (``constraints.txt``).
EDGES = (OLDEST_TESTED, NEWEST_TESTED)

_RELEASE = re.compile(r"(\d+)\.(\d+)")


def release_of(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a torch version string (``2.6.0``, ``2.13.0+cpu``,
    ``2.16.0a0+git1234``); ``None`` if it does not start with two numbers."""
    found = _RELEASE.match(version.strip())
    return None if found is None else (int(found.group(1)), int(found.group(2)))


def check_torch_version(version: str) -> None:
    """Raise ImportError, in one sentence naming the installed and the supported
    versions, when ``version`` (``torch.__version__``) is older than :data:`OLDEST`
    or unreadable.
    """
    release = release_of(version)
    if release is not None and release >= OLDEST:
        return
    oldest = ".".join(map(str, OLDEST))
    raise ImportError(
        f"etcd_rdzv's torch integration needs torch >= {oldest} (tested up to "
        f"{NEWEST_TESTED}), but torch {version!r} is installed: install a supported torch "
        f"(pip install 'etcd-rdzv[torch]'), or use etcd_rdzv without torch."
    )
