"""The opcode scan: every opcode of a pickle checked, without building anything, for what the C
unpickler would trust (memo indices, announced lengths, frames, refused opcodes), whole or in
pieces; a regular expression skips the harmless opcodes at C speed."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ...errors import CorruptRecordError, PickleLimitError
from .limits import Limits, limit_error

__all__ = ["COUNTED", "STOP", "OpcodeParser", "scan", "scan_pieces"]

STOP, _FRAME, _LONG_BINPUT, _PUT, _SHORT_BINUNICODE = 0x2E, 0x95, 0x72, 0x70, 0x8C
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
COUNTED = {
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


def _fast_pattern() -> re.Pattern[bytes]:
    no_arg = b"[" + b"".join(re.escape(bytes([op])) for op in _NO_ARG) + b"]"
    # LONG_BINPUT below 65536 needs at most a 1 MB memo: harmless at any position.
    with_arg = b"(?:j....|h.|K.|M..|J....|q.|\x80.|G.{8}|r..\x00\x00)"
    return re.compile(b"(?:" + no_arg + b"*+" + with_arg + b")*+" + no_arg + b"*+", re.DOTALL)


_SKIP = _fast_pattern().match


class _NeedMore(Exception):
    """The opcode being scanned continues past the bytes at hand: up to ``end`` at least."""

    def __init__(self, end: int) -> None:
        self.end = end


class OpcodeParser:
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
        counted = COUNTED.get(op)
        if counted is not None:
            width, signed, is_int = counted
            self.need(pos, 1 + width, op)
            length = int.from_bytes(data[pos + 1 : pos + 1 + width], "little", signed=signed)
            if length < 0:
                raise CorruptRecordError(f"{self.source}: negative length at {self.base + pos}")
            if is_int and length > limits.max_int_bytes:
                raise limit_error(self.source, f"an integer of {length} bytes at {self.base + pos}")
            self.need(pos, 1 + width + length, op)
            return op, pos + 1 + width + length, length
        if op == _FRAME:
            return op, self.enter_frame(pos), None
        lines = _LINES.get(op)
        if lines is not None:
            return op, *self.read_lines(op, pos, lines)
        if op == STOP:
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
            return limit_error(self.source, f"opcode {_REFUSED[op]} at {pos}")
        return CorruptRecordError(f"{self.source}: invalid pickle opcode 0x{op:02x} at {pos}")

    def check_memo(self, index: int, pos: int) -> None:
        # A pickler numbers memo entries 0, 1, 2…, one per PUT: never above the position.
        pos += self.base
        if index < 0 or index > min(self.limits.max_memo, pos):
            raise limit_error(self.source, f"memo index {index} at byte {pos}")


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
        raise limit_error(source, f"{total} bytes (limit {limits.max_bytes})")
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
        parser = OpcodeParser(window, limits, source, base=base, total=total)
        parser.frame_end = frame_end
        pos, n = 0, parser.n
        try:
            while True:
                end = parser.end()
                pos = _SKIP(window, pos, end).end()
                if pos >= n:
                    raise _NeedMore(n + 1)
                if window[pos] == _SHORT_BINUNICODE and pos + 1 < min(end, n):
                    # the keys and names: most of what the pattern cannot skip, stepped over
                    # here without a call (whole inside the frame and the window, else below)
                    after = pos + 2 + window[pos + 1]
                    if after <= min(end, n):
                        pos = after
                        continue
                op, after, _ = parser.step(pos)
                if op == STOP:
                    return
                pos = after
        except _NeedMore as more:  # pos: where the unfinished opcode starts
            frame_end, want = parser.frame_end, more.end - pos
