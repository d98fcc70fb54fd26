"""What etcd's JSON gateway puts in each field this client reads.

:func:`checked` is run on every answer and every stream message before anything reads
it (from :meth:`~._wire.GatewayKV._decode` and :class:`~._wire.Messages`), so the code
that reads fields later (``int(kv.get("mod_revision") or 0)``, ``data.get("kvs") or
[]``) meets only what etcd sends. Fields it does not know are not looked at. The
nesting it walks is bounded before (:func:`~.._json.loads`).
"""

from __future__ import annotations

import re
from typing import Any

from .._http import BadResponse

__all__ = ["checked"]

# What each field this client reads must hold; other fields are not looked at.
_INT, _BOOL, _TEXT, _BASE64, _OBJECT, _OBJECTS, _BASE64S, _ERROR = range(8)
_KINDS = {
    **dict.fromkeys(
        (
            "revision",
            "mod_revision",
            "create_revision",
            "version",
            "lease",
            "count",
            "ID",
            "TTL",
            "grantedTTL",
            "compact_revision",
            "watch_id",
            "raft_term",
            "member_id",
            "cluster_id",
            "deleted",
            "code",
            "grpc_code",
        ),
        _INT,
    ),
    **dict.fromkeys(("succeeded", "created", "canceled", "more", "fragment"), _BOOL),
    **dict.fromkeys(("token", "type", "message", "cancel_reason"), _TEXT),
    **dict.fromkeys(("key", "value"), _BASE64),
    **dict.fromkeys(
        (
            "header",
            "kv",
            "prev_kv",
            "result",
            "response_put",
            "response_range",
            "response_delete_range",
            "response_txn",
        ),
        _OBJECT,
    ),
    **dict.fromkeys(("kvs", "events", "responses", "prev_kvs", "leases"), _OBJECTS),
    "keys": _BASE64S,
    "error": _ERROR,  # text in unary answers of etcd < 3.6, an object in streams
}
_INT_TEXT = re.compile(r"-?[0-9]{1,20}")
_BASE64_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _base64(text: str) -> bool:
    """Whether ``text`` is padded base64 (``bytes.translate`` does the scan: a regular
    expression took twice as long on every key and value of every answer)."""
    if len(text) % 4 or not text.isascii():
        return False
    raw = text.encode("ascii")
    data = raw.rstrip(b"=")
    return len(raw) - len(data) <= 2 and not data.translate(None, _BASE64_ALPHABET)


def checked(obj: dict[str, Any], where: str) -> dict[str, Any]:
    """``obj``, an answer (or one message of a stream) from ``where``, once every field
    this client reads was found to hold what etcd puts there: 64-bit integers as
    decimal text (or numbers), keys and values as base64, objects and lists of objects
    where etcd nests them.

    Raises:
        BadResponse: a field holds something else.
    """
    # On every answer: the common cases are tested first, with str methods rather
    # than regular expressions where they suffice.
    for name, value in obj.items():
        kind = _KINDS.get(name)
        if kind is None:
            continue
        kind_of = type(value)
        if kind == _INT:
            if kind_of is str:
                if value.isascii() and value.isdigit() and len(value) <= 20:
                    continue
                if _INT_TEXT.fullmatch(value):
                    continue
            elif kind_of is int:
                continue
        elif kind == _BASE64:
            if kind_of is str and _base64(value):
                continue
        elif kind == _OBJECT or (kind == _ERROR and kind_of is dict):
            if kind_of is dict:
                checked(value, where)
                continue
        elif kind == _OBJECTS:
            if kind_of is list:
                for item in value:
                    if type(item) is not dict:
                        break
                    checked(item, where)
                else:
                    continue
        elif kind == _BOOL:
            if kind_of is bool:
                continue
        elif kind in (_TEXT, _ERROR):
            if kind_of is str:
                continue
        elif kind_of is list and all(  # _BASE64S
            type(item) is str and _base64(item) for item in value
        ):
            continue
        raise BadResponse(
            f"{where} answered what is not etcd's answer: {name!r} holds "
            f"{kind_of.__name__} {str(value)[:80]!r}"
        )
    return obj
