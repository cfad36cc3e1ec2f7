"""The opcode scan that runs before the C unpickler, over a pickle read in pieces: short strings
(most of what its pattern cannot skip, stepped over inline) are accepted wherever a piece
boundary cuts them, and refused when truncated or running past their frame. On the
``.metadata`` torch 2.2 wrote for the checked-in DCP fixture."""

from __future__ import annotations

import pickletools

import pytest

from ckptkit.decoding.pickle_limits import METADATA_LIMITS, scan_pieces
from ckptkit.errors import CorruptRecordError

from conformance_cases import FIXTURES

METADATA = (FIXTURES / "dcp_torch22_fsdp1_ws2" / "checkpoint" / ".metadata").read_bytes()
OPS = [(op.name, arg, pos) for op, arg, pos in pickletools.genops(METADATA)]
#: Where each SHORT_BINUNICODE starts, and its whole length (opcode, length byte, text).
STRINGS = [(pos, 2 + len(arg.encode())) for name, arg, pos in OPS if name == "SHORT_BINUNICODE"]
#: (start, end) of each protocol-4 frame's payload.
FRAMES = [(pos + 9, pos + 9 + arg) for name, arg, pos in OPS if name == "FRAME"]


def test_the_fixture_has_framed_short_strings():
    assert len(STRINGS) > 500 and FRAMES
    scan_pieces([METADATA], METADATA_LIMITS, "whole")


def cuts() -> list[int]:
    """Positions inside and around a sample of the short strings: at the opcode, after it,
    after its length byte, in its text, at its end."""
    found = set()
    for pos, size in STRINGS[:: max(1, len(STRINGS) // 60)]:
        found |= {pos, pos + 1, pos + 2, pos + size // 2, pos + size - 1, pos + size}
    return sorted(k for k in found if 0 < k < len(METADATA))


@pytest.mark.parametrize("cut", cuts())
def test_a_piece_boundary_anywhere_in_a_short_string(cut):
    scan_pieces([METADATA[:cut], METADATA[cut:]], METADATA_LIMITS, "pieces")
    scan_pieces(
        [METADATA[:cut], b"", METADATA[cut : cut + 1], METADATA[cut + 1 :]],
        METADATA_LIMITS,
        "three",
    )
    with pytest.raises(CorruptRecordError, match="truncated"):
        scan_pieces([METADATA[:cut]], METADATA_LIMITS, "truncated")


def test_a_short_string_running_past_its_frame_is_refused():
    """The last string of a frame made one byte longer: it straddles the frame's end."""
    start, end = FRAMES[0]
    pos, size = max((p, s) for p, s in STRINGS if start <= p and p + s <= end)
    edited = bytearray(METADATA)
    edited[pos + 1] += end - (pos + size) + 1  # now ends one byte past the frame
    with pytest.raises(CorruptRecordError, match="straddles the end of a frame"):
        scan_pieces([bytes(edited)], METADATA_LIMITS, "edited")
    with pytest.raises(CorruptRecordError, match="straddles the end of a frame"):
        scan_pieces([bytes(edited[: pos + 1]), bytes(edited[pos + 1 :])], METADATA_LIMITS, "cut")
