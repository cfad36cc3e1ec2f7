"""Helpers that edit the bytes of real checkpoint files in tests: a pickle's FRAME opcodes taken
out so its opcodes can change length, the central directory entry of a zip member found, and a
DCP checkpoint copied with one tensor byte flipped."""

from __future__ import annotations

import pickletools
import shutil
from pathlib import Path

import ckptkit
from ckptkit.decoding.records import zip_members

__all__ = ["central_entry", "damaged_copy", "unframed"]


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


def damaged_copy(src: Path, dst: Path) -> tuple[Path, str]:
    """A copy of ``src`` with one byte flipped inside the storage of its largest tensor on
    ``__0_0.distcp``; that tensor's key."""
    shutil.copytree(src, dst)
    ckpt = ckptkit.open(str(dst))
    _, key, record = max(
        (e.nbytes, e.key, c.record)
        for e in ckpt.catalog.tensors()
        for c in e.chunks
        if c.record is not None and c.record.file == "__0_0.distcp"
    )
    blob = (dst / record.file).read_bytes()[record.offset : record.offset + record.length]
    members = zip_members(memoryview(blob), "test")
    member = next(m for name, m in members.items() if name.endswith("/data/0"))
    raw = bytearray((dst / record.file).read_bytes())
    raw[record.offset + member.offset + member.size // 2] ^= 0x5A
    (dst / record.file).write_bytes(bytes(raw))
    return dst, key
