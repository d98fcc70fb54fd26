"""Step 1 of reading torch's pickled rendezvous state (:mod:`.torch_state`): the
opcodes, scanned before anything is built.

:func:`scan` walks a pickle with :func:`pickletools.genops`, which decodes opcodes
without building any object, and refuses every opcode torch's state does not need and
nesting deeper than :data:`MAX_DEPTH` (hashing a tuple nested a million deep, a few
bytes per level, overflows the C stack). Only a pickle that passes goes on to the
restricted unpickler.
"""

from __future__ import annotations

import pickletools

__all__ = ["MAX_DEPTH", "Refused", "scan"]


class Refused(Exception):
    """The pickle is not torch's state; the message says why (no untrusted text
    beyond a bounded repr)."""


# The deepest nesting accepted. torch's state is about 10 deep (state, its dict, the
# heartbeats, a datetime, its timezone, its timedelta, each with its argument tuple).
MAX_DEPTH = 32
# Every opcode torch's state needs, in any protocol from 3 on (torch pickles with the
# default protocol: 4 on Python 3.8-3.13, 5 later). Absent on purpose: persistent ids
# and the extension registry (they reach objects without find_class), INST/OBJ, lists,
# floats, and the variable-length forms that may announce gigabytes (LONG4,
# BINUNICODE8, BINBYTES8).
_OPCODES = frozenset(
    {
        "PROTO",
        "FRAME",
        "STOP",
        "MARK",
        "MEMOIZE",
        "BINPUT",
        "LONG_BINPUT",
        "BINGET",
        "LONG_BINGET",
        "NONE",
        "NEWTRUE",
        "NEWFALSE",
        "BININT",
        "BININT1",
        "BININT2",
        "LONG1",
        "SHORT_BINUNICODE",
        "BINUNICODE",
        "SHORT_BINBYTES",
        "BINBYTES",
        "EMPTY_TUPLE",
        "TUPLE1",
        "TUPLE2",
        "TUPLE3",
        "TUPLE",
        "EMPTY_DICT",
        "SETITEM",
        "SETITEMS",
        "EMPTY_SET",
        "ADDITEMS",
        "GLOBAL",
        "STACK_GLOBAL",
        "NEWOBJ",
        "REDUCE",
        "BUILD",
    }
)
_MEMO_PUT = frozenset({"MEMOIZE", "BINPUT", "LONG_BINPUT"})
_MEMO_GET = frozenset({"BINGET", "LONG_BINGET"})
# Opcodes that fill the object below their operands in place (it stays on the stack):
# how many operands they take (the marked ones: all since the mark).
_IN_PLACE = {"SETITEM": 2, "BUILD": 1}
_IN_PLACE_MARKED = frozenset({"SETITEMS", "ADDITEMS"})


class _Cell:
    """One object on the simulated stack: how deeply nested it is."""

    __slots__ = ("depth",)

    def __init__(self, depth: int) -> None:
        self.depth = depth


_MARK = _Cell(-1)


def scan(data: bytes) -> None:
    """Refuse opcodes outside :data:`_OPCODES` and nesting beyond :data:`MAX_DEPTH`.

    Simulates the unpickler's stack with one :class:`_Cell` per object; a container
    filled in place (a dict's items, a set's, an object's state) keeps its cell, so the
    memo sees its depth grow.
    """
    stack: list[_Cell] = []
    memo: dict[int, _Cell] = {}
    end = -1

    def pop(count: int) -> list[_Cell]:
        if count > len(stack) or any(c is _MARK for c in stack[len(stack) - count :]):
            raise Refused("the pickle's stack is malformed")
        taken = stack[len(stack) - count :]
        del stack[len(stack) - count :]
        return taken

    def pop_to_mark() -> list[_Cell]:
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is _MARK:
                taken = stack[i + 1 :]
                del stack[i:]
                return taken
        raise Refused("the pickle's stack is malformed (no mark)")

    def top() -> _Cell:
        if not stack or stack[-1] is _MARK:
            raise Refused("the pickle's stack is malformed")
        return stack[-1]

    def push(children: list[_Cell]) -> None:
        depth = 1 + max((c.depth for c in children), default=0)
        if depth > MAX_DEPTH:
            raise Refused(f"it is nested more than {MAX_DEPTH} deep")
        stack.append(_Cell(depth))

    def fill(target: _Cell, children: list[_Cell]) -> None:
        target.depth = max(target.depth, 1 + max((c.depth for c in children), default=0))
        if target.depth > MAX_DEPTH:
            raise Refused(f"it is nested more than {MAX_DEPTH} deep")

    try:
        for opcode, arg, pos in pickletools.genops(data):
            name = opcode.name
            if name not in _OPCODES:
                raise Refused(f"opcode {name} (at byte {pos}) is not used by torch's state")
            if name in ("PROTO", "FRAME"):
                continue
            if name == "STOP":
                if len(stack) != 1 or stack[0] is _MARK:
                    raise Refused("the pickle's stack is malformed at its end")
                end = pos if pos is not None else -1  # bytes always have positions
                break
            if name == "MARK":
                stack.append(_MARK)
            elif name in _MEMO_PUT:
                memo[len(memo) if name == "MEMOIZE" else _index(arg)] = top()
            elif name in _MEMO_GET:
                if _index(arg) not in memo:
                    raise Refused(f"the pickle reads memo entry {arg} before writing it")
                stack.append(memo[_index(arg)])
            elif name in _IN_PLACE:
                children = pop(_IN_PLACE[name])
                fill(top(), children)
            elif name in _IN_PLACE_MARKED:
                children = pop_to_mark()
                fill(top(), children)
            elif name == "TUPLE":
                push(pop_to_mark())
            else:
                # Everything else pops what its description says and pushes one object.
                push(pop(len(opcode.stack_before)))
    except ValueError as exc:  # genops: not a pickle (truncated, unknown opcode, ...)
        raise Refused(f"it is not a valid pickle ({exc})") from None
    if end < 0:
        raise Refused("the pickle has no end (STOP)")
    if end != len(data) - 1:
        raise Refused(f"{len(data) - end - 1} bytes follow the pickle's end")


def _index(arg: object) -> int:
    """A memo index as genops decodes it (an int for the binary opcodes)."""
    if type(arg) is not int:
        raise Refused("the pickle has a malformed memo index")
    return arg
