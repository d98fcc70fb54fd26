"""The v3 client's one builder of transaction bodies, and its reading of the answers
(no server): which compare each typed condition is, what a refused transaction reads
back, and how a resend whose first try landed is told from a refusal."""

from __future__ import annotations

import base64
from typing import Any

from etcd_rdzv._kv import Compare, Delete, DeletePrefix, Get, Present, Put, Quiet, Revision
from etcd_rdzv._kv.v3.kv import _answer, _body


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _kv(key: str, value: str, lease: int = 0, revision: int = 7) -> dict[str, Any]:
    return {
        "key": _b64(key),
        "value": _b64(value),
        "mod_revision": str(revision),
        "create_revision": str(revision),
        "lease": str(lease),
    }


def _range(*kvs: dict[str, Any]) -> dict[str, Any]:
    return {"response_range": {"kvs": list(kvs)}}


COMPARES = [Compare("/r/result", None), Quiet("/r/gone/", 41), Revision("/r/hint", 9)]
OPS = [Put("/r/result", "mine", ttl=60), Get("/r/coord"), Delete("/r/old"), DeletePrefix("/r/x/")]


def test_each_condition_and_operation_is_its_gateway_counterpart() -> None:
    body = _body(COMPARES, OPS, 0x2A, reads=True)
    absent, quiet, same = body["compare"]
    assert (absent["target"], absent["create_revision"]) == ("CREATE", "0")
    assert (quiet["target"], quiet["result"], quiet["mod_revision"]) == ("MOD", "LESS", "42")
    assert quiet["key"] == _b64("/r/gone/") and quiet["range_end"] == _b64("/r/gone0")
    assert (same["target"], same["result"], same["mod_revision"]) == ("MOD", "EQUAL", "9")
    put, get, delete, prefix = body["success"]
    assert put["request_put"]["lease"] == str(0x2A)
    assert get == {"request_range": {"key": _b64("/r/coord")}}
    assert delete == {"request_delete_range": {"key": _b64("/r/old")}}
    assert prefix["request_delete_range"]["range_end"] == _b64("/r/x0")
    # Refused, it reads the keyed compares (not the range), the Put's key, the Gets'.
    reads = [r["request_range"]["key"] for r in body["failure"]]
    assert reads == [_b64(k) for k in ("/r/result", "/r/hint", "/r/result", "/r/coord")]
    assert "failure" not in _body(COMPARES, OPS, 0, reads=False)


def test_a_refusal_reports_each_compared_key_in_order_and_the_range_as_none() -> None:
    data = {
        "header": {"revision": "50"},
        "succeeded": False,
        "responses": [_range(_kv("/r/result", "theirs")), _range(_kv("/r/hint", "3")), _range()],
    }
    refused = _answer(COMPARES, OPS, data, 0x2A)
    assert not refused.succeeded and refused.revision == 50
    result, quiet, hint = refused.compared
    assert result is not None and result.value == "theirs"
    assert quiet is None
    assert hint is not None and hint.value == "3"


def test_a_refused_resend_whose_first_try_landed_is_reported_succeeded() -> None:
    mine = _kv("/r/result", "mine", lease=0x2A, revision=45)
    data = {
        "header": {"revision": "50"},
        "succeeded": False,
        "responses": [_range(mine), _range(), _range(mine), _range(_kv("/r/coord", "c"))],
    }
    done = _answer(COMPARES, OPS, data, 0x2A)
    assert done.succeeded
    written, coord, deleted, dropped = done.records
    assert written is not None and (written.value, written.revision) == ("mine", 45)
    assert coord is not None and coord.value == "c"
    assert deleted is None and dropped is None
    # The same value on another lease is another writer's: refused.
    assert not _answer(COMPARES, OPS, data, 0x2B).succeeded


def test_a_transaction_that_ran_counts_what_its_deletes_removed() -> None:
    data = {
        "header": {"revision": "51"},
        "succeeded": True,
        "responses": [
            {"response_put": {}},
            _range(),
            {"response_delete_range": {"deleted": "1"}},
            {"response_delete_range": {"deleted": "3"}},
        ],
    }
    done = _answer(COMPARES, OPS, data, 0x2A)
    assert done.succeeded and done.deleted == 4 and done.revision == 51
    put = done.records[0]
    assert put is not None and (put.key, put.value, put.revision) == ("/r/result", "mine", 51)


def test_a_key_being_there_is_a_create_revision_above_zero() -> None:
    body = _body(
        [Present("/r/incarnation")], [Put("/r/me", "v"), Get("/r/incarnation")], 0, reads=True
    )
    (there,) = body["compare"]
    assert there == {
        "key": _b64("/r/incarnation"),
        "target": "CREATE",
        "result": "GREATER",
        "create_revision": "0",
    }
    reads = [r["request_range"]["key"] for r in body["failure"]]
    assert reads == [_b64(k) for k in ("/r/incarnation", "/r/me", "/r/incarnation")]
