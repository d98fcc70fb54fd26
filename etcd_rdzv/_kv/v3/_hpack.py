"""HPACK (RFC 7541): the header compression of HTTP/2, as the keep-alive stream needs it.

Encoding is the simplest the RFC allows: every header a literal without indexing,
its name and value as they are (no Huffman, no dynamic table), so the peer's
decoder state never depends on ours. Decoding is whole, because what etcd's gRPC
server sends (its answer headers, and the trailers that carry ``grpc-status``) uses
all of it: the static and dynamic tables, table size updates, Huffman-coded strings.

What the server sends is untrusted: every integer is bounded, a string may not run
past its block, a Huffman string must end in at most seven bits of EOS padding and
never hold EOS, an index must name an entry, and a block may decode to at most
:data:`MAX_HEADER_LIST` bytes (counted as RFC 7540 6.5.2 counts them). Anything else
is :class:`HpackError`.
"""

from __future__ import annotations

__all__ = ["MAX_HEADER_LIST", "TABLE_SIZE", "Decoder", "HpackError", "encode"]

#: The dynamic table size this client allows the server (HTTP/2's default).
TABLE_SIZE = 4096
#: The most bytes (names, values and 32 per header) one header block may decode to;
#: also what this client announces as SETTINGS_MAX_HEADER_LIST_SIZE.
MAX_HEADER_LIST = 16384

_STATIC: tuple[tuple[str, str], ...] = (
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
)

# The Huffman code of RFC 7541 Appendix B is canonical: codes are assigned in order of
# length, then of symbol. So the length of each symbol's code (0-255, then EOS) is all
# that defines it; each character below is 48 + the length.
_LENGTHS = (
    "=GLLLLLLLHNLLNLLLLLLLLNLLLLLLLLL6::<=68;::8;8666555666666678?6<:=6777777777"
    "7777777777777878=C=>6?56565666577666567655677777?;>=LDFDDFFFGFGGGGGHGHHFGHGG"
    "GGEFGFGGHFEDFFGGEGFFHEFGGEEFEGFGGDFFFGFFGJJDCFGFIJJJKKJHICEJKKJKHEEJJLKKKDHD"
    "EFEEGFFIIHHJGJKJJKKKKKLKKKKKJN"
)
_EOS = 256


def _huffman_codes() -> dict[tuple[int, int], int]:
    """(length, code) -> symbol, built from :data:`_LENGTHS`."""
    lengths = [ord(c) - 48 for c in _LENGTHS]
    assert len(lengths) == 257
    codes: dict[tuple[int, int], int] = {}
    code, previous = -1, lengths[min(range(257), key=lambda s: (lengths[s], s))]
    for symbol in sorted(range(257), key=lambda s: (lengths[s], s)):
        code = (code + 1) << (lengths[symbol] - previous)
        previous = lengths[symbol]
        codes[(previous, code)] = symbol
    return codes


_HUFFMAN = _huffman_codes()
_LONGEST = 30


class HpackError(ValueError):
    """A header block that is not valid HPACK, or over this client's bounds."""


def _huffman_decode(data: bytes) -> bytes:
    out = bytearray()
    code = length = 0
    for byte in data:
        for shift in range(7, -1, -1):
            code = (code << 1) | ((byte >> shift) & 1)
            length += 1
            symbol = _HUFFMAN.get((length, code))
            if symbol is not None:
                if symbol == _EOS:
                    raise HpackError("a Huffman string holds EOS")
                out.append(symbol)
                code = length = 0
            elif length >= _LONGEST:
                raise HpackError("a Huffman string holds no valid code")
    if length > 7 or code != (1 << length) - 1:
        raise HpackError("a Huffman string does not end in EOS padding")
    return bytes(out)


def _integer(value: int, prefix: int, flags: int) -> bytes:
    """``value`` as an HPACK integer with a ``prefix``-bit prefix under ``flags``."""
    limit = (1 << prefix) - 1
    if value < limit:
        return bytes([flags | value])
    out = bytearray([flags | limit])
    value -= limit
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode(headers: list[tuple[str, str]]) -> bytes:
    """``headers`` as one header block: each a literal without indexing, new name,
    neither string Huffman-coded. Names must be lower case (HTTP/2)."""
    out = bytearray()
    for name, value in headers:
        raw_name, raw_value = name.encode("ascii"), value.encode("latin-1")
        out += b"\x00" + _integer(len(raw_name), 7, 0) + raw_name
        out += _integer(len(raw_value), 7, 0) + raw_value
    return bytes(out)


class Decoder:
    """The decoding state of one HTTP/2 connection (its dynamic table)."""

    def __init__(self) -> None:
        self._table: list[tuple[str, str]] = []  # newest first
        self._size = 0
        self._max = TABLE_SIZE

    def _entry(self, index: int) -> tuple[str, str]:
        if 1 <= index <= len(_STATIC):
            return _STATIC[index - 1]
        dynamic = index - len(_STATIC) - 1
        if 0 <= dynamic < len(self._table):
            return self._table[dynamic]
        raise HpackError(f"header index {index} names no entry")

    def _evict(self, room: int) -> None:
        while self._table and self._size + room > self._max:
            name, value = self._table.pop()
            self._size -= len(name) + len(value) + 32

    def _add(self, name: str, value: str) -> None:
        size = len(name) + len(value) + 32
        self._evict(size)
        if size <= self._max:  # larger: the table is only emptied (RFC 7541 4.4)
            self._table.insert(0, (name, value))
            self._size += size

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        """The headers of one complete header block, in order.

        Raises:
            HpackError: not valid HPACK, or over :data:`MAX_HEADER_LIST`.
        """
        headers: list[tuple[str, str]] = []
        total = 0
        pos, end = 0, len(block)

        def integer(prefix: int) -> int:
            nonlocal pos
            if pos >= end:
                raise HpackError("a header block ends inside an integer")
            limit = (1 << prefix) - 1
            value = block[pos] & limit
            pos += 1
            if value < limit:
                return value
            shift = 0
            while True:
                if pos >= end:
                    raise HpackError("a header block ends inside an integer")
                byte = block[pos]
                pos += 1
                value += (byte & 127) << shift
                shift += 7
                if not byte & 128:
                    return value
                if shift > 21:  # over 2**28: more than any bound here
                    raise HpackError("an integer of a header block is too large")

        def string() -> str:
            nonlocal pos
            if pos >= end:
                raise HpackError("a header block ends before a string")
            huffman = bool(block[pos] & 128)
            length = integer(7)
            if length > end - pos:
                raise HpackError("a string runs past its header block")
            raw = block[pos : pos + length]
            pos += length
            return (_huffman_decode(raw) if huffman else raw).decode("latin-1")

        first = True
        while pos < end:
            byte = block[pos]
            if byte & 128:  # indexed
                name, value = self._entry(integer(7))
            elif byte & 64:  # literal with incremental indexing
                index = integer(6)
                name = self._entry(index)[0] if index else string()
                value = string()
                self._add(name, value)
            elif byte & 32:  # dynamic table size update: only first in a block
                size = integer(5)
                if not first or size > TABLE_SIZE:
                    raise HpackError(f"a table size update to {size} is not allowed here")
                self._max = size
                self._evict(0)
                continue
            else:  # literal without indexing, or never indexed
                index = integer(4)
                name = self._entry(index)[0] if index else string()
                value = string()
            first = False
            total += len(name) + len(value) + 32
            if total > MAX_HEADER_LIST:
                raise HpackError(f"a header block decodes to over {MAX_HEADER_LIST} bytes")
            headers.append((name, value))
        return headers
