"""``EtcdRendezvousBackend``: torch's ``RendezvousBackend`` contract over our KV layer.

The state is stored base64-encoded under ``<key_prefix>/<run>/state`` with a TTL
(default 2 h) that every write restarts, so a run that stops writing disappears.
The token is the key's revision (the v2 ``modifiedIndex``). Writes are
compare-and-set on that revision, or create-if-absent when no token is given.
"""

from __future__ import annotations

import base64
import binascii
import logging
from typing import Any

from . import _keys
from ._kv import KV, Record
from .client import connect
from .config.params import DEFAULT_KEY_PREFIX, DYNAMIC_HANDLER_NAME, Settings
from .errors import RendezvousStateError
from .store import EtcdStore

__all__ = ["DEFAULT_STATE_TTL", "EtcdRendezvousBackend", "Token"]

log = logging.getLogger(__name__)

DEFAULT_STATE_TTL = 7200  # seconds
#: What we hand out as a token: the revision of the state key.
Token = Any


class EtcdRendezvousBackend:
    """Holds the rendezvous state of one run in etcd.

    Args:
        client: the KV client from :func:`etcd_rdzv.create_client`.
        run_id: the run id; any non-empty string.
        key_prefix: the etcd directory of all runs.
        ttl: seconds the state lives after its last write; must be positive.
        name: what :attr:`name` reports (torch's handler uses it as its backend name).

    Raises:
        ValueError: an empty run id or a non-positive ``ttl``. No network I/O happens.
    """

    def __init__(
        self,
        client: KV,
        run_id: str,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        ttl: int = DEFAULT_STATE_TTL,
        name: str = DYNAMIC_HANDLER_NAME,
    ) -> None:
        if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl <= 0:
            raise ValueError(f"ttl must be a positive number of seconds, got {ttl!r}.")
        self._kv = client
        self._run_id = run_id
        self._key = _keys.state_key(key_prefix, run_id)
        self._ttl = ttl
        self._name = name

    @classmethod
    def from_settings(
        cls, settings: Settings, store_cls: type[EtcdStore] = EtcdStore
    ) -> tuple[EtcdRendezvousBackend, EtcdStore]:
        """A backend of this class for ``settings`` (already validated), and the run's
        store (of ``store_cls``) on the same client."""
        prefix = settings.client.key_prefix
        kv = connect(settings.client)
        backend = cls(kv, settings.run_id, key_prefix=prefix, name=settings.backend)
        store = store_cls(kv, _keys.store_dir(prefix, settings.run_id), ttl=settings.store_ttl)
        return backend, store

    @property
    def name(self) -> str:
        """The backend name."""
        return self._name

    @property
    def key(self) -> str:
        """The etcd key holding the state."""
        return self._key

    @property
    def ttl(self) -> int:
        """Seconds the state lives after its last write."""
        return self._ttl

    def get_state(self) -> tuple[bytes, Token] | None:
        """The current state and its token, or ``None`` when there is none.

        Raises:
            RendezvousConnectionError: etcd is unreachable.
            RendezvousStateError: the stored value is not valid base64.
        """
        record, _ = self._kv.get(self._key)
        if record is None:
            return None
        return self._decode(record), record.revision

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """Write ``state`` if the stored state still has ``token``.

        With ``token=None`` the write succeeds only if there is no state yet. A stale,
        foreign or malformed token never raises: the current state comes back with
        ``has_set=False``.

        Returns:
            ``(state, token, has_set)`` with the state now stored, or ``None`` if there
            is none (the write failed and nothing is stored).

        Raises:
            RendezvousConnectionError: etcd is unreachable.
            RendezvousStateError: the stored value is not valid base64, or etcd refused
                ``state`` as too large (the stored state is then unchanged).
        """
        if not isinstance(state, (bytes, bytearray)):
            raise TypeError(f"state must be bytes, got {type(state).__name__}.")
        value = base64.b64encode(bytes(state)).decode("ascii")

        revision = _as_revision(token)
        if token is not None and revision is None:
            log.debug("run %s: malformed token %r; returning current state", self._run_id, token)
            return self._current_unset()

        record: Record | None
        try:
            if revision is None:
                record = self._kv.create(self._key, value, self._ttl)
            else:
                record = self._kv.compare_and_set(self._key, value, revision, self._ttl)
        except ValueError as exc:  # the KV layer: etcd refused the request as too large
            raise RendezvousStateError(
                f"The rendezvous state of run {self._run_id!r} ({len(state)} bytes, "
                f"{len(value)} in base64) is too large for etcd; nothing was written: {exc}"
            ) from exc
        if record is None:
            return self._current_unset()
        return bytes(state), record.revision, True

    def _current_unset(self) -> tuple[bytes, Token, bool] | None:
        current = self.get_state()
        if current is None:
            return None
        return current[0], current[1], False

    def _decode(self, record: Record) -> bytes:
        try:
            return base64.b64decode(record.value.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError, ValueError) as exc:
            raise RendezvousStateError(
                f"The rendezvous state under {self._key!r} (revision {record.revision}) is "
                "not valid base64: it is corrupt or was written by something else."
            ) from exc


def _as_revision(token: Any) -> int | None:
    """The revision a token stands for, or ``None`` if it is not a usable one."""
    if token is None or isinstance(token, bool):
        return None
    if isinstance(token, int):
        return token if token > 0 else None
    if isinstance(token, (str, bytes)):
        try:
            value = int(token)
        except ValueError:
            return None
        return value if value > 0 else None
    return None
