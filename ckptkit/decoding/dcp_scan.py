"""A purpose-built decoder for DCP ``.metadata`` pickles: the records DCP writes once per chunk
come out as numpy columns, everything else as the allowlisting unpickler would build it.

A DCP ``.metadata`` at scale is ~130 bytes of pickle per chunk in two repetitive shapes: each
tensor's list of ``ChunkStorageMetadata(offsets, sizes)`` and the ``storage_data`` dict of
``MetadataIndex(fqn, index, offset) → _StorageInfo(relative_path, offset, length,
[transform_descriptors])``. Unpickled, each becomes ~15 Python objects that the unpickler's memo
keeps alive to the end (4 s and 600 MiB at 512k chunks). :func:`scan_dcp_metadata` instead:

* runs a small opcode machine in Python over the pickle, building what it meets with the
  caller's allowlist exactly as :func:`~ckptkit.decoding.unpickler.safe_loads` would (same
  stand-ins, same calls, same memo), for the parts that are not per chunk;
* once the machine has met the first record of a repetitive shape (and so knows the memo
  indices of its class, of its field names and of ``torch.Size``), finds every later record of
  that shape with one literal search and decodes them all at once with numpy over a matrix of
  their bytes (:class:`_Rows`), checking every byte the unpickler would read; the machine then
  steps over each run of consecutive records in one go, pushing a :class:`ChunkRun` (into the
  list) or :class:`StorageRun` (into the dict) that stands for those rows of the columns.

It accepts only what it understands exactly: the opcodes protocol 2-5 pickles of DCP metadata
use, globals in the allowlist (never imported), sequential memo indices, records in the shapes
torch 2.x, OLMo-core and Megatron-core write. Anything else — an unknown opcode or global, a
stand-in raising, an odd stack, more generic work than the columns save — raises
:class:`ScanDeclined`, and the caller loads the file with the allowlisting unpickler instead,
which then gives the result (or the typed error naming the file) that the scan would have to.
It never raises anything else for what the bytes say, and bounds its work and memory by the
input (and :class:`~ckptkit.decoding.pickle_limits.Limits`). One limit it does not share: the
unpickler refuses a pickle with more tuple-building opcode bytes than a bounded C stack could
hash (~33 M: DCP metadata of ~2.7 M chunks); the scan builds no tuple deeper than
``_MAX_TUPLE_DEPTH`` and reads such metadata.

Longer than most: the opcode machine, the two record readers and the checks that make their
columns mean exactly what the unpickler builds are one contract, read together.
"""

from __future__ import annotations

import bisect
import re
import struct
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .pickle_limits import Limits
from .unpickler import python3_name

__all__ = [
    "ChunkColumns",
    "ChunkRun",
    "ColumnClasses",
    "ScanDeclined",
    "ScanResult",
    "StorageColumns",
    "StorageRun",
    "scan_dcp_metadata",
]


class ScanDeclined(Exception):
    """The scan does not understand this pickle exactly (``reason`` says what): load it with
    the allowlisting unpickler instead. Not an error of the checkpoint."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class ColumnClasses:
    """The allowlist's stand-ins for the three classes DCP pickles once per chunk: records of
    these (in the shapes torch writes) become columns instead of objects."""

    chunk: type  # ChunkStorageMetadata(offsets, sizes)
    index: type  # MetadataIndex(fqn, index, offset)
    storage: type  # _StorageInfo(relative_path, offset, length, transform_descriptors)


class ChunkRun:
    """Stands, in a list the scan built, for the chunks of rows ``[start, stop)`` of
    :attr:`ScanResult.chunks`, in order (each one ``ChunkStorageMetadata`` of the pickle)."""

    __slots__ = ("start", "stop")

    def __init__(self) -> None:
        self.start = self.stop = 0

    def __repr__(self) -> str:
        return f"ChunkRun({self.start}, {self.stop})"


class StorageRun:
    """Stands, as a key of a dict the scan built (its value None), for the ``MetadataIndex →
    _StorageInfo`` items of rows ``[start, stop)`` of :attr:`ScanResult.storage`, in order."""

    __slots__ = ("start", "stop")

    def __init__(self) -> None:
        self.start = self.stop = 0

    def __repr__(self) -> str:
        return f"StorageRun({self.start}, {self.stop})"


@dataclass
class ChunkColumns:
    """``ChunkStorageMetadata`` records as columns, one row each: ``offsets`` and ``sizes``
    (int64, ``(rows, widest)``, zero past each row's own length ``*_ndim``)."""

    offsets: np.ndarray
    offsets_ndim: np.ndarray
    sizes: np.ndarray
    sizes_ndim: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets_ndim)


@dataclass
class StorageColumns:
    """``storage_data`` items as columns, one row each. Strings are codes into
    :attr:`ScanResult.strings`. ``index`` is the ``MetadataIndex.index`` (``index_none``: it was
    None); ``offsets`` the index's chunk offsets (``offsets_ndim`` -1: None or not given);
    ``file``, ``offset``, ``length`` the ``_StorageInfo``; ``transform`` the one transform
    descriptor (-1: none, None or an empty list)."""

    fqn: np.ndarray
    index: np.ndarray
    index_none: np.ndarray
    offsets: np.ndarray
    offsets_ndim: np.ndarray
    file: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    transform: np.ndarray

    def __len__(self) -> int:
        return len(self.fqn)


@dataclass
class ScanResult:
    """What the pickle holds: ``value`` as the allowlist's stand-ins built it, except that runs
    of per-chunk records are :class:`ChunkRun` / :class:`StorageRun` markers into the columns."""

    value: Any
    chunks: ChunkColumns
    storage: StorageColumns
    strings: list[str]
    #: records of the columns that a later opcode also named (Megatron's save plans name the
    #: chunks), built as objects there; the rows stay the records of ``state_dict_metadata``
    row_objects: list[Any]
    #: memo entries the pickle made, those of the column records included (a check: the
    #: pickle's MEMOIZE and PUT opcodes)
    memo_entries: int


def scan_dcp_metadata(
    data: bytes,
    *,
    allow: Mapping[str, Any],
    classes: ColumnClasses,
    limits: Limits,
    source: str,
    generic_budget: int = 50_000,
) -> ScanResult:
    """Decode the DCP metadata pickle ``data`` (see the module doc), resolving globals only
    through ``allow`` (a ``torch.Size`` global must be ``tuple``, as in the allowlists here).
    ``generic_budget``: opcodes decoded one by one before the scan declines a pickle whose
    records are mostly not in column shapes (the unpickler is faster at those). Raises
    :class:`ScanDeclined` for anything it does not decode exactly; ``source`` names the file in
    its reason."""
    if len(data) > limits.max_bytes:
        raise ScanDeclined(f"{source}: larger than the metadata limit")
    machine = _Machine(data, allow, classes, limits, source, generic_budget)
    try:
        return machine.finish(machine.run())
    except ScanDeclined:
        raise
    except Exception as exc:  # numpy or a stand-in on bytes the readers did not foresee
        raise ScanDeclined(f"{source}: {type(exc).__name__} while scanning") from exc
    finally:
        machine.close()  # its readers point back at it: no cycle left for a paused GC


# --------------------------------------------------------------------------------------------
# The opcode machine: the generic part, decoded object by object with the caller's stand-ins.


class _Function:
    """An allowlisted plain function as the machine holds it (the unpickler seals those):
    callable by REDUCE, an argument of one, or held in the memo; any other use declines."""

    __slots__ = ("function",)

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function


class _Arguments(tuple):
    """A tuple holding an allowlisted function: only REDUCE may take it (as its arguments)."""

    __slots__ = ()


_RUNS = (ChunkRun, StorageRun)
_MISSING = object()
#: Values that may sit on the machine's stack but not inside what it builds.
_SPECIAL = frozenset({ChunkRun, StorageRun, _Function, _Arguments})
#: Tuples nested deeper than this decline (the unpickler's limit is far above what DCP writes).
_MAX_TUPLE_DEPTH = 4
#: Field names whose memo indices the column readers need.
_NAMES = frozenset(
    {
        "offsets",
        "sizes",
        "fqn",
        "index",
        "offset",
        "relative_path",
        "length",
        "transform_descriptors",
    }
)


def _tuple_depth(value: tuple, limit: int) -> int:
    """How deep tuples nest in ``value`` (a tuple is 1), counted up to ``limit + 1``."""
    inner = 0
    if limit > 0:
        for item in value:
            if type(item) is tuple and item:
                inner = max(inner, _tuple_depth(item, limit - 1))
    else:
        inner = any(type(item) is tuple and item for item in value)
    return 1 + inner


class _Machine:
    """The unpickler's stack machine for the opcode subset DCP metadata uses, with the memo
    indices of the column readers' vocabulary noted as they are memoized."""

    def __init__(
        self,
        data: bytes,
        allow: Mapping[str, Any],
        classes: ColumnClasses,
        limits: Limits,
        source: str,
        budget: int,
    ) -> None:
        self.data, self.allow, self.limits, self.source = data, allow, limits, source
        self.classes = classes
        self.budget = budget
        self.memo: dict[int, Any] = {}
        self.memo_len = 0
        self.vocab: dict[str, int] = {}
        self.roles: dict[Any, str] = {
            classes.chunk: "ChunkStorageMetadata",
            classes.index: "MetadataIndex",
            classes.storage: "_StorageInfo",
            tuple: "Size",
        }
        self.named: set[tuple[str, str]] = set()
        self.functions: dict[Callable[..., Any], _Function] = {}
        self.instance_types = frozenset(
            v for v in allow.values() if isinstance(v, type) and v is not tuple
        )
        self.callable_types = self.instance_types | {tuple}
        self.readers: dict[type, _Reader] = {
            classes.chunk: _ChunkReader(self),
            classes.index: _PairReader(self),
        }
        #: where a run of column records starts → its reader and rows
        self.runs: dict[int, tuple[_Reader, _Found, int, int]] = {}
        #: the runs taken, in order, and the memo index each one's entries start at
        self.taken: list[tuple[_Reader, _Found, int, int, int]] = []
        self.taken_starts: list[int] = []
        #: objects built from column rows because a later opcode named them
        self.row_objects: list[Any] = []
        self.bulk_rows = 0

    def decline(self, why: str) -> ScanDeclined:
        return ScanDeclined(f"{self.source}: {why}")

    def close(self) -> None:
        """Let go of the pickle, the memo and the searches (callers keep the GC paused)."""
        self.readers.clear()
        self.runs.clear()
        self.taken.clear()
        self.memo.clear()
        self.data = b""

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> Any:  # noqa: C901, PLR0912, PLR0915 (one opcode per branch, hot)
        """Decode up to STOP; the value on the stack then."""
        data, memo, decline = self.data, self.memo, self.decline
        n = len(data)
        if n < 3 or data[0] != 0x80 or data[1] > 5:
            raise decline("not a protocol 2-5 pickle")
        stack: list[Any] = []
        marks: list[int] = []
        pos, end, frame_end = 2, n, -1
        steps, checkpoint = 0, 1 << 14
        special = _SPECIAL
        while True:
            if pos == frame_end:
                frame_end, end = -1, n
            if pos >= end:
                raise decline("truncated")
            op = data[pos]
            steps += 1
            if steps >= checkpoint:
                self.check_budget(steps)
                checkpoint += 1 << 14
            if op == 0x94:  # MEMOIZE
                if len(stack) <= (marks[-1] if marks else 0):
                    raise decline("MEMOIZE on an empty stack")
                self.put(stack[-1])
                pos += 1
            elif op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
                found = self.runs.get(pos)
                if found is not None and (after := self.take(found, stack, end)):
                    pos = after
                    continue
                if op == 0x68:
                    if pos + 2 > end:
                        raise decline("truncated")
                    index = data[pos + 1]
                    width = 2
                else:
                    if pos + 5 > end:
                        raise decline("truncated")
                    index = int.from_bytes(data[pos + 1 : pos + 5], "little")
                    width = 5
                value = memo.get(index, _MISSING)
                if value is _MISSING:
                    value = self.column_value(index)
                if type(value) is type and value in self.readers and self.search(value, pos):
                    found = self.runs.get(pos)
                    if found is not None and (after := self.take(found, stack, end)):
                        pos = after
                        continue
                stack.append(value)
                pos += width
            elif op == 0x8C:  # SHORT_BINUNICODE
                if pos + 2 > end or pos + 2 + data[pos + 1] > end:
                    raise decline("truncated")
                size = data[pos + 1]
                stack.append(self.text(pos + 2, size))
                pos += 2 + size
            elif op == 0x28:  # MARK
                marks.append(len(stack))
                pos += 1
            elif op == 0x4B:  # BININT1
                if pos + 2 > end:
                    raise decline("truncated")
                stack.append(data[pos + 1])
                pos += 2
            elif op == 0x4D:  # BININT2
                if pos + 3 > end:
                    raise decline("truncated")
                stack.append(data[pos + 1] | data[pos + 2] << 8)
                pos += 3
            elif op == 0x4A:  # BININT
                if pos + 5 > end:
                    raise decline("truncated")
                stack.append(int.from_bytes(data[pos + 1 : pos + 5], "little", signed=True))
                pos += 5
            elif 0x85 <= op <= 0x87:  # TUPLE1-3
                size = op - 0x84
                if len(stack) - size < (marks[-1] if marks else 0):
                    raise decline("stack underflow")
                items = stack[-size:]
                del stack[-size:]
                stack.append(self.tuple(items))
                pos += 1
            elif op == 0x74:  # TUPLE
                if not marks:
                    raise decline("TUPLE without MARK")
                start = marks.pop()
                items = stack[start:]
                del stack[start:]
                stack.append(self.tuple(items))
                pos += 1
            elif op == 0x29:  # EMPTY_TUPLE
                stack.append(())
                pos += 1
            elif op == 0x7D:  # EMPTY_DICT
                stack.append({})
                pos += 1
            elif op == 0x5D:  # EMPTY_LIST
                stack.append([])
                pos += 1
            elif op == 0x4E:  # NONE
                stack.append(None)
                pos += 1
            elif op == 0x88 or op == 0x89:  # NEWTRUE, NEWFALSE
                stack.append(op == 0x88)
                pos += 1
            elif op == 0x75:  # SETITEMS
                self.setitems(stack, marks)
                pos += 1
            elif op == 0x73:  # SETITEM
                fence = marks[-1] if marks else 0
                if len(stack) - 3 < fence:
                    raise decline("stack underflow")
                value = stack.pop()
                key = stack.pop()
                self.setitem(stack[-1], key, value)
                pos += 1
            elif op == 0x65:  # APPENDS
                if not marks:
                    raise decline("APPENDS without MARK")
                start = marks.pop()
                if start <= (marks[-1] if marks else 0):
                    raise decline("stack underflow")
                items = stack[start:]
                del stack[start:]
                self.extend(stack[-1], items)
                pos += 1
            elif op == 0x61:  # APPEND
                if len(stack) - 2 < (marks[-1] if marks else 0):
                    raise decline("stack underflow")
                item = stack.pop()
                self.extend(stack[-1], [item])
                pos += 1
            elif op == 0x62:  # BUILD
                if len(stack) - 2 < (marks[-1] if marks else 0):
                    raise decline("stack underflow")
                state = stack.pop()
                self.build(stack[-1], state)
                pos += 1
            elif op == 0x81 or op == 0x52:  # NEWOBJ, REDUCE
                if len(stack) - 2 < (marks[-1] if marks else 0):
                    raise decline("stack underflow")
                args = stack.pop()
                func = stack.pop()
                stack.append(self.newobj(func, args) if op == 0x81 else self.reduce(func, args))
                pos += 1
            elif op == 0x93:  # STACK_GLOBAL
                if len(stack) - 2 < (marks[-1] if marks else 0):
                    raise decline("stack underflow")
                name = stack.pop()
                module = stack.pop()
                if type(module) is not str or type(name) is not str:
                    raise decline("STACK_GLOBAL of non-strings")
                stack.append(self.global_(module, name))
                pos += 1
            elif op == 0x95:  # FRAME
                if frame_end >= 0 or pos + 9 > n:
                    raise decline("frame inside a frame, or truncated")
                size = int.from_bytes(data[pos + 1 : pos + 9], "little")
                if pos + 9 + size > n:
                    raise decline("truncated frame")
                frame_end = end = pos + 9 + size
                pos += 9
            elif op == 0x8A:  # LONG1
                if pos + 2 > end or pos + 2 + data[pos + 1] > end:
                    raise decline("truncated")
                size = data[pos + 1]
                stack.append(int.from_bytes(data[pos + 2 : pos + 2 + size], "little", signed=True))
                pos += 2 + size
            elif op == 0x58:  # BINUNICODE
                if pos + 5 > end:
                    raise decline("truncated")
                size = int.from_bytes(data[pos + 1 : pos + 5], "little")
                if pos + 5 + size > end:
                    raise decline("truncated")
                stack.append(self.text(pos + 5, size))
                pos += 5 + size
            elif op == 0x43 or op == 0x42:  # SHORT_BINBYTES, BINBYTES
                width = 1 if op == 0x43 else 4
                if pos + 1 + width > end:
                    raise decline("truncated")
                size = int.from_bytes(data[pos + 1 : pos + 1 + width], "little")
                if pos + 1 + width + size > end:
                    raise decline("truncated")
                stack.append(data[pos + 1 + width : pos + 1 + width + size])
                pos += 1 + width + size
            elif op == 0x47:  # BINFLOAT
                if pos + 9 > end:
                    raise decline("truncated")
                stack.append(struct.unpack(">d", data[pos + 1 : pos + 9])[0])
                pos += 9
            elif op == 0x71 or op == 0x72:  # BINPUT, LONG_BINPUT
                width = 1 if op == 0x71 else 4
                if pos + 1 + width > end:
                    raise decline("truncated")
                index = int.from_bytes(data[pos + 1 : pos + 1 + width], "little")
                if index != self.memo_len or index > self.limits.max_memo:
                    raise decline("memo indices out of sequence, or past the limit")
                if len(stack) <= (marks[-1] if marks else 0):
                    raise decline("PUT on an empty stack")
                self.put(stack[-1])
                pos += 1 + width
            elif op == 0x80:  # PROTO
                if pos + 2 > end or data[pos + 1] > 5:
                    raise decline("protocol")
                pos += 2
            elif op == 0x2E:  # STOP
                if marks or len(stack) != 1 or type(stack[0]) in special:
                    raise decline("STOP with an odd stack")
                return stack[0]
            else:
                raise decline(f"opcode 0x{op:02x} at {pos}")

    def check_budget(self, steps: int) -> None:
        """Decline a pickle that is mostly decoded one opcode at a time (its records are not in
        column shapes): the C unpickler is faster at those."""
        if steps > self.budget and steps > 16 * self.bulk_rows:
            raise self.decline(
                f"{steps} opcodes decoded one by one for {self.bulk_rows} column rows"
            )

    # -- opcodes with more to them ----------------------------------------------------------------

    def text(self, start: int, size: int) -> str:
        try:
            return self.data[start : start + size].decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise self.decline("a string that is not UTF-8") from None

    def put(self, value: Any) -> None:
        """Memoize ``value`` at the next index, noting the column readers' vocabulary."""
        kind = type(value)
        if kind in _RUNS:
            raise self.decline("a column run memoized")
        index = self.memo_len
        self.memo[index] = value
        self.memo_len = index + 1
        if kind is str:
            if value in _NAMES and value not in self.vocab:
                self.vocab[value] = index
        elif kind is type:
            role = self.roles.get(value)
            if role is not None and role not in self.vocab:
                self.vocab[role] = index

    def tuple(self, items: list[Any]) -> tuple:
        """A tuple of ``items``; one holding an allowlisted function can only be REDUCE's
        arguments (:class:`_Arguments`), one holding a column run declines."""
        depth = 1
        functions = False
        for item in items:
            kind = type(item)
            if kind is tuple:
                if item:
                    depth = max(depth, 1 + _tuple_depth(item, _MAX_TUPLE_DEPTH))
            elif kind in _SPECIAL:
                if kind is not _Function:
                    raise self.decline("a column run or arguments inside a tuple")
                functions = True
        if depth > _MAX_TUPLE_DEPTH:
            raise self.decline("tuples nested deeply")
        return _Arguments(items) if functions else tuple(items)

    def global_(self, module: str, name: str) -> Any:
        module, name = python3_name(module, name)
        limits = self.limits
        if len(module) + len(name) > limits.max_global_name:
            raise self.decline("a long global name")
        if (module, name) not in self.named:
            if len(self.named) >= limits.max_globals:
                raise self.decline("too many globals")
            self.named.add((module, name))
        try:
            value = self.allow[f"{module}.{name}"]
        except KeyError:
            raise self.decline(f"{module}.{name} is not on the allowlist") from None
        if type(value) is types.FunctionType:
            held = self.functions.get(value)
            if held is None:
                held = self.functions[value] = _Function(value)
            return held
        return value

    def reduce(self, func: Any, args: Any) -> Any:
        if type(args) is _Arguments:
            args = tuple(a.function if type(a) is _Function else a for a in args)
        elif type(args) is not tuple:
            raise self.decline("REDUCE arguments are not a tuple")
        if type(func) is _Function:
            call = func.function
        elif func is tuple:  # torch.Size((…,)): torch passes a tuple (nothing is copied)
            if len(args) != 1 or type(args[0]) is not tuple:
                raise self.decline("torch.Size of something other than a tuple")
            call = func
        elif type(func) is type and func in self.callable_types:
            call = func
        else:
            raise self.decline("REDUCE of something not callable")
        try:
            value = call(*args)
        except Exception as exc:
            raise self.decline(f"a stand-in refused: {type(exc).__name__}") from None
        if type(value) is types.FunctionType or type(value) in _SPECIAL:
            raise self.decline("a stand-in returned a function")
        return value

    def newobj(self, cls: Any, args: Any) -> Any:
        if (
            type(cls) is not type
            or cls not in self.instance_types
            or cls.__new__ is not object.__new__
            or type(args) is not tuple
            or args
        ):
            raise self.decline("NEWOBJ of something other than a stand-in class")
        return object.__new__(cls)

    def build(self, target: Any, state: Any) -> Any:
        """BUILD: the stand-in instance ``target`` takes ``state``; returns ``target``."""
        if type(target) not in self.instance_types or type(state) in _SPECIAL:
            raise self.decline("BUILD of something other than a stand-in instance")
        try:
            target.__setstate__(state)
        except Exception as exc:
            raise self.decline(f"a stand-in refused its state: {type(exc).__name__}") from None
        return target

    def extend(self, target: Any, items: list[Any]) -> None:
        if type(target) is not list:
            raise self.decline("APPEND to something other than a list")
        for item in items:
            kind = type(item)
            if kind in _SPECIAL and kind is not ChunkRun:
                raise self.decline("a function or storage run appended")
        target.extend(items)

    def setitem(self, target: Any, key: Any, value: Any) -> None:
        if type(target) is not dict or type(key) in _SPECIAL or type(value) in _SPECIAL:
            raise self.decline("SETITEM of something other than a dict item")
        try:
            target[key] = value
        except TypeError:
            raise self.decline("an unhashable key") from None

    def setitems(self, stack: list[Any], marks: list[int]) -> None:
        """SETITEMS: items after the mark go pairwise into the dict below it; a
        :class:`StorageRun` (standing for its pairs) takes a key's place, its value None."""
        if not marks:
            raise self.decline("SETITEMS without MARK")
        start = marks.pop()
        if start <= (marks[-1] if marks else 0):
            raise self.decline("stack underflow")
        target = stack[start - 1]
        items = stack[start:]
        del stack[start:]
        if type(target) is not dict:
            raise self.decline("SETITEMS on something other than a dict")
        i, count = 0, len(items)
        while i < count:
            key = items[i]
            if type(key) is StorageRun:
                target[key] = None
                i += 1
                continue
            if i + 1 >= count:
                raise self.decline("odd number of items for SETITEMS")
            self.setitem(target, key, items[i + 1])
            i += 2

    # -- column runs ------------------------------------------------------------------------------

    def search(self, cls: type, pos: int) -> bool:
        """At a GET of a column class: let its reader search ``[pos, end)`` for records when
        it can (the vocabulary it needs is memoized); True when it did."""
        reader = self.readers[cls]
        found = reader.search_from(pos)
        if found is None:
            return False
        self.runs.update({start: (reader, *rows) for start, rows in found.items()})
        return True

    def take(self, found: tuple[_Reader, _Found, int, int], stack: list[Any], end: int) -> int:
        """Step over rows ``[lo, hi)`` of a reader's search (those ending by ``end``, the
        frame's end): push their marker, count their memo entries, and return the position
        after them (0 when none fits)."""
        reader, rows, lo, hi = found
        ends = rows.ends
        if ends[hi - 1] > end:
            hi = lo + int(np.searchsorted(ends[lo:hi], end, side="right"))
            if hi == lo:
                return 0
        marker = reader.marker()
        stack.append(marker)
        reader.taken.append((rows, lo, hi, self.memo_len, marker))
        self.taken_starts.append(self.memo_len)
        self.taken.append((reader, rows, lo, hi, self.memo_len))
        self.memo_len += int(rows.memo_cum[hi] - rows.memo_cum[lo])
        self.bulk_rows += hi - lo
        return int(ends[hi - 1])

    def column_value(self, index: int) -> Any:
        """What a column record memoized at ``index``, for an opcode naming it later: a string
        (a file name written once, then named by memo index) or a record's object (Megatron's
        save plans name the chunks of ``state_dict_metadata``), built as the unpickler would
        have; any other entry declines."""
        at = bisect.bisect_right(self.taken_starts, index) - 1
        if at < 0 or index >= self.memo_len:
            raise self.decline(f"memo index {index} not set")
        reader, rows, lo, hi, memo_start = self.taken[at]
        cum = rows.memo_cum
        row = lo + int(np.searchsorted(cum[lo : hi + 1] - cum[lo] + memo_start, index, "right")) - 1
        if row >= hi:
            raise self.decline(f"memo index {index} not set")
        offset = index - (memo_start + int(cum[row] - cum[lo]))
        value = reader.value_at(rows, row, offset)
        if value is _MISSING:
            raise self.decline(f"memo index {index} refers into a column record")
        if type(value) is tuple:  # (start, length) of a string
            value = self.text(*value)
        else:
            self.row_objects.append(value)
        self.memo[index] = value
        return value

    # -- the result -------------------------------------------------------------------------------

    def finish(self, value: Any) -> ScanResult:
        """The columns of every run taken, their memo references checked, markers set."""
        strings = _Strings(self)
        chunk_reader = self.readers[self.classes.chunk]
        pair_reader = self.readers[self.classes.index]
        chunks = chunk_reader.columns(strings)
        storage = pair_reader.columns(strings)
        return ScanResult(value, chunks, storage, strings.table, self.row_objects, self.memo_len)


class _Strings:
    """The string table of the columns: strings the pickle memoized (checked to be ``str``,
    set before the run that names them) and strings written inside column records."""

    def __init__(self, machine: _Machine) -> None:
        self.machine = machine
        self.table: list[str] = []
        self.codes: dict[str, int] = {}

    def code(self, text: str) -> int:
        code = self.codes.get(text)
        if code is None:
            code = self.codes[text] = len(self.table)
            self.table.append(text)
        return code

    def from_memo(self, indices: np.ndarray, before: np.ndarray) -> np.ndarray:
        """Codes of the memoized strings at ``indices`` (each below ``before``, the first memo
        index of the record naming it: set before that record)."""
        if not len(indices):
            return np.zeros(0, np.int32)
        if (indices >= before).any():
            raise self.machine.decline("a column record refers to a later memo entry")
        unique, inverse = np.unique(indices, return_inverse=True)
        memo = self.machine.memo
        codes = np.empty(len(unique), np.int32)
        for i, index in enumerate(unique.tolist()):
            value = memo.get(index, _MISSING)
            if value is _MISSING:
                value = self.machine.column_value(index)
            if type(value) is not str:
                raise self.machine.decline("a column record names a non-string")
            codes[i] = self.code(value)
        return codes[inverse]

    def from_bytes(self, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Codes of the UTF-8 strings written at ``starts`` (``sizes`` bytes each)."""
        data = self.machine.data
        seen: dict[bytes, int] = {}
        raw = [
            seen.setdefault(data[a : a + s], len(seen))
            for a, s in zip(starts.tolist(), sizes.tolist(), strict=True)
        ]
        codes = np.empty(len(seen), np.int32)
        for text, i in seen.items():
            try:
                codes[i] = self.code(text.decode("utf-8", "surrogatepass"))
            except UnicodeDecodeError:
                raise self.machine.decline("a string that is not UTF-8") from None
        return codes[np.asarray(raw, dtype=np.int64)] if raw else np.zeros(0, np.int32)


# --------------------------------------------------------------------------------------------
# Column records: found by a literal search, decoded as rows of a byte matrix.

_OBJECT_HEAD = b")\x81\x94}\x94("  # EMPTY_TUPLE NEWOBJ MEMOIZE EMPTY_DICT MEMOIZE MARK
_SIZE_TAIL = b"\x85\x94R\x94"  # TUPLE1 MEMOIZE REDUCE MEMOIZE: torch.Size((…,))
_INT_OPS = np.zeros(256, bool)
_INT_OPS[[0x4B, 0x4D, 0x4A, 0x8A]] = True
_INT_WIDTH = np.zeros(256, np.int64)
_INT_WIDTH[[0x4B, 0x4D, 0x4A]] = [2, 3, 5]
#: Candidates decoded at once (bounds the byte matrix: rows × width).
_BLOCK_BYTES = 2 << 20
#: Widest row a record is decoded in (a pair with a key of ~1900 characters).
_MAX_WIDTH = 4096
#: Dimensions of a chunk box, at most (longer boxes are decoded one opcode at a time).
_MAX_DIMS = 64


#: Compact types of what every record keeps: positions (the pickle is under 4 GiB, memo indices
#: are 32-bit) and the memo entries it adds.
_POSITIONS = {"start": np.uint32, "end": np.uint32, "memo": np.int8}


def _get(index: int) -> bytes:
    """How a pickler writes a memo GET of ``index``."""
    return b"h" + bytes([index]) if index < 256 else b"j" + index.to_bytes(4, "little")


class _Rows:
    """Candidate records as rows of a byte matrix (each row the ``width`` bytes from one
    candidate's start), read in lockstep at per-row positions ``p``; a row whose bytes are not
    what a record of the shape has is dropped (``ok`` False), never read past its width."""

    def __init__(self, data: np.ndarray, starts: np.ndarray, width: int) -> None:
        self.starts = starts
        self.matrix = np.ascontiguousarray(sliding_window_view(data, width)[starts])
        self.flat = self.matrix.reshape(-1)
        count = len(starts)
        self.u64 = np.ndarray((max(len(self.flat) - 7, 0),), "<u8", self.flat, 0, (1,))
        self.base = np.arange(count, dtype=np.int64) * width
        self.p = np.zeros(count, np.int64)
        self.ok = np.ones(count, bool)
        self.overflow = np.zeros(count, bool)  # ran past the row: to decode in a wider one
        self.memos = np.zeros(count, np.int64)  # MEMOIZE opcodes read so far
        self.limit = width - 16  # every read is at p + k, k < 16

    def saved(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The rows' state, for :meth:`restore`."""
        return self.ok.copy(), self.p.copy(), self.memos.copy()

    def restore(self, where: np.ndarray, saved: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        """Undo what was read since :meth:`saved`, except in the rows ``where``."""
        ok, p, memos = saved
        self.ok = np.where(where, self.ok, ok)
        self.p = np.where(where, self.p, p)
        self.memos = np.where(where, self.memos, memos)

    def advance(self, widths: np.ndarray | int) -> None:
        self.p += widths
        over = self.p > self.limit
        if over.any():
            self.overflow |= over & self.ok
            self.ok &= ~over
            np.minimum(self.p, self.limit, out=self.p)

    def byte(self, k: int = 0) -> np.ndarray:
        return self.flat[self.base + self.p + k]

    def literal(self, text: bytes, memos: int = 0) -> None:
        """The next bytes are ``text`` (holding ``memos`` MEMOIZE opcodes); step over them."""
        for at in range(0, len(text), 8):
            part = text[at : at + 8]
            mask = np.uint64((1 << (8 * len(part))) - 1)
            value = np.uint64(int.from_bytes(part, "little"))
            self.ok &= (self.u64[self.base + self.p + at] & mask) == value
        self.memos += memos
        self.advance(len(text))

    def u32(self, k: int) -> np.ndarray:
        return (self.u64[self.base + self.p + k] & np.uint64(0xFFFFFFFF)).astype(np.int64)

    def get(self) -> np.ndarray:
        """A BINGET / LONG_BINGET: its memo index."""
        op = self.byte()
        short = op == 0x68
        self.ok &= short | (op == 0x6A)
        index = np.where(short, self.byte(1), self.u32(1)).astype(np.int64)
        self.advance(np.where(short, 2, 5))
        return index

    def integer(self, active: np.ndarray) -> np.ndarray:
        """The BININT1/2, BININT or LONG1 (up to 8 bytes) at ``p`` of the ``active`` rows; the
        others are not moved."""
        op = self.byte()
        width = _INT_WIDTH[op]
        value = self.byte(1).astype(np.int64)
        wide = active & (op != 0x4B)
        if wide.any():
            value |= np.where(op == 0x4D, self.byte(2).astype(np.int64) << 8, 0)
            signed = op == 0x4A
            if signed.any():
                word = self.u32(1)
                value = np.where(signed, word - ((word >> 31) << 32), value)
            long = active & (op == 0x8A)
            if long.any():
                value, width = self._long(long, value, width)
        self.ok &= ~active | (width > 0)
        self.advance(np.where(active, width, 0))
        return np.where(active, value, 0)

    def _long(
        self, rows: np.ndarray, value: np.ndarray, width: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """LONG1 of at most 8 bytes (little-endian two's complement), in the ``rows``."""
        size = self.byte(1).astype(np.int64)
        raw = self.u64[self.base + self.p + 2]
        fits = rows & (size <= 8)
        shift = np.where(fits & (size > 0), 64 - 8 * size, 0).astype(np.uint64)
        decoded = (raw << shift).view(np.int64) >> shift.astype(np.int64)
        decoded = np.where(size == 0, 0, decoded)
        value = np.where(fits, decoded, value)
        width = np.where(fits, 2 + size, np.where(rows, 0, width))
        return value, width

    def box(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A ``torch.Size`` reduced as ``(tuple of ints,)`` after its global: the ints
        (``(rows, widest)``), how many, and the memo entries it adds (its tuple unless ``()``,
        the arguments tuple, the Size).
        Forms: ``)`` (no ints), up to three ints and TUPLE1-3, or MARK, ints, TUPLE."""
        op = self.byte()
        empty = op == 0x29
        marked = op == 0x28
        self.advance((empty | marked).astype(np.int64))
        ndim = np.zeros(len(self.p), np.int64)
        columns: list[np.ndarray] = []
        active = self.ok & ~empty & _INT_OPS[self.byte()]
        while active.any():
            if len(columns) == _MAX_DIMS:
                self.ok &= ~active
                break
            columns.append(self.integer(active))
            ndim += active
            active &= self.ok & _INT_OPS[self.byte()]
        op = self.byte()
        closed = np.where(
            marked, op == 0x74, (ndim >= 1) & (ndim <= 3) & (op.astype(np.int64) == 0x84 + ndim)
        )
        self.ok &= empty | closed
        self.advance((~empty).astype(np.int64))
        self.ok &= empty | (self.byte() == 0x94)
        self.memos += ~empty
        self.advance((~empty).astype(np.int64))
        self.literal(_SIZE_TAIL, memos=2)
        values = np.stack(columns, axis=1) if columns else np.zeros((len(self.p), 0), np.int64)
        return values, ndim, 3 - empty.astype(np.int64)

    def text(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A string: a memo GET (``inline`` False, ``a`` its index) or SHORT_BINUNICODE and
        MEMOIZE (``a`` its start in the pickle, ``b`` its length)."""
        op = self.byte()
        short = op == 0x68
        long = op == 0x6A
        inline = op == 0x8C
        size = self.byte(1).astype(np.int64)
        index = np.where(short, size, self.u32(1))
        start = self.starts + self.p + 2
        end = self.p + 2 + size
        fits = end <= self.limit
        self.overflow |= self.ok & inline & ~fits
        self.ok &= short | long | (inline & fits)
        memoized = self.flat[self.base + np.where(inline & fits, end, self.p)] == 0x94
        self.ok &= ~inline | memoized
        self.memos += inline
        self.advance(np.where(short, 2, np.where(long, 5, 3 + size)))
        return inline, np.where(inline, start, index), np.where(inline, size, 0)


class _Filled:
    """Columns filled block by block, sized for ``capacity`` rows up front (2-D ones widened
    when a block is wider), so that decoding does not hold every block and their join."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.count = 0
        self.arrays: dict[str, np.ndarray] = {}

    def add(self, block: dict[str, np.ndarray], dtypes: Mapping[str, Any]) -> None:
        rows = len(block["start"])
        at = self.count
        for name, values in block.items():
            array = self.arrays.get(name)
            if array is None:
                shape = (self.capacity, *values.shape[1:])
                array = self.arrays[name] = np.zeros(shape, dtypes.get(name, values.dtype))
            if values.ndim == 2 and values.shape[1] > array.shape[1]:
                wider = np.zeros((self.capacity, values.shape[1]), array.dtype)
                wider[:, : array.shape[1]] = array
                array = self.arrays[name] = wider
            if values.ndim == 2:
                array[at : at + rows, : values.shape[1]] = values
            else:
                array[at : at + rows] = values
        self.count += rows

    def columns(self) -> dict[str, np.ndarray]:
        return {name: array[: self.count] for name, array in self.arrays.items()}


@dataclass
class _Found:
    """The records one search found, sorted by position: where each starts and ends, the
    memo entries before each (``memo_cum``), and their decoded fields."""

    starts: np.ndarray
    ends: np.ndarray
    memo_cum: np.ndarray
    fields: dict[str, np.ndarray]


class _Reader:
    """Finds and decodes the records of one shape; holds the runs found and those taken."""

    roles: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    width = 128
    #: MEMOIZE opcodes in :meth:`prefix`
    prefix_memos = 2
    #: compact types the fields are kept in (the others stay int64 or bool)
    dtypes: dict[str, Any] = {}

    def __init__(self, machine: _Machine) -> None:
        self.machine = machine
        self.taken: list[tuple[_Found, int, int, int, Any]] = []
        self.searched_with: tuple[str, ...] | None = None

    def search_from(self, pos: int) -> dict[int, tuple[_Found, int, int]] | None:
        """The runs of records in ``[pos, end)``, searched when the vocabulary this shape
        needs is memoized and grew since the last search (else None)."""
        vocab = self.machine.vocab
        if not all(role in vocab for role in self.roles):
            return None
        known = tuple(role for role in self.optional if role in vocab)
        if self.searched_with is not None and known == self.searched_with:
            return None
        self.searched_with = known
        prefix = self.prefix()
        data = self.machine.data
        pattern = re.compile(re.escape(prefix))
        starts = np.fromiter(map(re.Match.start, pattern.finditer(data, pos)), dtype=np.int64)
        return _runs(self.decode(starts, len(prefix)))

    def decode(self, starts: np.ndarray, skip: int) -> _Found:
        """Decode the candidates at ``starts`` (their first ``skip`` bytes matched already),
        in byte matrices of :attr:`width` columns, then ×4 for those longer (long keys); the
        records' fields are filled into columns sized for every candidate."""
        u8 = np.frombuffer(self.machine.data, np.uint8)
        out = _Filled(len(starts))
        width = self.width
        while len(starts) and width <= _MAX_WIDTH:
            starts = starts[starts + width <= len(u8)]
            longer = []
            per_block = max(1, _BLOCK_BYTES // width)
            for at in range(0, len(starts), per_block):
                rows = _Rows(u8, starts[at : at + per_block], width)
                rows.literal(b"", memos=self.prefix_memos)
                rows.advance(skip)
                fields = self.walk(rows)
                keep = rows.ok
                fields["start"] = rows.starts
                fields["end"] = rows.starts + rows.p
                fields["memo"] = rows.memos
                out.add({k: v[keep] for k, v in fields.items()}, self.dtypes)
                longer.append(rows.starts[rows.overflow])
                del rows, fields
            starts = np.sort(np.concatenate(longer)) if longer else starts[:0]
            width *= 4
        fields = out.columns()
        if not fields:
            empty = np.zeros(0, np.int64)
            return _Found(empty, empty, np.zeros(1, np.int64), {})
        start = fields.pop("start")
        if (start[1:] < start[:-1]).any():  # rows decoded again in a wider matrix
            order = np.argsort(start, kind="stable")
            start = start[order]
            fields = {k: v[order] for k, v in fields.items()}
        ends = fields.pop("end")
        memo_cum = np.concatenate([[0], np.cumsum(fields.pop("memo"), dtype=np.int64)])
        return _Found(start, ends, memo_cum, fields)

    def walk(self, rows: _Rows) -> dict[str, np.ndarray]:
        """Read the rest of each record (after the prefix); its fields."""
        raise NotImplementedError

    def value_at(self, found: _Found, row: int, offset: int) -> Any:
        """The entry record ``row`` memoized ``offset`` entries in: a record object, or a
        string as ``(start, length)`` in the pickle; ``_MISSING`` for anything else."""
        return _MISSING

    def prefix(self) -> bytes:
        raise NotImplementedError

    def marker(self) -> Any:
        raise NotImplementedError

    def rows_taken(self) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """The fields of the rows taken, which rows were taken (a mask), and the memo index
        each taken row's first entry got (what it names by memo index was set before it).
        When every run taken comes from one search (the usual case) that search's columns
        are returned as they are and each marker counts rows in them; else the rows taken
        are copied in order (letting the searches' columns go as they are copied)."""
        if not self.taken:
            return {}, np.zeros(0, bool), np.zeros(0, np.int64)
        first = self.taken[0][0]
        if all(found is first for found, *_ in self.taken):
            taken = np.zeros(len(first.ends), bool)
            before = np.zeros(len(first.ends), np.int64)
            for _, lo, hi, memo_start, marker in self.taken:
                marker.start, marker.stop = lo, hi
                taken[lo:hi] = True
                before[lo:hi] = first.memo_cum[lo:hi] - first.memo_cum[lo] + memo_start
            return first.fields, taken, before
        at = 0
        groups: list[tuple[_Found, list[np.ndarray]]] = []
        befores = []
        for found, lo, hi, memo_start, marker in self.taken:
            marker.start, marker.stop = at, at + hi - lo
            at += hi - lo
            befores.append(found.memo_cum[lo:hi] - found.memo_cum[lo] + memo_start)
            if not groups or groups[-1][0] is not found:
                groups.append((found, []))
            groups[-1][1].append(np.arange(lo, hi))
        indices = [(found, np.concatenate(ranges)) for found, ranges in groups]
        fields = {}
        for name in list(first.fields):
            fields[name] = _concat([found.fields[name][index] for found, index in indices])
            for found, _ in indices:
                found.fields.pop(name, None)
        return fields, np.ones(at, bool), np.concatenate(befores)


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    """Concatenate row blocks, 2-D ones (ints per dimension) zero-padded to the widest."""
    if not arrays:
        return np.zeros(0, np.int64)
    if len(arrays) == 1:
        return arrays[0]
    if arrays[0].ndim == 1:
        return np.concatenate(arrays)
    out = np.zeros((sum(len(a) for a in arrays), max(a.shape[1] for a in arrays)), np.int64)
    at = 0
    for block in arrays:
        out[at : at + len(block), : block.shape[1]] = block
        at += len(block)
    return out


def _runs(found: _Found) -> dict[int, tuple[_Found, int, int]]:
    """Runs of records back to back (each ending where the next starts), by start position."""
    count = len(found.starts)
    if not count:
        return {}
    joined = found.starts[1:] == found.ends[:-1]
    heads = np.flatnonzero(np.concatenate([[True], ~joined]))
    stops = np.concatenate([heads[1:], [count]])
    return {
        int(found.starts[lo]): (found, int(lo), int(hi))
        for lo, hi in zip(heads.tolist(), stops.tolist(), strict=True)
    }


class _ChunkReader(_Reader):
    """``ChunkStorageMetadata`` records: NEWOBJ with the dict ``{'offsets': Size, 'sizes':
    Size}`` as BUILD state (the shape every torch 2.x writer uses)."""

    roles = ("ChunkStorageMetadata", "offsets", "sizes", "Size")
    width = 96
    dtypes = {**_POSITIONS, "offsets_ndim": np.int8, "sizes_ndim": np.int8}

    def prefix(self) -> bytes:
        v = self.machine.vocab
        return _get(v["ChunkStorageMetadata"]) + _OBJECT_HEAD + _get(v["offsets"]) + _get(v["Size"])

    def marker(self) -> ChunkRun:
        return ChunkRun()

    def walk(self, rows: _Rows) -> dict[str, np.ndarray]:
        v = self.machine.vocab
        offsets, offsets_ndim, _ = rows.box()
        rows.literal(_get(v["sizes"]) + _get(v["Size"]))
        sizes, sizes_ndim, _ = rows.box()
        rows.literal(b"ub")  # SETITEMS BUILD
        fields = {
            "offsets": offsets,
            "offsets_ndim": offsets_ndim,
            "sizes": sizes,
            "sizes_ndim": sizes_ndim,
        }
        return fields

    def value_at(self, found: _Found, row: int, offset: int) -> Any:
        """A record's own object (entry 0), built and given its state as BUILD would."""
        if offset != 0:
            return _MISSING
        fields = found.fields
        state = {
            "offsets": tuple(fields["offsets"][row, : fields["offsets_ndim"][row]].tolist()),
            "sizes": tuple(fields["sizes"][row, : fields["sizes_ndim"][row]].tolist()),
        }
        cls = self.machine.classes.chunk
        return self.machine.build(self.machine.newobj(cls, ()), state) or _MISSING

    def columns(self, strings: _Strings) -> ChunkColumns:
        fields, _, _ = self.rows_taken()
        if not fields:
            empty = np.zeros(0, np.int64)
            return ChunkColumns(
                np.zeros((0, 0), np.int64), empty, np.zeros((0, 0), np.int64), empty
            )
        return ChunkColumns(
            fields["offsets"], fields["offsets_ndim"], fields["sizes"], fields["sizes_ndim"]
        )


class _PairReader(_Reader):
    """``storage_data`` items: a ``MetadataIndex`` (state ``{'fqn': str, 'index': int | None
    [, 'offset': Size | None]}``) followed by its ``_StorageInfo`` (state ``{'relative_path':
    str, 'offset': int, 'length': int [, 'transform_descriptors': None | [] | [str]]}``)."""

    roles = ("MetadataIndex", "fqn", "index", "offset", "Size", "_StorageInfo")
    roles += ("relative_path", "length")
    optional = ("transform_descriptors",)
    width = 256
    dtypes = {
        **_POSITIONS,
        "fqn_a": np.uint32,
        "fqn_b": np.uint8,
        "file_a": np.uint32,
        "file_b": np.uint8,
        "transform_a": np.uint32,
        "transform_b": np.uint8,
        "offsets_ndim": np.int8,
        "offset_memo": np.int8,
    }

    def prefix(self) -> bytes:
        v = self.machine.vocab
        return _get(v["MetadataIndex"]) + _OBJECT_HEAD + _get(v["fqn"])

    def marker(self) -> StorageRun:
        return StorageRun()

    def walk(self, rows: _Rows) -> dict[str, np.ndarray]:
        v = self.machine.vocab
        count = len(rows.p)
        fqn_inline, fqn_a, fqn_b = rows.text()
        rows.literal(_get(v["index"]))
        none = rows.byte() == 0x4E
        index = rows.integer(rows.ok & ~none)
        rows.advance(none.astype(np.int64))
        # a third item, the offset (torch leaves it out when None)
        third = rows.byte() != 0x75
        offsets = np.zeros((count, 0), np.int64)
        offsets_ndim = np.full(count, -1, np.int64)
        offset_memo = np.zeros(count, np.int64)
        if third.any():
            saved = rows.saved()
            rows.literal(_get(v["offset"]))
            offset_none = rows.byte() == 0x4E
            rows.advance(offset_none.astype(np.int64))
            rows.restore(third, saved)
            sized = third & ~offset_none
            if sized.any():
                saved = rows.saved()
                rows.literal(_get(v["Size"]))
                boxed, ndim, box_memo = rows.box()
                rows.restore(sized, saved)
                offsets = np.where(sized[:, None], boxed, 0)
                offsets_ndim = np.where(sized, ndim, -1)
                offset_memo = np.where(sized, box_memo, 0)
        rows.literal(b"ub")
        head = _get(v["_StorageInfo"]) + _OBJECT_HEAD + _get(v["relative_path"])
        rows.literal(head, memos=2)
        file_inline, file_a, file_b = rows.text()
        rows.literal(_get(v["offset"]))
        offset = rows.integer(rows.ok.copy())
        rows.literal(_get(v["length"]))
        length = rows.integer(rows.ok.copy())
        transform = self._transform(rows, count)
        rows.literal(b"ub")
        return {
            "fqn_inline": fqn_inline,
            "fqn_a": fqn_a,
            "fqn_b": fqn_b,
            "index": index,
            "index_none": none,
            "offsets": offsets,
            "offsets_ndim": offsets_ndim,
            "file_inline": file_inline,
            "file_a": file_a,
            "file_b": file_b,
            "offset": offset,
            "length": length,
            "offset_memo": offset_memo,
            **transform,
        }

    def _memoized_strings(self) -> None:
        """Look up, while the searches' fields are at hand, the strings taken rows name by
        memo index that column records wrote (checked again against each row later)."""
        memo = self.machine.memo
        taken: dict[int, tuple[_Found, np.ndarray]] = {}
        for found, lo, hi, _, _ in self.taken:
            if id(found) not in taken:
                taken[id(found)] = (found, np.zeros(len(found.starts), bool))
            taken[id(found)][1][lo:hi] = True
        for found, rows in taken.values():
            fields = found.fields
            named = np.concatenate(
                [
                    fields["fqn_a"][rows & ~fields["fqn_inline"]],
                    fields["file_a"][rows & ~fields["file_inline"]],
                    fields["transform_a"][
                        rows & fields["transform_named"] & ~fields["transform_inline"]
                    ],
                ]
            )
            for index in np.unique(named).tolist():
                if index not in memo and index < self.machine.memo_len:
                    self.machine.column_value(index)

    def value_at(self, found: _Found, row: int, offset: int) -> Any:
        """The strings a pair memoizes: its key's fqn (entry 2), then past the offset's
        Size and the ``_StorageInfo`` and its dict, its file, then a transform in a list."""
        fields = found.fields
        at = 2
        if fields["fqn_inline"][row]:
            if offset == at:
                return int(fields["fqn_a"][row]), int(fields["fqn_b"][row])
            at += 1
        at += int(fields["offset_memo"][row]) + 2
        if fields["file_inline"][row]:
            if offset == at:
                return int(fields["file_a"][row]), int(fields["file_b"][row])
            at += 1
        if fields["transform_listed"][row]:
            at += 1
            if fields["transform_inline"][row] and offset == at:
                return int(fields["transform_a"][row]), int(fields["transform_b"][row])
        return _MISSING

    def _transform(self, rows: _Rows, count: int) -> dict[str, np.ndarray]:
        """The optional ``transform_descriptors`` item: None, an empty list (``listed``,
        memoized) or a list of one string (``named``: a memo index or, ``inline``, its start
        in ``a`` and length in ``b``)."""
        none = np.zeros(count, bool)
        fields = {
            "transform_named": none,
            "transform_inline": none,
            "transform_listed": none,
            "transform_a": np.zeros(count, np.int64),
            "transform_b": np.zeros(count, np.int64),
        }
        present = rows.byte() != 0x75
        vocab = self.machine.vocab
        if not present.any():
            return fields
        if "transform_descriptors" not in vocab:
            rows.ok &= ~present
            return fields
        saved = rows.saved()
        rows.literal(_get(vocab["transform_descriptors"]))
        rows.restore(present, saved)
        op = rows.byte()
        empty = present & (op == 0x4E)
        listed = present & (op == 0x5D)
        rows.ok &= ~present | empty | listed
        rows.ok &= ~listed | (rows.byte(1) == 0x94)  # EMPTY_LIST MEMOIZE
        rows.memos += listed
        rows.advance(np.where(empty, 1, np.where(listed, 2, 0)))
        fields["transform_listed"] = listed
        one = listed & (rows.byte() != 0x75)
        if one.any():
            saved = rows.saved()
            inline, a, b = rows.text()
            rows.ok &= rows.byte() == 0x61  # APPEND
            rows.advance(1)
            rows.restore(one, saved)
            fields["transform_named"] = one
            fields["transform_inline"] = one & inline
            fields["transform_a"] = np.where(one, a, 0)
            fields["transform_b"] = np.where(one, b, 0)
        return fields

    def columns(self, strings: _Strings) -> StorageColumns:
        self._memoized_strings()
        fields, taken, before = self.rows_taken()
        if not fields:
            empty = np.zeros(0, np.int64)
            code = np.zeros(0, np.int32)
            return StorageColumns(
                fqn=code,
                index=empty,
                index_none=np.zeros(0, bool),
                offsets=np.zeros((0, 0), np.int64),
                offsets_ndim=empty,
                file=code,
                offset=empty,
                length=empty,
                transform=code,
            )
        inline, a, b = fields["fqn_inline"], fields["fqn_a"], fields["fqn_b"]
        fqn = _text_codes(strings, taken, inline, a, b, before)
        inline, a, b = fields["file_inline"], fields["file_a"], fields["file_b"]
        file = _text_codes(strings, taken, inline, a, b, before)
        inline, a, b = fields["transform_inline"], fields["transform_a"], fields["transform_b"]
        transform = _text_codes(strings, taken & fields["transform_named"], inline, a, b, before)
        return StorageColumns(
            fqn=fqn,
            index=fields["index"],
            index_none=fields["index_none"],
            offsets=fields["offsets"],
            offsets_ndim=fields["offsets_ndim"],
            file=file,
            offset=fields["offset"],
            length=fields["length"],
            transform=transform,
        )


def _text_codes(
    strings: _Strings,
    rows: np.ndarray,
    inline: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    before: np.ndarray,
) -> np.ndarray:
    """String codes of a text field in the ``rows`` (-1 elsewhere): memoized (``a`` the memo
    index) or written inline (``a`` the start, ``b`` the length)."""
    codes = np.full(len(rows), -1, np.int32)
    memoized = rows & ~inline
    if memoized.any():
        codes[memoized] = strings.from_memo(a[memoized].astype(np.int64), before[memoized])
    written = rows & inline
    if written.any():
        codes[written] = strings.from_bytes(a[written].astype(np.int64), b[written])
    return codes
