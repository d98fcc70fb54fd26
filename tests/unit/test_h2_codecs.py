"""The codecs of the v3 keep-alive stream, without a server: HPACK (the examples of
RFC 7541 Appendix C, and what a hostile server could send) and the protobuf of
``LeaseKeepAliveRequest``/``LeaseKeepAliveResponse``."""

from __future__ import annotations

import pytest

from etcd_rdzv._kv._answer import BadResponse
from etcd_rdzv._kv.v3._hpack import MAX_HEADER_LIST, Decoder, HpackError, encode
from etcd_rdzv._kv.v3._keepalive_stream import decode_answer, encode_request

# -- HPACK --------------------------------------------------------------------------------


def test_rfc_7541_c4_requests_with_huffman_and_the_dynamic_table() -> None:
    decoder = Decoder()
    first = decoder.decode(bytes.fromhex("828684418cf1e3c2e5f23a6ba0ab90f4ff"))
    assert first == [
        (":method", "GET"),
        (":scheme", "http"),
        (":path", "/"),
        (":authority", "www.example.com"),
    ]
    second = decoder.decode(bytes.fromhex("828684be5886a8eb10649cbf"))
    assert second[-2:] == [(":authority", "www.example.com"), ("cache-control", "no-cache")]
    third = decoder.decode(bytes.fromhex("828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf"))
    assert third[-1] == ("custom-key", "custom-value")


def test_rfc_7541_c6_responses_evict_from_a_small_table() -> None:
    # C.6 uses a 256-byte table: announced by a size update at the head of the block.
    decoder = Decoder()
    first = decoder.decode(
        bytes.fromhex(
            "3fe101"  # table size update to 256
            "488264025885aec3771a4b6196d07abe941054d444a8200595040b8166e082a62d1bff6e919d29"
            "ad171863c78f0b97c8e9ae82ae43d3"
        )
    )
    assert first == [
        (":status", "302"),
        ("cache-control", "private"),
        ("date", "Mon, 21 Oct 2013 20:13:21 GMT"),
        ("location", "https://www.example.com"),
    ]
    second = decoder.decode(bytes.fromhex("4883640effc1c0bf"))
    assert second[0] == (":status", "307")
    assert second[1:] == first[1:]


def test_what_this_client_encodes_decodes() -> None:
    headers = [(":method", "POST"), (":path", "/x"), ("token", "a" * 200)]
    assert Decoder().decode(encode(headers)) == headers


@pytest.mark.parametrize(
    ("block", "error"),
    [
        (b"\xbe", "names no entry"),  # index 62 with an empty dynamic table
        (b"\x80", "names no entry"),  # index 0
        (b"\x00\x05ab", "runs past"),  # a name longer than the block
        (b"\x00\x81\x00\x00", "EOS padding"),  # a Huffman string of one zero byte
        (b"\x00\x84\xff\xff\xff\xff\x00", "holds EOS"),  # 30 one-bits: EOS itself
        (b"\x00\x82\xff\xff\x00", "EOS padding"),  # 16 bits of padding: over 7
        (b"\x00\x7f\xff\xff\xff\xff\x0f", "too large"),  # a length over 2**28
        (b"\x3f\xe2\x1f", "not allowed"),  # a table larger than this client allows
        (b"\x82\x20", "not allowed"),  # a size update after a header
    ],
)
def test_bad_header_blocks_are_refused(block: bytes, error: str) -> None:
    with pytest.raises(HpackError, match=error):
        Decoder().decode(block)


def test_a_header_block_may_not_decode_past_the_bound() -> None:
    name = b"x" * 100
    # One literal (indexed into the dynamic table), then references to it: a few bytes
    # that would decode to megabytes.
    block = b"\x40\x64" + name + b"\x01v" + b"\xbe" * (MAX_HEADER_LIST // 100)
    with pytest.raises(HpackError, match="decodes to over"):
        Decoder().decode(block)


# -- protobuf -------------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= 2**64 - 1
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def _answer(lease: int, ttl: int, term: int = 7, extra: bytes = b"") -> bytes:
    header = b"\x08" + _varint(99) + b"\x10" + _varint(3) + b"\x18" + _varint(42)
    header += b"\x20" + _varint(term)
    body = b"\x0a" + _varint(len(header)) + header + b"\x10" + _varint(lease)
    return body + b"\x18" + _varint(ttl) + extra


def test_a_request_is_one_grpc_message() -> None:
    lease = 0x694D9F4A3C2B1A00
    message = encode_request(lease)
    assert message[0] == 0 and int.from_bytes(message[1:5], "big") == len(message) - 5
    assert message[5:] == b"\x08" + _varint(lease)


def test_an_answer_decodes_with_its_header() -> None:
    lease = 0x694D9F4A3C2B1A00
    header, answered, ttl = decode_answer(_answer(lease, 9), "http://e:2379")
    assert (answered, ttl) == (lease, 9)
    assert header == {"cluster_id": 99, "member_id": 3, "revision": 42, "raft_term": 7}


def test_unknown_fields_are_skipped_and_a_gone_lease_has_ttl_0() -> None:
    extra = b"\x21" + b"\0" * 8 + b"\x2a\x02hi" + b"\x35" + b"\0" * 4  # fields 4, 5, 6
    _, answered, ttl = decode_answer(_answer(5, 0, extra=extra), "http://e:2379")
    assert (answered, ttl) == (5, 0)
    # etcd 3.7 leaves a zero out: no TTL field at all.
    _, _, ttl = decode_answer(b"\x10\x05", "http://e:2379")
    assert ttl == 0


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (b"\x10", "inside a varint"),
        (b"\x10" + b"\xff" * 11, "longer than 10 bytes"),
        (b"\x0a\x05ab", "runs past"),
        (b"\x12\x01a", "not a varint"),  # the lease id as bytes
        (b"\x0b", "wire type 3"),  # a group
        (b"\x00\x01", "field number 0"),
        (b"\x0a\x02\x20\x01" + b"\x19" + b"\0" * 3, "inside a fixed-size field"),
    ],
)
def test_bad_answers_name_the_endpoint(message: bytes, error: str) -> None:
    with pytest.raises(BadResponse, match=f"http://e:2379.*{error}"):
        decode_answer(message, "http://e:2379")
