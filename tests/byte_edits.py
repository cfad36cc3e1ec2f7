"""Helpers that edit the bytes of real checkpoint files in tests: a pickle's FRAME opcodes taken
out so its opcodes can change length, and the central directory entry of a zip member found."""

from __future__ import annotations

import pickletools

__all__ = ["central_entry", "unframed"]


def unframed(data: bytes) -> bytes:
    """A protocol-4 pickle without its (optional) FRAME opcodes, so it can be edited in place
    and change length."""
    frames = [pos for op, _, pos in pickletools.genops(data) if op.name == "FRAME"]
    out, last = bytearray(), 0
    for pos in frames:
        out += data[last:pos]
        last = pos + 9
    return bytes(out + data[last:])


def central_entry(blob: bytes | bytearray, name: bytes) -> int:
    """Where the central directory entry of zip member ``name`` starts in ``blob``."""
    at = blob.find(b"PK\x01\x02")
    while at >= 0:
        name_len = int.from_bytes(blob[at + 28 : at + 30], "little")
        if bytes(blob[at + 46 : at + 46 + name_len]) == name:
            return at
        at = blob.find(b"PK\x01\x02", at + 4)
    raise AssertionError(f"no central directory entry for {name!r}")
