"""JSON from etcd, decoded only once its nesting is known to be shallow.

Python's decoder recurses once per ``[`` or ``{``: an answer nested a few thousand
deep raises ``RecursionError`` (or worse, in a thread with a small stack) before any
check of ours could see it. :func:`loads` counts the nesting first, outside strings,
at the speed of ``bytes`` methods: an answer with fewer brackets than the cap (nearly
all of them) costs two counts; a larger one, a ``bytes.translate`` that keeps quotes
and brackets, a few ``replace`` passes that drop escapes and strings, then as many
passes removing innermost pairs as the answer is deep (a few for etcd's answers; a
flood of brackets that never close, one).
"""

from __future__ import annotations

import json
from typing import Any

from ._http import BadResponse

__all__ = ["MAX_DEPTH", "loads"]

#: The deepest nesting of ``[`` and ``{`` an answer may have. etcd's v3 answers nest
#: about six deep; a v2 listing two more per directory level of its keys.
MAX_DEPTH = 128

_SYNTAX = b'"[]{}'
_NOT_SYNTAX = bytes(b for b in range(256) if b not in _SYNTAX)
_PAIRS = bytes.maketrans(b"[]{}", b"()()")


def too_deep(data: bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether ``data`` nests ``[`` and ``{`` (outside strings) deeper than ``limit``,
    or leaves some unclosed past that depth (then it is no JSON a decoder would take)."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    if b"\\" in data:  # escapes: an escaped backslash, then an escaped quote, go first
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    # Quotes and brackets only. Removing two adjacent quotes keeps every bracket on
    # its side of a string's edge: an empty string goes, or two strings become one.
    marks = data.translate(None, _NOT_SYNTAX).replace(b'""', b"")
    if b'"' in marks:  # strings with brackets inside: keep what lies between them
        marks = b"".join(marks.split(b'"')[::2])
    brackets = marks.translate(_PAIRS)
    too_many = b"(" * (limit + 1)
    for _ in range(limit):
        if too_many in brackets:  # the usual attack, found in one pass
            return True
        inner = brackets.replace(b"()", b"")
        if len(inner) == len(brackets):
            break  # nothing more closes
        brackets = inner
        if not brackets:
            return False
    return bool(brackets)


def loads(data: bytes, where: str, limit: int = MAX_DEPTH) -> Any:
    """The JSON value in ``data``, an answer from ``where`` (an endpoint, for messages).

    Raises:
        BadResponse: not JSON, not UTF-8, or nested deeper than ``limit``.
    """
    if too_deep(data, limit):
        raise BadResponse(f"{where} answered JSON nested deeper than {limit} levels")
    try:
        # Decoded here: json.loads would first guess the encoding, in Python code.
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise BadResponse(f"{where} answered what is not JSON ({exc}): {data[:200]!r}") from None
