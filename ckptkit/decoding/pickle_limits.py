"""Resource limits for untrusted pickles, checked before and after the C unpickler runs them.

The C unpickler never runs code through ckptkit's allowlist, but it trusts sizes: a 9-byte
pickle with ``LONG_BINPUT 500000000`` makes it allocate and zero an 8 GB memo, ``BINBYTES8``
allocates the announced length before reading it, and hashing a tuple nested 150 000 deep
(a 150 KB pickle of ``TUPLE1`` opcodes used as a dict key) overflows the C stack, while tuples
that share their halves 40 levels deep take 2**40 steps to hash. So every pickle is first
*scanned* (opcodes walked without building anything; a regular expression skips the harmless
ones at C speed): memo indices, announced lengths, frames and opcodes are checked. Small pickles
are also *simulated* (stack effects only) to bound tuple nesting exactly; larger ones are loaded
on a thread whose stack fits the deepest nesting their tuple opcodes could build. The loaded
value is then *walked* once (iteratively) to bound nesting depth, container sizes and sharing
before any recursive code (``repr``, flattening, ``nest``) touches it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import numpy as np

from ..errors import CorruptRecordError, PickleLimitError


@dataclass(frozen=True)
class Limits:
    """Caps for one kind of pickle. Exceeding one raises :class:`PickleLimitError`."""

    #: Input bytes.
    max_bytes: int
    #: Highest memo index a PUT may name (also never above its position in the input).
    max_memo: int = 1 << 26
    #: Nesting of tuples inside tuples (hashing recurses through them without a guard).
    max_tuple_depth: int = 24
    #: Nesting of containers in the loaded value (walking it recurses).
    max_depth: int = 100
    #: Elements in any one container, and nodes of the value counted as a tree (sharing).
    max_items: int = 1 << 26
    #: Bytes of one integer (LONG1/LONG4); ``repr`` refuses ints above 4300 digits anyway.
    max_int_bytes: int = 1024
    #: Pickles up to this size (or with at most 4096 nesting opcodes) have their tuple nesting
    #: computed exactly before loading. Larger ones load on a thread with a stack deep enough
    #: for any nesting they could build: they cannot crash, but tuples sharing their halves
    #: could still take long to hash (DCP metadata of more than ~3500 chunks is in this case).
    simulate_bytes: int = 512 << 10
    #: Walk the loaded value (False for DCP metadata: its adapter type-checks what it keeps).
    check_value: bool = True
    #: Allow reference cycles that pass through an object (OmegaConf nodes point back to their
    #: parents); cycles made of dicts and lists alone are refused always (flattening walks them).
    object_cycles: bool = False


#: DCP ``.metadata``: large (70 MB at 512k chunks), read by the DCP adapter, which validates.
METADATA_LIMITS = Limits(max_bytes=2 << 30, check_value=False)
#: A tensor record's ``data.pkl``: a few hundred bytes describing one tensor.
RECORD_LIMITS = Limits(max_bytes=1 << 20)
#: User objects and whole torch.save pickles (trainer state, optimizer param groups, …).
OBJECT_LIMITS = Limits(max_bytes=1 << 30, object_cycles=True)

# --------------------------------------------------------------------------------------------
# Opcodes.

_STOP, _FRAME, _LONG_BINPUT, _PUT = 0x2E, 0x95, 0x72, 0x70
#: Opcodes without argument whose only effect is on the unpickler's stack.
_NO_ARG = b"(0125N\x88\x89]aelt\x85\x86\x87)}dsu\x8f\x90\x91Rb\x81\x92o\x93\x94Q"
#: Total length (opcode + argument) of opcodes with a fixed-size argument.
_FIXED = {op: 1 for op in _NO_ARG} | {
    ord("K"): 2,  # BININT1
    ord("h"): 2,  # BINGET
    ord("q"): 2,  # BINPUT (index < 256)
    0x80: 2,  # PROTO
    ord("M"): 3,  # BININT2
    ord("J"): 5,  # BININT
    ord("j"): 5,  # LONG_BINGET
    ord("G"): 9,  # BINFLOAT
    _LONG_BINPUT: 5,
}
#: Counted opcodes: (bytes of the length, signed, is an integer).
_COUNTED = {
    ord("U"): (1, False, False),  # SHORT_BINSTRING
    ord("C"): (1, False, False),  # SHORT_BINBYTES
    0x8C: (1, False, False),  # SHORT_BINUNICODE
    0x8A: (1, False, True),  # LONG1
    ord("T"): (4, True, False),  # BINSTRING
    ord("B"): (4, False, False),  # BINBYTES
    ord("X"): (4, False, False),  # BINUNICODE
    0x8B: (4, True, True),  # LONG4
    0x8D: (8, False, False),  # BINUNICODE8
    0x8E: (8, False, False),  # BINBYTES8
    0x96: (8, False, False),  # BYTEARRAY8
}
#: Protocol-0 opcodes whose argument is one line (INST and GLOBAL take two).
_LINES = {op: 1 for op in b"ILFSVPpg"} | {ord("c"): 2, ord("i"): 2}
_MAX_LINE = 1 << 16
_REFUSED = {
    0x82: "EXT1",
    0x83: "EXT2",
    0x84: "EXT4",
    0x97: "NEXT_BUFFER",
    0x98: "READONLY_BUFFER",
}
#: Opcodes that can put a tuple inside a tuple: TUPLE*, and calls (``tuple(x)``, stand-ins).
NESTING_OPCODES = b"t\x85\x86\x87R\x81\x92oi"


def _fast_pattern() -> re.Pattern[bytes]:
    no_arg = b"[" + b"".join(re.escape(bytes([op])) for op in _NO_ARG) + b"]"
    # LONG_BINPUT below 65536 needs at most a 1 MB memo: harmless at any position.
    with_arg = b"(?:j....|h.|K.|M..|J....|q.|\x80.|G.{8}|r..\x00\x00)"
    return re.compile(b"(?:" + no_arg + b"*+" + with_arg + b")*+" + no_arg + b"*+", re.DOTALL)


_SKIP = _fast_pattern().match


def nesting_bound(data: bytes | memoryview) -> int:
    """How deep tuples built by ``data`` could nest at most: its count of nesting opcode bytes
    (opcodes or not), found in one C pass (``bytes.translate`` deleting them)."""
    raw = bytes(data) if isinstance(data, memoryview) else data
    return len(raw) - len(raw.translate(None, NESTING_OPCODES))


class _NeedMore(Exception):
    """The opcode being scanned continues past the bytes at hand: up to ``end`` at least."""

    def __init__(self, end: int) -> None:
        self.end = end


def _refuse(source: str, what: str) -> PickleLimitError:
    return PickleLimitError(f"{source}: pickle refused, over a limit: {what}")


class _Parser:
    """Steps over one opcode at a time, checking what the C unpickler would trust.

    ``data`` may be a window of the pickle: it starts ``base`` bytes in, and the whole pickle
    is ``total`` bytes long (default: ``data`` is all of it). An opcode running past the
    window but not past the pickle raises :class:`_NeedMore`."""

    def __init__(
        self,
        data: bytes | memoryview,
        limits: Limits,
        source: str,
        *,
        base: int = 0,
        total: int | None = None,
    ) -> None:
        self.data, self.limits, self.source = data, limits, source
        self.n = len(data)
        self.base = base
        self.total = self.n if total is None else total - base  # the pickle's end, in data
        self.frame_end = -1  # end of the current protocol-4 frame in data, -1 outside one

    def end(self) -> int:
        return self.frame_end if self.frame_end >= 0 else self.total

    def need(self, pos: int, size: int, op: int) -> None:
        """Bytes ``[pos, pos + size)`` must exist, inside the current frame if in one."""
        if pos + size > self.end():
            if self.frame_end >= 0:
                raise CorruptRecordError(
                    f"{self.source}: opcode 0x{op:02x} at {self.base + pos} straddles the end "
                    "of a frame"
                )
            raise CorruptRecordError(
                f"{self.source}: pickle data is truncated (at {self.base + pos})"
            )
        if pos + size > self.n:
            raise _NeedMore(pos + size)

    def step(self, pos: int) -> tuple[int, int, Any]:
        """``(opcode, next position, argument)`` of the opcode at ``pos``; the argument is the
        memo index of PUTs, the text lines of line opcodes, the payload length of counted ones.
        Fixed-size and counted opcodes (nearly all of a large pickle) are handled inline."""
        data, limits = self.data, self.limits
        if self.frame_end >= 0 and pos == self.frame_end:
            self.frame_end = -1
        op = data[pos]
        size = _FIXED.get(op)
        if size is not None:
            self.need(pos, size, op)
            if op == _LONG_BINPUT:
                index = int.from_bytes(data[pos + 1 : pos + 5], "little")
                self.check_memo(index, pos)
                return op, pos + size, index
            return op, pos + size, None
        counted = _COUNTED.get(op)
        if counted is not None:
            width, signed, is_int = counted
            self.need(pos, 1 + width, op)
            length = int.from_bytes(data[pos + 1 : pos + 1 + width], "little", signed=signed)
            if length < 0:
                raise CorruptRecordError(f"{self.source}: negative length at {self.base + pos}")
            if is_int and length > limits.max_int_bytes:
                raise _refuse(self.source, f"an integer of {length} bytes at {self.base + pos}")
            self.need(pos, 1 + width + length, op)
            return op, pos + 1 + width + length, length
        if op == _FRAME:
            return op, self.enter_frame(pos), None
        lines = _LINES.get(op)
        if lines is not None:
            return op, *self.read_lines(op, pos, lines)
        if op == _STOP:
            return op, pos + 1, None
        raise self.bad_opcode(op, pos)

    def enter_frame(self, pos: int) -> int:
        """Start the protocol-4 frame announced at ``pos``; the position after its header."""
        self.need(pos, 9, _FRAME)
        if self.frame_end >= 0:
            raise CorruptRecordError(f"{self.source}: frame inside a frame at {self.base + pos}")
        length = int.from_bytes(self.data[pos + 1 : pos + 9], "little")
        if pos + 9 + length > self.total:
            raise CorruptRecordError(f"{self.source}: pickle data is truncated (frame)")
        self.frame_end = pos + 9 + length
        return pos + 9

    def read_lines(self, op: int, pos: int, lines: int) -> tuple[int, list[bytes]]:
        """``(next position, lines)`` of the protocol-0 opcode at ``pos``; checks PUT's index."""
        data, found, at = self.data, [], pos + 1
        for _ in range(lines):
            line_end = min(at + _MAX_LINE, self.end())
            newline = bytes(data[at:line_end]).find(b"\n")
            if newline < 0:
                if line_end > self.n:  # the line may end in bytes not read yet
                    raise _NeedMore(self.n + 1)
                raise CorruptRecordError(f"{self.source}: unterminated line at {self.base + at}")
            found.append(bytes(data[at : at + newline]))
            at += newline + 1
        if op == _PUT:
            try:
                index = int(found[0])
            except ValueError as exc:
                raise CorruptRecordError(f"{self.source}: bad PUT at {self.base + pos}") from exc
            self.check_memo(index, pos)
        return at, found

    def bad_opcode(self, op: int, pos: int) -> PickleLimitError | CorruptRecordError:
        """The error for an opcode ckptkit refuses or that does not exist."""
        pos += self.base
        if op in _REFUSED:
            return _refuse(self.source, f"opcode {_REFUSED[op]} at {pos}")
        return CorruptRecordError(f"{self.source}: invalid pickle opcode 0x{op:02x} at {pos}")

    def check_memo(self, index: int, pos: int) -> None:
        # A pickler numbers memo entries 0, 1, 2…, one per PUT: never above the position.
        pos += self.base
        if index < 0 or index > min(self.limits.max_memo, pos):
            raise _refuse(self.source, f"memo index {index} at byte {pos}")


def scan(data: bytes | memoryview, limits: Limits, source: str) -> None:
    """Check every opcode of ``data`` up to STOP without building anything (see module doc)."""
    scan_pieces([data], limits, source)


def scan_pieces(pieces: Sequence[bytes | memoryview], limits: Limits, source: str) -> None:
    """:func:`scan` of the pickle that ``pieces`` make up when joined, without joining them:
    a window moves over the pieces, holding beyond the piece being scanned only an opcode
    that spans pieces (joined once it is whole), so a pickle read in pieces is scanned, then
    fed to the unpickler piece by piece, and never held twice."""
    total = sum(map(len, pieces))
    if total > limits.max_bytes:
        raise _refuse(source, f"{total} bytes (limit {limits.max_bytes})")
    remaining = iter(pieces)
    window: bytes | memoryview = b""
    base = pos = 0  # the window's offset in the pickle; the next opcode's in the window
    frame_end, want = -1, 1  # want: bytes from pos on that the next opcode needs
    while True:
        parts = [window[pos:]] if pos < len(window) else []
        have = len(window) - pos
        for piece in remaining:
            parts.append(piece)
            have += len(piece)
            if have >= want:
                break
        if have < want or not parts:
            raise CorruptRecordError(f"{source}: pickle data is truncated (no STOP)")
        window = parts[0] if len(parts) == 1 else b"".join(parts)
        base, frame_end = base + pos, frame_end - pos if frame_end >= 0 else -1
        parser = _Parser(window, limits, source, base=base, total=total)
        parser.frame_end = frame_end
        pos = 0
        try:
            while True:
                pos = _SKIP(window, pos, parser.end()).end()
                if pos >= parser.n:
                    raise _NeedMore(parser.n + 1)
                op, after, _ = parser.step(pos)
                if op == _STOP:
                    return
                pos = after
        except _NeedMore as more:  # pos: where the unfinished opcode starts
            frame_end, want = parser.frame_end, more.end - pos


# --------------------------------------------------------------------------------------------
# Simulation: the unpickler's stack with each object reduced to how deep its tuples nest.

#: How a global behaves when called (REDUCE, NEWOBJ…), for tuple nesting.
ATOM, TUPLE, PASS, UNKNOWN = "atom", "tuple", "pass", "unknown"


class _Cell:
    """One simulated object: tuple nesting ``t`` (0 for non-tuples), its elements' cells
    (containers; None for atoms), the call kind of a global, the text of a short string."""

    __slots__ = ("t", "items", "kind", "value")

    def __init__(self, t: int = 0, items: list | tuple | None = None) -> None:
        self.t, self.items, self.kind, self.value = t, items, None, None


_ATOM_CELL = _Cell()


class _Simulation:
    def __init__(
        self,
        data: bytes | memoryview,
        limits: Limits,
        source: str,
        classify: Callable[[str, str], str],
    ) -> None:
        self.parser = _Parser(data, limits, source)
        self.limits, self.source, self.classify = limits, source, classify
        self.stack: list[_Cell] = []
        self.marks: list[int] = []
        self.memo: dict[int, _Cell] = {}
        self.budget = 8 * len(data) + 4096  # element copies the simulation may make

    def fail(self, what: str) -> CorruptRecordError:
        return CorruptRecordError(f"{self.source}: malformed pickle: {what}")

    def pop(self, n: int = 1) -> list[_Cell]:
        fence = self.marks[-1] if self.marks else 0
        if len(self.stack) - n < fence:
            raise self.fail("stack underflow")
        items = self.stack[len(self.stack) - n :]
        del self.stack[len(self.stack) - n :]
        return items

    def pop_mark(self) -> list[_Cell]:
        if not self.marks:
            raise self.fail("no MARK")
        start = self.marks.pop()
        items = self.stack[start:]
        del self.stack[start:]
        return items

    def top(self) -> _Cell:
        fence = self.marks[-1] if self.marks else 0
        if len(self.stack) <= fence:
            raise self.fail("stack underflow")
        return self.stack[-1]

    def tuple_cell(self, items: list[_Cell]) -> _Cell:
        t = 1 + max((c.t for c in items), default=0)
        if t > self.limits.max_tuple_depth:
            raise _refuse(
                self.source, f"tuples nested more than {self.limits.max_tuple_depth} deep"
            )
        self.spend(len(items))
        return _Cell(t, tuple(items))

    def spend(self, n: int) -> None:
        self.budget -= n
        if self.budget < 0 or n > self.limits.max_items:
            raise _refuse(self.source, "containers larger than the input can describe")

    def add(self, target: _Cell, items: list[_Cell]) -> None:
        if isinstance(target.items, list):
            self.spend(len(items))
            target.items.extend(items)
            if len(target.items) > self.limits.max_items:
                raise _refuse(self.source, f"a container of over {self.limits.max_items} items")

    def call(self, func: _Cell, args: list[_Cell]) -> _Cell:
        kind = func.kind or UNKNOWN
        if kind == ATOM:
            return _Cell(0, [])
        if kind == PASS and args:
            return args[0]
        # tuple(x) holds x's elements; an unknown stand-in may return an argument or a tuple of
        # an argument's elements: bound both.
        inner = args if kind == UNKNOWN else args[:1]
        elements: list[_Cell] = []
        for arg in inner:
            if arg.items is not None:
                elements.extend(arg.items)
        if kind == UNKNOWN:
            elements.extend(args)
        self.spend(len(elements))
        return self.tuple_cell(elements)

    def run(self) -> None:
        parser, handlers = self.parser, _HANDLERS
        pos = 0
        while True:
            if pos >= parser.n:
                raise CorruptRecordError(f"{self.source}: pickle data is truncated (no STOP)")
            op, pos, arg = parser.step(pos)
            if op == _STOP:
                return
            handler = handlers.get(op)
            if handler is not None:  # PROTO, FRAME: nothing to simulate
                handler(self, op, pos, arg)

    # One handler per kind of opcode, called as ``handler(self, op, position after the opcode,
    # argument from the parser)``; :data:`_HANDLERS` maps each opcode to its handler.

    def push_atom(self, op: int, pos: int, arg: Any) -> None:
        """Numbers, booleans, None and protocol-0 strings: never tuples."""
        self.stack.append(_ATOM_CELL)

    def push_counted(self, op: int, pos: int, arg: Any) -> None:
        """Strings, bytes and long integers; short unicode strings keep their text (module and
        name of a STACK_GLOBAL)."""
        cell = _Cell()
        if op in (0x8C, ord("X")) and arg <= 256:
            cell.value = bytes(self.parser.data[pos - arg : pos]).decode("utf-8", "replace")
        self.stack.append(cell)

    def binpersid(self, op: int, pos: int, arg: Any) -> None:
        self.pop()
        self.stack.append(_ATOM_CELL)

    def memo_put(self, op: int, pos: int, arg: Any) -> None:
        """BINPUT, LONG_BINPUT, PUT, MEMOIZE."""
        c = chr(op)
        index = (
            len(self.memo)
            if op == 0x94
            else self.parser.data[pos - 1]
            if c == "q"
            else arg
            if c == "r"
            else int(arg[0])
        )
        self.memo[index] = self.top()

    def memo_get(self, op: int, pos: int, arg: Any) -> None:
        """BINGET, LONG_BINGET, GET."""
        data, c = self.parser.data, chr(op)
        index = data[pos - 1] if c == "h" else int(arg[0]) if c == "g" else None
        if c == "j":
            index = int.from_bytes(data[pos - 4 : pos], "little")
        if index not in self.memo:
            raise self.fail(f"memo index {index} was never set")
        self.stack.append(self.memo[index])

    def dup(self, op: int, pos: int, arg: Any) -> None:
        self.stack.append(self.top())

    def pop_top(self, op: int, pos: int, arg: Any) -> None:
        """POP: the top item, or the topmost MARK when none is above it."""
        fence = self.marks[-1] if self.marks else 0
        if len(self.stack) > fence:
            self.stack.pop()
        elif self.marks:
            self.marks.pop()
        else:
            raise self.fail("stack underflow")

    def pop_to_mark(self, op: int, pos: int, arg: Any) -> None:
        self.pop_mark()

    def mark(self, op: int, pos: int, arg: Any) -> None:
        self.marks.append(len(self.stack))

    def empty_container(self, op: int, pos: int, arg: Any) -> None:
        """EMPTY_LIST, EMPTY_DICT, EMPTY_SET."""
        self.stack.append(_Cell(0, []))

    def empty_tuple(self, op: int, pos: int, arg: Any) -> None:
        self.stack.append(_Cell(1, ()))

    def append(self, op: int, pos: int, arg: Any) -> None:
        (item,) = self.pop()
        self.add(self.top(), [item])

    def setitem(self, op: int, pos: int, arg: Any) -> None:
        items = self.pop(2)
        self.add(self.top(), items)

    def add_marked(self, op: int, pos: int, arg: Any) -> None:
        """APPENDS, SETITEMS, ADDITEMS."""
        items = self.pop_mark()
        self.add(self.top(), items)

    def build_container(self, op: int, pos: int, arg: Any) -> None:
        """LIST, DICT, FROZENSET (hashes are cached per element: no tuple depth)."""
        items = self.pop_mark()
        self.spend(len(items))
        self.stack.append(_Cell(0, items))

    def build_tuple(self, op: int, pos: int, arg: Any) -> None:
        self.stack.append(self.tuple_cell(self.pop_mark()))

    def build_small_tuple(self, op: int, pos: int, arg: Any) -> None:
        """TUPLE1, TUPLE2, TUPLE3."""
        self.stack.append(self.tuple_cell(self.pop(op - 0x84)))

    def reduce(self, op: int, pos: int, arg: Any) -> None:
        """REDUCE, NEWOBJ."""
        func, args = self.pop(2)
        self.stack.append(self.call(func, list(args.items or ())))

    def newobj_ex(self, op: int, pos: int, arg: Any) -> None:
        cls, args, kwargs = self.pop(3)
        self.stack.append(self.call(cls, [*(args.items or ()), *(kwargs.items or ())]))

    def obj(self, op: int, pos: int, arg: Any) -> None:
        items = self.pop_mark()
        if not items:
            raise self.fail("OBJ without a class")
        self.stack.append(self.call(items[0], items[1:]))

    def inst(self, op: int, pos: int, arg: Any) -> None:
        items = self.pop_mark()
        func = _Cell()
        func.kind = self.classify(arg[0].decode("latin-1"), arg[1].decode("latin-1"))
        self.stack.append(self.call(func, items))

    def global_(self, op: int, pos: int, arg: Any) -> None:
        """GLOBAL, STACK_GLOBAL: a callable classified by module and name."""
        if op == ord("c"):
            module, name = (line.decode("latin-1") for line in arg)
        else:
            module_cell, name_cell = self.pop(2)
            module, name = module_cell.value, name_cell.value
        func = _Cell()
        func.kind = (
            self.classify(module, name)
            if isinstance(module, str) and isinstance(name, str)
            else UNKNOWN
        )
        self.stack.append(func)

    def build(self, op: int, pos: int, arg: Any) -> None:
        """BUILD: state goes into an object, not into a tuple."""
        self.pop()
        self.top()


def _handlers(groups: dict[bytes, Callable[..., None]]) -> dict[int, Callable[..., None]]:
    table: dict[int, Callable[..., None]] = {}
    for opcodes, handler in groups.items():
        for op in opcodes:
            if op in table:
                raise AssertionError(f"opcode 0x{op:02x} has two handlers")
            table[op] = handler
    return table


_S = _Simulation
#: Opcode → :class:`_Simulation` handler; PROTO and FRAME have none (no stack effect).
_HANDLERS = _handlers(
    {
        b"KMJGILFN\x88\x89SVP": _S.push_atom,
        bytes(_COUNTED): _S.push_counted,
        b"Q": _S.binpersid,
        b"qrp\x94": _S.memo_put,
        b"hjg": _S.memo_get,
        b"2": _S.dup,
        b"0": _S.pop_top,
        b"1": _S.pop_to_mark,
        b"(": _S.mark,
        b"]}\x8f": _S.empty_container,
        b")": _S.empty_tuple,
        b"a": _S.append,
        b"s": _S.setitem,
        b"eu\x90": _S.add_marked,
        b"ld\x91": _S.build_container,
        b"t": _S.build_tuple,
        b"\x85\x86\x87": _S.build_small_tuple,
        b"R\x81": _S.reduce,
        b"\x92": _S.newobj_ex,
        b"o": _S.obj,
        b"i": _S.inst,
        b"c\x93": _S.global_,
        b"b": _S.build,
    }
)
del _S


def simulate(
    data: bytes | memoryview, limits: Limits, source: str, classify: Callable[[str, str], str]
) -> None:
    """:func:`scan` plus the stack effect of every opcode, refusing tuples nested deeper than
    ``limits.max_tuple_depth`` and containers larger than the input could describe.
    ``classify(module, name)`` says how a global behaves when called (ATOM, TUPLE, PASS…)."""
    if len(data) > limits.max_bytes:
        raise _refuse(source, f"{len(data)} bytes (limit {limits.max_bytes})")
    _Simulation(data, limits, source, classify).run()


# --------------------------------------------------------------------------------------------
# Loading on a thread with a stack sized for the input.

#: C stack one level of tuple hashing takes (measured ~64 bytes on CPython 3.11 x86-64) × 2.
_STACK_PER_LEVEL = 128
_BASE_STACK = 16 << 20
_MAX_STACK = 4 << 30
_stack_lock = threading.Lock()


def run_with_stack(levels: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` on a thread whose C stack holds ``levels`` nested tuple hashes (the caller's
    thread when few enough). A pickle too large for that is refused."""
    if levels <= 1000:
        return fn()
    size = _BASE_STACK + levels * _STACK_PER_LEVEL
    if size > _MAX_STACK:
        raise PickleLimitError(
            f"pickle has {levels} nesting opcodes: too many to load with a bounded stack"
        )
    outcome: list[Any] = [None, None]

    def target() -> None:
        try:
            outcome[0] = fn()
        except BaseException as exc:  # handed back to the calling thread
            outcome[1] = exc

    with _stack_lock:
        previous = threading.stack_size(size)
        try:
            thread = threading.Thread(target=target, name="ckptkit-unpickle", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if outcome[1] is not None:
        raise outcome[1]
    return outcome[0]


# --------------------------------------------------------------------------------------------
# The loaded value.

_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), range, np.generic)


def check_value(
    value: Any, limits: Limits, source: str, children: Callable[[Any], Any] | None = None
) -> None:
    """Walk ``value`` once, without recursion, refusing cycles (but those through an object when
    ``limits.object_cycles``), nesting deeper than ``limits.max_depth``, containers or tree sizes
    beyond ``limits.max_items``, huge ints and numpy object arrays. ``children(obj)`` lists what
    else to descend into (placeholders). A reference back to a node on the current path counts
    as a leaf, so the walk and its sizes stay bounded with cycles too."""
    done = _Finished(limits, source)
    path = _Path()
    stack: list[tuple[Any, list[Any] | None]] = [(value, None)]
    while stack:
        obj, kids = stack[-1]
        if kids is None:
            if id(obj) in done.heights:
                stack.pop()
                continue
            kids = _children(obj, limits, source, children)
            if kids:
                pending = path.descend(obj, kids, done.heights, limits, source)
                if pending is None:  # obj is on the path already: a cycle, allowed
                    stack.pop()
                    continue
                stack[-1] = (obj, kids)
                if pending:
                    stack.extend(zip(pending, repeat(None)))
                    continue
        stack.pop()
        if kids:
            path.leave(id(obj))
        done.add(obj, kids)
    _check_sharing(done.sizes.get(id(value), 1), len(done.sizes), source)


class _Finished:
    """Measures of the nodes :func:`check_value` has finished, by id; a kid not among them is
    a reference back up the path and counts as a leaf."""

    def __init__(self, limits: Limits, source: str) -> None:
        self.limits, self.source = limits, source
        self.heights: dict[int, int] = {}  # id → height
        self.tuple_heights: dict[int, int] = {}  # id → tuples nested in tuples (hashing recurses)
        self.sizes: dict[int, int] = {}  # id → nodes of the subtree counted as a tree
        self.keep: list[Any] = []  # ids stay valid while their objects live

    def add(self, obj: Any, kids: list[Any]) -> None:
        key, limits = id(obj), self.limits
        heights, sizes = self.heights, self.sizes
        heights[key] = 1 + max((heights.get(id(k), 0) for k in kids), default=-1) if kids else 0
        if heights[key] > limits.max_depth:  # shared parts can nest deeper than the walk went
            raise _refuse(self.source, f"values nested more than {limits.max_depth} deep")
        if isinstance(obj, tuple):
            depth = 1 + max((self.tuple_heights.get(id(k), 0) for k in kids), default=0)
            self.tuple_heights[key] = depth
            if depth > limits.max_tuple_depth:
                raise _refuse(self.source, f"tuples nested more than {limits.max_tuple_depth} deep")
        size = 1 + sum(sizes.get(id(k), 1) for k in kids) if kids else 1
        if size > limits.max_items:
            raise _refuse(self.source, f"a value of over {limits.max_items} nodes (shared parts)")
        sizes[key] = size
        self.keep.append(obj)


_CONTAINERS = (dict, list, tuple, set, frozenset)


class _Path:
    """The nodes from the root to the one being walked, with how many of them are objects
    (not builtin containers) up to each position, to tell a cycle through an object."""

    def __init__(self) -> None:
        self.index: dict[int, int] = {}  # id → position on the path
        self.objects: list[int] = [0]  # objects among the first i nodes
        self.nodes: list[Any] = []

    def descend(
        self, obj: Any, kids: list[Any], finished: dict[int, int], limits: Limits, source: str
    ) -> list[Any] | None:
        """Put ``obj`` on the path and return its kids still to walk (a kid on the path is a
        cycle: checked, not walked); None when ``obj`` itself is on the path already."""
        if id(obj) in self.index:
            self.cycle(id(obj), limits, source)
            return None
        self.enter(obj)
        if len(self.index) > limits.max_depth:
            raise _refuse(source, f"values nested more than {limits.max_depth} deep")
        pending = []
        for kid in kids:
            if id(kid) in self.index:
                self.cycle(id(kid), limits, source, kid)
            elif id(kid) not in finished:
                pending.append(kid)
        return pending

    def enter(self, obj: Any) -> None:
        self.index[id(obj)] = len(self.nodes)
        self.nodes.append(obj)
        self.objects.append(self.objects[-1] + (not isinstance(obj, _CONTAINERS)))

    def leave(self, key: int) -> None:
        del self.index[key]
        self.nodes.pop()
        self.objects.pop()

    def cycle(self, key: int, limits: Limits, source: str, kid: Any = None) -> None:
        """A reference (``kid`` of the last node) back to the node ``key`` on the path: allowed
        when the loop passes through an object and ``limits.object_cycles``, else refused
        naming where it is."""
        start = self.index[key]
        if limits.object_cycles and self.objects[-1] - self.objects[start] > 0:
            return
        raise CorruptRecordError(
            f"{source}: the pickle holds a reference cycle at {self.where(start, kid)}"
        )

    def where(self, start: int, kid: Any) -> str:
        """The loop as a path of keys: ``<value>['a'][0], which refers back to <value>['a']``."""
        steps = ["<value>"]
        for parent, child in zip(self.nodes, [*self.nodes[1:], kid], strict=False):
            steps.append(_step(parent, child))
        return f"{''.join(steps)}, which refers back to {''.join(steps[: start + 1])}"


def _step(parent: Any, child: Any) -> str:
    if isinstance(parent, dict):
        found = next((k for k, v in parent.items() if v is child), "?")
        return f"[{found!r}]"
    if isinstance(parent, list | tuple):
        found = next((i for i, v in enumerate(parent) if v is child), "?")
        return f"[{found}]"
    return f".<{type(parent).__name__}>"


def _check_sharing(tree: int, objects: int, source: str) -> None:
    """Refuse a value of ``objects`` distinct objects that unfolds into ``tree`` nodes.

    Shared parts are walked once by :func:`check_value` but once per reference by recursive
    code (repr, DCP flattening, ``_materialize``): a DAG of lists sharing halves is exponential
    for them."""
    if tree > 16 * objects + (1 << 20):
        raise _refuse(
            source, f"{objects} objects shared so often that they unfold into {tree} nodes"
        )


def _children(
    obj: Any, limits: Limits, source: str, children: Callable[[Any], Any] | None
) -> list[Any]:
    if isinstance(obj, bool) or obj is None:
        return []
    if isinstance(obj, int):
        if obj.bit_length() > 8 * limits.max_int_bytes:
            raise _refuse(source, f"an integer of {obj.bit_length()} bits")
        return []
    if isinstance(obj, (*_ATOMS, type)) or callable(obj):
        return []
    if isinstance(obj, np.ndarray | np.dtype):
        dt = obj.dtype if isinstance(obj, np.ndarray) else obj
        if dt.hasobject:
            raise PickleLimitError(f"{source}: numpy object arrays are not allowed")
        return []
    if isinstance(obj, dict):
        items = [*obj.keys(), *obj.values()]
    elif isinstance(obj, list | tuple | set | frozenset):
        items = list(obj)
    elif isinstance(obj, slice):
        items = [obj.start, obj.stop, obj.step]
    else:
        items = _object_children(obj, children)
    if len(items) > limits.max_items:
        raise _refuse(source, f"a container of {len(items)} items")
    return items


def _object_children(obj: Any, children: Callable[[Any], Any] | None) -> list[Any]:
    """What an object other than a builtin container refers to: ``children(obj)`` when it says,
    else its attributes (``__dict__`` or ``__slots__``)."""
    extra = children(obj) if children is not None else None
    if extra is not None:
        return list(extra)
    if hasattr(obj, "__dict__"):
        return list(vars(obj).values())
    return [getattr(obj, s, None) for s in getattr(type(obj), "__slots__", ())]
