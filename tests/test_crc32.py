"""CRC-32 combination agrees with zlib over concatenations of any lengths."""

from __future__ import annotations

import os
import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit import crc32


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
