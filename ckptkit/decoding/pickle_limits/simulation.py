"""The stack simulation: the unpickler's stack with each object reduced to how deep its tuples
nest, run over small pickles before loading them to bound tuple nesting exactly (hashing a
tuple recurses through its nesting without a guard)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...errors import CorruptRecordError
from .limits import Limits, limit_error
from .opcodes import COUNTED, STOP, OpcodeParser

__all__ = ["ATOM", "PASS", "TUPLE", "UNKNOWN", "simulate"]


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
        self.parser = OpcodeParser(data, limits, source)
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
            raise limit_error(
                self.source, f"tuples nested more than {self.limits.max_tuple_depth} deep"
            )
        self.spend(len(items))
        return _Cell(t, tuple(items))

    def spend(self, n: int) -> None:
        self.budget -= n
        if self.budget < 0 or n > self.limits.max_items:
            raise limit_error(self.source, "containers larger than the input can describe")

    def add(self, target: _Cell, items: list[_Cell]) -> None:
        if isinstance(target.items, list):
            self.spend(len(items))
            target.items.extend(items)
            if len(target.items) > self.limits.max_items:
                raise limit_error(self.source, f"a container of over {self.limits.max_items} items")

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
            if op == STOP:
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
        bytes(COUNTED): _S.push_counted,
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
        raise limit_error(source, f"{len(data)} bytes (limit {limits.max_bytes})")
    _Simulation(data, limits, source, classify).run()
