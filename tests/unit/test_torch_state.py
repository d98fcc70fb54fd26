"""The decoder of torch's dynamic rendezvous state: real torch pickles decode, hostile
ones are refused without running anything they name.

The ``GOLDEN_*`` values are what torch 2.13 (``pickle.dumps`` of its
``_RendezvousState``, Python 3.11) wrote, base64 as our backend stores them; they were
made with the script in :func:`test_golden_states_decode`'s docstring.
tests/torch/test_status_dynamic.py checks live states of real handlers.
"""

from __future__ import annotations

import base64
import datetime as dt
import os
import pickle
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from etcd_rdzv.errors import RendezvousStateError
from etcd_rdzv.runs import torch_state
from etcd_rdzv.runs.torch_state import (
    MAX_STATE_BYTES,
    TORCH_STATE_MODULE,
    TorchNode,
    decode_state,
    parse_state_value,
)

KEY = "/etcd_rdzv/job/state"

# round 2 complete: host-a rank 0, host-b rank 1, host-w waiting, host-s redundant.
GOLDEN_COMPLETE = (
    "gASVCgIAAAAAAACMN3RvcmNoLmRpc3RyaWJ1dGVkLmVsYXN0aWMucmVuZGV6dm91cy5keW5hbWljX3JlbmRl"
    "enZvdXOUjBBfUmVuZGV6dm91c1N0YXRllJOUKYGUfZQojAVyb3VuZJRLAowIY29tcGxldGWUiIwIZGVhZGxp"
    "bmWUTowGY2xvc2VklImMDHBhcnRpY2lwYW50c5R9lChoAIwJX05vZGVEZXNjlJOUKYGUfZQojARhZGRylIwG"
    "aG9zdC1hlIwDcGlklEtljAhsb2NhbF9pZJRLAHViSwBoDCmBlH2UKGgPjAZob3N0LWKUaBFLymgSSwB1YksB"
    "dYwJd2FpdF9saXN0lI+UKGgMKYGUfZQoaA+MBmhvc3Qtd5RoEU0vAWgSSwF1YpCMD3JlZHVuZGFuY3lfbGlz"
    "dJSPlChoDCmBlH2UKGgPjAZob3N0LXOUaBFNlAFoEksCdWKQjA9sYXN0X2hlYXJ0YmVhdHOUfZQoaA2MCGRh"
    "dGV0aW1llIwIZGF0ZXRpbWWUk5RDCgfpAQIDBAEB4kCUaCKMCHRpbWV6b25llJOUaCKMCXRpbWVkZWx0YZST"
    "lEsASwBLAIeUUpSFlFKUhpRSlGgTaCRDCgfpAQIDBAIB4kCUaC2GlFKUaBhoJEMKB+kBAgMEAwHiQJRoLYaU"
    "UpRoHWgkQwoH6QECAwQEAeJAlGgthpRSlHV1Yi4="
)
# round 1 forming: host-a joined, the last call ends at 03:04:30.
GOLDEN_FORMING = (
    "gASVeAEAAAAAAACMN3RvcmNoLmRpc3RyaWJ1dGVkLmVsYXN0aWMucmVuZGV6dm91cy5keW5hbWljX3JlbmRl"
    "enZvdXOUjBBfUmVuZGV6dm91c1N0YXRllJOUKYGUfZQojAVyb3VuZJRLAYwIY29tcGxldGWUiYwIZGVhZGxp"
    "bmWUjAhkYXRldGltZZSMCGRhdGV0aW1llJOUQwoH6QECAwQeAeJAlGgIjAh0aW1lem9uZZSTlGgIjAl0aW1l"
    "ZGVsdGGUk5RLAEsASwCHlFKUhZRSlIaUUpSMBmNsb3NlZJSJjAxwYXJ0aWNpcGFudHOUfZRoAIwJX05vZGVE"
    "ZXNjlJOUKYGUfZQojARhZGRylIwGaG9zdC1hlIwDcGlklEtljAhsb2NhbF9pZJRLAHViSwBzjAl3YWl0X2xp"
    "c3SUj5SMD3JlZHVuZGFuY3lfbGlzdJSPlIwPbGFzdF9oZWFydGJlYXRzlH2UaBtoCkMKB+kBAgMEBQHiQJRo"
    "E4aUUpRzdWIu"
)
# a fresh _RendezvousState().
GOLDEN_EMPTY = (
    "gASVywAAAAAAAACMN3RvcmNoLmRpc3RyaWJ1dGVkLmVsYXN0aWMucmVuZGV6dm91cy5keW5hbWljX3JlbmRl"
    "enZvdXOUjBBfUmVuZGV6dm91c1N0YXRllJOUKYGUfZQojAVyb3VuZJRLAIwIY29tcGxldGWUiYwIZGVhZGxp"
    "bmWUTowGY2xvc2VklImMDHBhcnRpY2lwYW50c5R9lIwJd2FpdF9saXN0lI+UjA9yZWR1bmRhbmN5X2xpc3SU"
    "j5SMD2xhc3RfaGVhcnRiZWF0c5R9lHViLg=="
)


def _at(second: int) -> dt.datetime:
    return dt.datetime(2025, 1, 2, 3, 4, second, 123456, tzinfo=dt.timezone.utc)


def test_golden_states_decode() -> None:
    """Made with torch 2.13 as follows (``t(s)`` is ``_at(s)``)::

    a, b, w, r = N("host-a", 101, 0), N("host-b", 202, 0), N("host-w", 303, 1), N("host-s", 404, 2)
    s = S(); s.round = 2; s.complete = True; s.participants = {a: 0, b: 1}
    s.wait_list = {w}; s.redundancy_list = {r}
    s.last_heartbeats = {a: t(1), b: t(2), w: t(3), r: t(4)}
    f = S(); f.round = 1; f.participants = {a: 0}; f.deadline = t(30)
    f.last_heartbeats = {a: t(5)}
    """
    a, b = TorchNode("host-a", 101, 0), TorchNode("host-b", 202, 0)
    w, r = TorchNode("host-w", 303, 1), TorchNode("host-s", 404, 2)

    state = parse_state_value(GOLDEN_COMPLETE, KEY)
    assert (state.round, state.complete, state.closed, state.deadline) == (2, True, False, None)
    assert state.participants == ((a, 0), (b, 1))
    assert (state.wait_list, state.redundancy_list) == ((w,), (r,))
    assert dict(state.last_heartbeats) == {a: _at(1), b: _at(2), w: _at(3), r: _at(4)}
    assert state.heartbeat_of(b) == _at(2)
    assert a.node_id == "host-a_101_0"  # as torch's _NodeDesc.__repr__

    forming = parse_state_value(GOLDEN_FORMING, KEY)
    assert (forming.round, forming.complete, forming.deadline) == (1, False, _at(30))
    assert forming.participants == ((a, 0),)
    assert forming.last_heartbeats == ((a, _at(5)),)

    empty = parse_state_value(GOLDEN_EMPTY, KEY)
    assert (empty.round, empty.participants, empty.last_heartbeats) == (0, (), ())


# -- a small assembler of pickles, to build torch-like and hostile ones without torch ----


def _text(value: str) -> bytes:
    raw = value.encode("utf-8")
    if len(raw) < 256:
        return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE
    return b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE


def _int(value: int) -> bytes:
    return b"J" + struct.pack("<i", value)  # BININT


def _global(module: str, name: str) -> bytes:
    return _text(module) + _text(name) + b"\x93"  # STACK_GLOBAL


def _node(addr: str = "h", pid: int = 7, local_id: int = 0, **extra: bytes) -> bytes:
    fields = _text("addr") + _text(addr) + _text("pid") + _int(pid)
    fields += _text("local_id") + _int(local_id)
    fields += b"".join(_text(k) + v for k, v in extra.items())
    return _global(TORCH_STATE_MODULE, "_NodeDesc") + b")\x81}(" + fields + b"ub"


def _utc_datetime(second: int) -> bytes:
    state = bytes([7, 233, 1, 2, 3, 4, second, 0, 0, 0])
    utc = (
        _global("datetime", "timezone")
        + _global("datetime", "timedelta")
        + _int(0) * 3
        + b"\x87R\x85R"  # TUPLE3 REDUCE TUPLE1 REDUCE
    )
    return _global("datetime", "datetime") + b"C\x0a" + state + utc + b"\x86R"


DEFAULTS = {
    "round": _int(0),
    "complete": b"\x89",
    "deadline": b"N",
    "closed": b"\x89",
    "participants": b"}",
    "wait_list": b"\x8f",
    "redundancy_list": b"\x8f",
    "last_heartbeats": b"}",
}


def _state(drop: tuple[str, ...] = (), **fields: bytes) -> bytes:
    """A pickled state with ``fields`` (opcodes of each value) over the defaults."""
    merged = {k: v for k, v in {**DEFAULTS, **fields}.items() if k not in drop}
    body = b"".join(_text(k) + v for k, v in merged.items())
    return (
        b"\x80\x04" + _global(TORCH_STATE_MODULE, "_RendezvousState") + b")\x81}(" + body + b"ub."
    )


def test_the_assembler_writes_states_as_torch_does() -> None:
    data = _state(
        round=_int(3),
        complete=b"\x88",
        participants=b"}(" + _node("n1", 1) + _int(1) + _node("n0", 2) + _int(0) + b"u",
        redundancy_list=b"\x8f(" + _node("sp", 3) + b"\x90",
        last_heartbeats=b"}(" + _node("n1", 1) + _utc_datetime(9) + b"u",
    )
    state = decode_state(data, KEY)
    n0, n1 = TorchNode("n0", 2, 0), TorchNode("n1", 1, 0)
    assert (state.round, state.complete) == (3, True)
    assert state.participants == ((n0, 0), (n1, 1))  # by rank
    assert state.redundancy_list == (TorchNode("sp", 3, 0),)
    assert state.heartbeat_of(n1) == dt.datetime(2025, 1, 2, 3, 4, 9, tzinfo=dt.timezone.utc)
    assert state.heartbeat_of(n0) is None


# -- hostile pickles -------------------------------------------------------------------


def _refused(data: bytes, *words: str) -> str:
    with pytest.raises(RendezvousStateError) as info:
        decode_state(data, KEY)
    message = str(info.value)
    assert repr(KEY) in message
    for word in words:
        assert word in message, message
    return message


class _Payload:
    """What an attacker would write: unpickling it runs a shell command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (self.command,))


def test_a_pickle_that_calls_os_system_is_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    data = pickle.dumps(_Payload(f"touch {marker}"))
    # The payload is real: an ordinary unpickler (in a child process) runs it.
    proof = tmp_path / "proof"
    real = pickle.dumps(_Payload(f"touch {proof}"))
    subprocess.run(
        [sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"],
        input=real,
        check=True,
        timeout=60,
    )
    assert proof.exists()

    message = _refused(data, "'posix'", "'system'")
    assert not marker.exists()
    # The same call hidden in a field of a state that is otherwise torch's.
    hidden = _state(closed=_global("posix", "system") + _text(f"touch {marker}") + b"\x85R")
    _refused(hidden, "'posix'")
    # And through the text form of GLOBAL, with the module named "os".
    text_global = b"\x80\x04cos\nsystem\n" + _text(f"touch {marker}") + b"\x85R."
    _refused(text_global, "'os'")
    assert not marker.exists()
    assert "torch's state never does" in message


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("builtins", "eval"),
        ("builtins", "getattr"),
        ("subprocess", "Popen"),
        ("datetime", "date"),  # near a name torch uses is not one
        (TORCH_STATE_MODULE, "DynamicRendezvousHandler"),
        ("torch.distributed.elastic.rendezvous", "_RendezvousState"),
        ("etcd_rdzv.runs.torch_state", "_NodeStandIn"),  # our own stand-ins neither
    ],
)
def test_every_other_name_is_refused(module: str, name: str) -> None:
    _refused(_state(closed=_global(module, name)), repr(module), repr(name))


def test_opcodes_torch_never_writes_are_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    # A protocol-0 pickle of os.system (GLOBAL then STRING, MARK, TUPLE, REDUCE).
    _refused(f"cos\nsystem\n(S'touch {marker}'\ntR.".encode(), "opcode STRING")
    _refused(b"\x80\x04(" + _text("x") + b"ios\nsystem\n.", "opcode INST")  # by name
    _refused(b"\x80\x04\x82\x01.", "opcode EXT1")  # the copyreg extension registry
    _refused(b"\x80\x04P1\n.", "opcode PERSID")  # persistent ids
    _refused(b"\x80\x04]\x94.", "opcode EMPTY_LIST")
    assert not marker.exists()


def test_deep_nesting_is_refused_before_anything_is_built() -> None:
    # A dict key nested 200,000 tuples deep: hashing it overflows the C stack (the
    # interpreter dies). Run in a child, so a broken guard fails this test only.
    code = textwrap.dedent(
        """
        from etcd_rdzv.errors import RendezvousStateError
        from etcd_rdzv.runs.torch_state import decode_state
        data = b"\\x80\\x04}" + b")" + b"\\x85" * 200_000 + b"K\\x00s."
        try:
            decode_state(data, "/k")
        except RendezvousStateError as exc:
            print(exc)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "nested more than 32 deep" in done.stdout
    # Dicts filled in place (SETITEM into a memoized dict) count as well.
    nested = b"\x80\x04" + (b"}" + _text("k")) * 40 + b"}" + b"s" * 40 + b"."
    _refused(nested, "nested more than 32 deep")


def test_malformed_and_oversized_pickles_are_refused() -> None:
    good = _state()
    decode_state(good, KEY)
    _refused(good[:-1], "not a valid pickle")  # truncated
    _refused(good + b"N.", "2 bytes follow")
    _refused(b"", "not a valid pickle")
    _refused(b"\x80\x04h\x05.", "memo entry 5")
    _refused(b"\x80\x04Nu.", "stack is malformed")  # SETITEMS without a mark
    _refused(b"\x80\x04" + b"N" * (MAX_STATE_BYTES + 1) + b".", f"{MAX_STATE_BYTES} read")
    _refused(b"\x80\x04N.", "not torch's _RendezvousState")
    with pytest.raises(RendezvousStateError, match="not base64"):
        parse_state_value("not base64!", KEY)
    with pytest.raises(RendezvousStateError, match="more than"):
        parse_state_value("A" * (MAX_STATE_BYTES * 2), KEY)


def test_fields_are_checked() -> None:
    assert decode_state(_state(extra=_int(1)), KEY).round == 0  # a later torch's field
    _refused(_state(drop=("wait_list",)), "lacks the field(s) wait_list")
    # A field named like a method does not replace it: a second BUILD (which looks
    # __setstate__ up on the object) still reaches the stand-in's own, which refuses.
    shadow = _state(__setstate__=_global("datetime", "timedelta"))
    assert shadow.endswith(b"ub.")
    _refused(shadow[:-1] + b"}b.", "built twice")
    _refused(_state(round=_int(-1)), "round is not")
    _refused(_state(round=b"\x88"), "round is not")  # a bool is no round number
    _refused(_state(closed=_int(1)), "closed is a int, not a bool")
    _refused(_state(deadline=_text("soon")), "deadline is a str")
    _refused(_state(participants=b"}(" + _text("n") + _int(0) + b"u"), "not a node")
    _refused(_state(participants=b"}(" + _node() + _int(-1) + b"u"), "rank is not")
    _refused(_state(wait_list=b"}"), "wait_list is a dict, not a set")
    _refused(_state(last_heartbeats=b"}(" + _node() + _int(5) + b"u"), "not a datetime")


def test_nodes_are_checked() -> None:
    def participants(node: bytes) -> bytes:
        return _state(participants=b"}(" + node + _int(0) + b"u")

    _refused(participants(_node(extra=_int(1))), "not addr, pid, local_id")
    _refused(participants(_node(pid=-3)), "pid is not")
    bad_addr = _node().replace(_text("h"), _int(5))
    _refused(participants(bad_addr), "addr is a int, not a string")
    _refused(participants(_node("x" * 2000)), "addr is longer than 1024")
    # Built twice: the second BUILD could change a dict key after it was hashed.
    twice = _node() + b"}(" + _text("addr") + _text("y") + _text("pid") + _int(1)
    twice += _text("local_id") + _int(0) + b"ub"
    _refused(participants(twice), "built twice")
    # Hashed before it was built.
    unbuilt = _global(TORCH_STATE_MODULE, "_NodeDesc") + b")\x81"
    _refused(participants(unbuilt), "used before it was built")
    # NEWOBJ with arguments, and the datetime function used as a class.
    _refused(participants(_global(TORCH_STATE_MODULE, "_NodeDesc") + _int(1) + b"\x85\x81"))
    _refused(_state(deadline=_global("datetime", "datetime") + b")\x81"), "does not unpickle")


def test_the_stand_in_classes_cannot_be_changed_by_a_pickle() -> None:
    before = dict(vars(torch_state._NodeStandIn))
    # BUILD on the class itself, with a slot state that would set its attributes.
    attack = _global(TORCH_STATE_MODULE, "_NodeDesc") + b"N}(" + _text("__eq__") + b"Nu\x86b"
    _refused(_state(closed=attack), "does not unpickle")
    assert dict(vars(torch_state._NodeStandIn)) == before


def test_datetimes_are_checked() -> None:
    def deadline(args: bytes) -> bytes:
        return _state(deadline=_global("datetime", "datetime") + args + b"R")

    _refused(deadline(b"C\x03abc\x85"), "10-byte state")
    _refused(deadline(b"C\x0a" + bytes([7, 233, 13, 2, 3, 4, 5, 0, 0, 0]) + b"\x85"), "range")
    _refused(deadline(b"C\x0a" + bytes(10) + _text("UTC") + b"\x86"), "time zone of type str")
    tz = _global("datetime", "timezone") + _global("datetime", "timedelta")
    _refused(_state(deadline=tz + _int(2) + _int(0) * 2 + b"\x87R\x85R"), "out of range")
    _refused(_state(deadline=_global("datetime", "timedelta") + _int(1) + b"\x85R"), "three")
    naive = decode_state(
        deadline(b"C\x0a" + bytes([7, 233, 1, 2, 3, 4, 5, 0, 0, 1]) + b"\x85"), KEY
    )
    assert naive.deadline == dt.datetime(2025, 1, 2, 3, 4, 5, 1)


def test_decoding_imports_no_torch() -> None:
    code = (
        "import sys, base64; from etcd_rdzv.runs.torch_state import parse_state_value\n"
        f"parse_state_value({GOLDEN_COMPLETE!r}, 'k')\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr


def test_golden_base64_is_what_the_backend_stores() -> None:
    raw = base64.b64decode(GOLDEN_EMPTY)
    assert decode_state(raw, KEY) == parse_state_value(GOLDEN_EMPTY, KEY)
