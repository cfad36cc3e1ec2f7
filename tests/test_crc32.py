"""ckptkit.crc32: the one CRC-32 function (a fast binding, zlib's values, zlib as the
fallback) and CRC combination, which agree with zlib over buffers and concatenations of any
lengths."""

from __future__ import annotations

import importlib
import os
import sys
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit import crc32

from isolated import run_script


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=300))
def test_combine_equals_crc_of_the_concatenation(a: bytes, b: bytes):
    assert crc32.combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_combine_over_many_pieces_and_large_lengths():
    pieces = [os.urandom(n) for n in (1, 7, 4096, 65537, 1 << 20)]
    crc = 0
    for piece in pieces:
        crc = crc32.combine(crc, zlib.crc32(piece), len(piece))
    assert crc == zlib.crc32(b"".join(pieces))
    zeros = bytes(3 << 30 >> 8)  # the shift for long runs: 12 MiB of zeros, checked by zlib
    assert crc32.combine(zlib.crc32(b"head"), zlib.crc32(zeros), len(zeros)) == zlib.crc32(
        b"head" + zeros
    )


def test_torch_save_output_crcs_combined_from_checked_sources_are_right(ws2, tmp_path):
    """Unsharding a DCP reuses the CRC-32 of each storage it just checked: the zip's CRCs then
    equal those computed over the output (zipfile's own check, and a run without checks, which
    computes every CRC itself, writes the same bytes)."""
    import zipfile

    import ckptkit

    checked = ckptkit.unshard(str(ws2.path), str(tmp_path / "checked"), progress=False)
    unchecked = ckptkit.unshard(
        ckptkit.open(str(ws2.path), verify_crc=False), str(tmp_path / "unchecked"), progress=False
    )
    assert [f.name for f in checked.files] == [f.name for f in unchecked.files]
    for file in checked.files:
        with zipfile.ZipFile(tmp_path / "checked" / file.name) as archive:
            assert archive.testzip() is None, file.name
        assert (tmp_path / "checked" / file.name).read_bytes() == (
            tmp_path / "unchecked" / file.name
        ).read_bytes()


def test_only_whole_checked_storages_carry_their_crc(ws2):
    """The reader hands out a CRC only for pieces that are a whole checked storage."""
    import ckptkit

    ckpt = ckptkit.open(str(ws2.path))
    pieces = [
        (bytes(piece), crc)
        for e in ckpt.catalog.tensors()
        for piece, crc in ckpt.reader.iter_checked(e)
    ]
    assert any(crc is not None for _, crc in pieces)
    for piece, crc in pieces:
        assert crc is None or crc == zlib.crc32(piece)


# -- the one CRC-32 function: a fast binding, zlib's values ---------------------------------

#: Lengths around the binding's internal block sizes (16, 64, 256, 4 Ki…) and odd ones.
_SIZES = [0, 1, 2, 3, 7, 15, 16, 17, 31, 63, 64, 65, 255, 256, 257, 4095, 4096, 4097, 65537]


def test_crc32_equals_zlib_on_buffers_of_many_sizes_and_alignments():
    """Same values as zlib for bytes, bytearray, memoryview and numpy buffers of every size
    tried, starting at unaligned offsets too, and for any starting value."""
    import numpy as np

    rng = np.random.default_rng(28)
    data = rng.integers(0, 256, (5 << 20) + 9, dtype=np.uint8).tobytes()
    view = memoryview(data)
    for size in [*_SIZES, 1 << 20, (1 << 20) + 3, 5 << 20]:
        for offset in (0, 1, 3, 8):
            piece = view[offset : offset + size]
            want = zlib.crc32(piece)
            assert crc32.crc32(piece) == want, (size, offset)
            assert crc32.crc32(bytes(piece)) == want
            assert crc32.crc32(bytearray(piece)) == want
            assert crc32.crc32(np.frombuffer(piece, np.uint8)) == want
        start = int(rng.integers(0, 1 << 32))
        assert crc32.crc32(view[:size], start) == zlib.crc32(view[:size], start), size


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2000), st.integers(0, 2000))
def test_running_crc_continues_like_zlib(data: bytes, cut: int):
    """``crc32(b, crc32(a)) == crc32(a + b)`` at any cut, as zlib computes it."""
    a, b = data[:cut], data[cut:]
    assert crc32.crc32(b, crc32.crc32(a)) == zlib.crc32(data)
    assert crc32.combine(crc32.crc32(a), crc32.crc32(b), len(b)) == zlib.crc32(data)


def test_the_fast_binding_is_used_when_installed():
    """ISA-L's CRC-32 (the ``isal`` dependency) where it is installed, else zlib's."""
    import importlib.util

    installed = importlib.util.find_spec("isal") is not None
    assert ("isal" if installed else "zlib") == crc32.IMPLEMENTATION
    if installed:
        from isal import isal_zlib

        assert crc32.crc32 is isal_zlib.crc32


def test_every_crc_goes_through_the_one_function():
    """No module but ckptkit/crc32.py computes a CRC-32 itself (zlib's or binascii's), so
    every check and every zip written uses the fast one."""
    import re
    from pathlib import Path

    package = Path(crc32.__file__).parent
    direct = re.compile(r"\b(zlib|binascii)\.crc32\b|from (zlib|binascii) import[^\n]*crc32")
    offenders = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path.name != "crc32.py" or path.parent != package
        if direct.search(path.read_text())
    ]
    assert offenders == []


@pytest.fixture
def without_binding(monkeypatch):
    """ckptkit.crc32 reloaded as if ``isal`` were not installed (and restored afterwards)."""
    monkeypatch.setitem(sys.modules, "isal", None)
    monkeypatch.setitem(sys.modules, "isal.isal_zlib", None)
    yield importlib.reload(crc32)
    monkeypatch.undo()
    importlib.reload(crc32)


def test_without_the_binding_zlib_computes_the_same(without_binding):
    """With the binding gone, crc32 is zlib's and combine the pure-Python arithmetic: the
    same values."""
    assert without_binding._binding() is None
    assert without_binding.IMPLEMENTATION == "zlib"
    assert without_binding.crc32 is zlib.crc32
    pieces = [os.urandom(n) for n in (0, 1, 4097, 1 << 16)]
    crc = 0
    for piece in pieces:
        crc = without_binding.combine(crc, without_binding.crc32(piece), len(piece))
    assert crc == zlib.crc32(b"".join(pieces))
    with pytest.raises(ValueError, match="length_b"):
        without_binding.combine(0, 0, -1)


def test_unshard_and_verify_without_the_binding_write_the_same_bytes(ws2, tmp_path):
    """A fresh interpreter where ``isal`` cannot be imported checks and writes CRCs with
    zlib: verify passes and the torch.save output is byte for byte the one made with the
    binding (whose zip CRCs zipfile accepts)."""
    import zipfile

    import ckptkit

    ckptkit.unshard(str(ws2.path), str(tmp_path / "fast"), progress=False)
    script = """
import sys
sys.modules["isal"] = None
import ckptkit, ckptkit.crc32
assert ckptkit.crc32.IMPLEMENTATION == "zlib", ckptkit.crc32.IMPLEMENTATION
assert ckptkit.verify(sys.argv[1]).empty
ckptkit.unshard(sys.argv[1], sys.argv[2], progress=False)
"""
    run_script(script, ws2.path, tmp_path / "fallback")
    names = sorted(p.name for p in (tmp_path / "fast").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "fallback").iterdir()) and names
    for name in names:
        fast, fallback = tmp_path / "fast" / name, tmp_path / "fallback" / name
        assert fast.read_bytes() == fallback.read_bytes(), name
        with zipfile.ZipFile(fast) as archive:
            assert archive.testzip() is None, name
