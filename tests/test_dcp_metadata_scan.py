"""The purpose-built DCP ``.metadata`` decoder (issue 28, item 4): the scan
(``ckptkit.decoding.dcp_scan``) and its column join (``formats/parts/dcp_metadata``) read every
DCP metadata torch, OLMo-core and Megatron-core wrote exactly as the allowlisting unpickler
does; what they do not recognise falls back to it; hostile edits are refused with the same typed
errors either way, and a scan never accepts a changed byte to mean something else.

Every check runs on real metadata: the checked-in fixtures, the DCP variants of
``writers.VARIANTS`` written by torch in this session, and checkpoints ``dcp.save`` writes here.
"""

from __future__ import annotations

import pickletools
import random
import re
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from byte_edits import unframed
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import ckptkit
from ckptkit.decoding.dcp_scan import ChunkRun, ScanDeclined, StorageRun, scan_dcp_metadata
from ckptkit.decoding.pickle_limits import METADATA_LIMITS
from ckptkit.errors import (
    CorruptRecordError,
    FormatError,
    PickleLimitError,
    UnsafePathError,
    UnsafePickleError,
)
from ckptkit.formats.megatron_dist.pickles import MEGATRON_GLOBALS
from ckptkit.formats.parts import dcp_metadata
from ckptkit.storage import Storage

import writers
from conformance_cases import CASES, FIXTURES

#: Every DCP metadata file checked in.
METADATA_FILES = sorted(FIXTURES.rglob("*.metadata"))


def _holds_dcp(path: Path) -> bool:
    """Whether a checked-in checkpoint holds DCP metadata (in a folder or a ``.nemo`` tar)."""
    if path.is_dir():
        return any(path.rglob("*.metadata"))
    if tarfile.is_tarfile(path):
        with tarfile.open(path) as archive:
            return any(name.endswith(".metadata") for name in archive.getnames())
    return False


#: Checked-in fixture cases whose checkpoint holds DCP metadata (their adapters read it).
DCP_FIXTURE_CASES = [
    case for case in CASES if case.id.startswith("fixture-") and _holds_dcp(case.locate(None))
]


# --------------------------------------------------------------------------------------------
# Helpers: open a checkpoint with one decoder only, and compare what two reads give.


def _open_with(path: Path, decoder: str, monkeypatch: pytest.MonkeyPatch) -> ckptkit.Checkpoint:
    """``ckptkit.open(path)`` with DCP metadata read by ``decoder`` alone: ``"scan"`` (the
    unpickler may not run: proof the scan read it) or ``"unpickler"``."""
    with monkeypatch.context() as patch:
        if decoder == "scan":

            def unpickled(*args, **kwargs):
                raise AssertionError("the scan declined and the unpickler ran")

            patch.setattr(dcp_metadata, "_read_unpickled", unpickled)
        else:

            def scanned(*args, **kwargs):
                raise ScanDeclined("not this time")

            patch.setattr(dcp_metadata, "_read_scanned", scanned)
        return ckptkit.open(str(path))


def _catalog(ckpt: ckptkit.Checkpoint) -> tuple:
    """Everything a catalog says, as comparable values (the chunks' and records' classes too:
    both decoders build the same stand-in classes)."""

    def record(r):
        if r is None:
            return None
        fields = (r.file, r.offset, r.length, r.encoding, r.transform, r.name, r.stride)
        return (type(r).__name__, *fields, r.storage_offset, r.crc32)

    entries = [
        (e.key, e.path, e.kind, e.dtype, e.shape, e.tensor_class, e.group,
         [(type(c).__name__, c.offsets, c.sizes, c.rank, c.flat, record(c.record))
          for c in e.chunks])
        for e in ckpt.catalog.entries.values()
    ]  # fmt: skip
    return ckpt.catalog.format, entries, ckpt.catalog.files, ckpt.catalog.facts


def _outcome(path: Path, decoder: str) -> tuple:
    """``read_dcp`` of the DCP at ``path`` by ``decoder``: its result, or its error's class and
    message."""
    storage = Storage(str(path))
    try:
        return ("read", dcp_metadata.read_dcp(storage, decoder=decoder))
    except ScanDeclined:
        raise
    except Exception as exc:  # the typed error both decoders must agree on
        return ("error", type(exc).__name__, str(exc))


def _allowlist(data: bytes) -> dict:
    """The allowlist the adapter reading this metadata uses (Megatron's adds its classes)."""
    if b"megatron" in data or b"getattr" in data:
        return {**dcp_metadata.ALLOWED_GLOBALS, **MEGATRON_GLOBALS}
    return dcp_metadata.ALLOWED_GLOBALS


def _scan(data: bytes):
    return scan_dcp_metadata(
        data,
        allow=_allowlist(data),
        classes=dcp_metadata.COLUMN_CLASSES,
        limits=METADATA_LIMITS,
        source="test.metadata",
    )


def _memo_opcodes(data: bytes) -> int:
    """MEMOIZE and PUT opcodes up to STOP, as pickletools reads them."""
    return sum(
        op.name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT")
        for op, _, _ in pickletools.genops(data)
    )


def _markers(value, seen=None) -> list:
    """Column-run markers anywhere in the scan's value (its lists, dicts and stand-ins)."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return []
    seen.add(id(value))
    if isinstance(value, ChunkRun | StorageRun):
        return [value]
    if isinstance(value, dict):
        items = [*value.keys(), *value.values()]
    elif isinstance(value, list | tuple):
        items = list(value)
    elif isinstance(value, dcp_metadata.Standin):
        items = [getattr(value, "state", None)]
    else:
        return []
    return [m for item in items for m in _markers(item, seen)]


# --------------------------------------------------------------------------------------------
# Both decoders give the same catalogs: every fixture, every written variant.


@pytest.mark.parametrize("case", DCP_FIXTURE_CASES, ids=lambda c: c.id)
def test_fixtures_are_read_alike_by_the_scan_and_the_unpickler(case, monkeypatch):
    path = case.locate(None)
    scanned = _catalog(_open_with(path, "scan", monkeypatch))
    unpickled = _catalog(_open_with(path, "unpickler", monkeypatch))
    assert scanned == unpickled
    assert scanned[1], "no entries"


@pytest.mark.parametrize("variant", list(writers.VARIANTS))
def test_written_variants_are_read_alike_by_the_scan_and_the_unpickler(
    variant, written, monkeypatch
):
    path = written(variant).path
    scanned = _catalog(_open_with(path, "scan", monkeypatch))
    assert scanned == _catalog(_open_with(path, "unpickler", monkeypatch))
    # and read_dcp itself, facts and files included
    assert _outcome(path, "scan") == _outcome(path, "unpickler")


@pytest.mark.parametrize("path", METADATA_FILES, ids=lambda p: str(p.relative_to(FIXTURES).parent))
def test_the_scan_gives_columns_and_counts_every_memo_entry(path):
    """The per-chunk records come out as numpy columns (the value holds markers into them,
    never an object per chunk), and the memo entries the scan counted, the column records'
    included, are exactly the pickle's MEMOIZE/PUT opcodes."""
    data = path.read_bytes()
    scanned = _scan(data)
    assert scanned.memo_entries == _memo_opcodes(data)
    markers = _markers(scanned.value)
    chunk_runs = [m for m in markers if isinstance(m, ChunkRun)]
    storage_runs = [m for m in markers if isinstance(m, StorageRun)]
    assert chunk_runs and storage_runs
    chunks, storage = scanned.chunks, scanned.storage
    assert isinstance(chunks.offsets, np.ndarray) and chunks.offsets.dtype == np.int64
    assert isinstance(storage.offset, np.ndarray) and storage.length.dtype == np.int64
    for run in chunk_runs:
        rows = slice(run.start, run.stop)
        assert run.stop <= len(chunks.offsets_ndim)
        assert (chunks.offsets_ndim[rows] == chunks.sizes_ndim[rows]).all()
    for run in storage_runs:
        rows = slice(run.start, run.stop)
        assert (storage.fqn[rows] >= 0).all() and (storage.file[rows] >= 0).all()
        names = {scanned.strings[code] for code in storage.file[rows].tolist()}
        assert all(n.endswith(".distcp") for n in names), names


# --------------------------------------------------------------------------------------------
# Unusual metadata torch writes: the scan falls back, or widens its rows, and agrees.


class _TaggingPlanner(DefaultSavePlanner):
    """A custom planner leaving a set in ``planner_data`` (a pickle opcode the scan does not
    decode: EMPTY_SET)."""

    def create_global_plan(self, all_plans):
        plans, metadata = super().create_global_plan(all_plans)
        metadata.planner_data = {**metadata.planner_data, "tags": {"nightly", "ablation"}}
        return plans, metadata


def _state(key_length: int = 8) -> dict:
    gen = torch.Generator().manual_seed(28)
    name = "w" * key_length
    return {"model": {name: torch.randn(6, 5, generator=gen), "bias": torch.randn(5, generator=gen)},
            "step": 3}  # fmt: skip


def test_metadata_from_a_custom_planner_falls_back_alike(tmp_path):
    path = tmp_path / "ckpt"
    dcp.save(_state(), checkpoint_id=str(path), planner=_TaggingPlanner())
    with pytest.raises(ScanDeclined, match="opcode 0x8f"):
        _scan((path / ".metadata").read_bytes())
    with pytest.raises(ScanDeclined):
        _outcome(path, "scan")
    auto = _outcome(path, "auto")
    assert auto == _outcome(path, "unpickler")
    assert auto[0] == "read" and {e.key for e in auto[1][0]} >= {"model.bias", "step"}


def test_long_keys_are_read_from_wider_rows_alike(tmp_path):
    """Keys of 200 characters make each storage record longer than the first byte matrix:
    those rows are decoded again in a wider one, not left to the unpickler."""
    path = tmp_path / "ckpt"
    dcp.save(_state(key_length=200), checkpoint_id=str(path))
    scanned = _scan((path / ".metadata").read_bytes())
    long_rows = [scanned.strings[c] for c in scanned.storage.fqn.tolist() if c >= 0]
    assert any(len(name) > 200 for name in long_rows)
    assert _outcome(path, "scan") == _outcome(path, "unpickler")


# --------------------------------------------------------------------------------------------
# Hostile edits: refused alike, with a typed error naming the file.


def _memo_of_global(data: bytes, qualname: str) -> int:
    """The memo index of the global ``module.name`` a pickle loads (STACK_GLOBAL)."""
    memo: dict[int, object] = {}
    pushed: list[object] = []
    count = 0
    wanted = None
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE"):
            pushed.append(arg)
        elif op.name in ("BINGET", "LONG_BINGET"):
            pushed.append(memo.get(arg))
        elif op.name == "STACK_GLOBAL":
            pushed.append(("global", f"{pushed[-2]}.{pushed[-1]}"))
        elif op.name == "MEMOIZE":
            memo[count] = pushed[-1] if pushed else None
            if pushed and pushed[-1] == ("global", qualname) and wanted is None:
                wanted = count
            count += 1
        else:
            pushed.append(None)
    assert wanted is not None, qualname
    return wanted


def _get(index: int) -> bytes:
    return b"h" + bytes([index]) if index < 256 else b"j" + index.to_bytes(4, "little")


_META = "torch.distributed.checkpoint.metadata."
_HEAD = b")\x81\x94}\x94("


def _swap_chunk_class(data: bytes) -> bytes:
    """The 5th chunk record names the ``TensorStorageMetadata`` class instead."""
    chunk = _memo_of_global(data, _META + "ChunkStorageMetadata")
    info = _memo_of_global(data, _META + "TensorStorageMetadata")
    record = _get(chunk) + _HEAD
    at = -1
    for _ in range(5):
        at = data.index(record, at + 1)
    return data[:at] + _get(info) + data[at + len(_get(chunk)) :]


def _negative_size(data: bytes) -> bytes:
    """A chunk's size (of a record the scan reads as columns) becomes -1 (BININT)."""
    sizes = data.index(b"\x8c\x05sizes\x94")
    key = _get(sum(op.name == "MEMOIZE" for op, _, pos in pickletools.genops(data) if pos < sizes))
    at = data.index(key, data.index(key, sizes) + 1)  # the 2nd record naming 'sizes' by memo
    box = at + len(key) + 2  # past the key and torch.Size's GET (h + index)
    width = {ord("K"): 2, ord("M"): 3, ord("J"): 5}[data[box]]
    return data[:box] + b"J\xff\xff\xff\xff" + data[box + width :]


def _rename_key(data: bytes) -> bytes:
    """A storage record's key (written inline; the 3rd of the storage_data) names no tensor
    of the checkpoint."""
    fqn = data.index(b"\x8c\x03fqn\x94")
    found = list(re.finditer(rb"\x8c(.)model\.", data[fqn:], re.DOTALL))[2]
    at, size = fqn + found.start(), found.group(1)[0]
    return data[: at + 2] + b"X" * size + data[at + 2 + size :]


def _outside_file(data: bytes) -> bytes:
    return data.replace(b"\x8c\x0c__0_0.distcp", b"\x8c\x0c/etc/passwd.", 1)


def _unknown_global(data: bytes) -> bytes:
    return data.replace(b"ChunkStorageMetadata", b"ChunkStorageMetadatX", 1)


def _late_memo(data: bytes) -> bytes:
    """A storage record's file named by a memo index not set yet (LONG_BINGET)."""
    path = data.index(b"\x8c\rrelative_path\x94")
    key = _get(sum(op.name == "MEMOIZE" for op, _, pos in pickletools.genops(data) if pos < path))
    at = data.index(key, data.index(key, path) + 1) + len(key)  # the 2nd record's file
    width = 2 if data[at] == ord("h") else 5
    return data[:at] + b"j\x00\x00\x00\x01" + data[at + width :]


def _huge_put(data: bytes) -> bytes:
    return data[:2] + b"Nr\xff\xff\xff\x7f0" + data[2:]  # NONE, LONG_BINPUT 2**31-1, POP


def _truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


#: case → (edit, the error opening the checkpoint raises, whether it names the file: the
#: catalog builder's checks name the key instead)
HOSTILE = {
    "a global off the allowlist": (_unknown_global, UnsafePickleError, True),
    "a chunk record of another class": (_swap_chunk_class, FormatError, True),
    "a negative chunk size": (_negative_size, FormatError, False),
    "a record for no tensor": (_rename_key, FormatError, True),
    "a file outside the checkpoint": (_outside_file, UnsafePathError, True),
    "a memo index set later": (_late_memo, CorruptRecordError, True),
    "a memo index of 2**31": (_huge_put, PickleLimitError, True),
    "a truncated pickle": (_truncated, CorruptRecordError, True),
}


@pytest.fixture(scope="module")
def plain_metadata() -> bytes:
    """The torch 2.2 FSDP1 fixture's metadata without frames (so edits may change lengths)."""
    return unframed((FIXTURES / "dcp_torch22_fsdp1_ws2/checkpoint/.metadata").read_bytes())


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_edits_are_refused_alike(case, plain_metadata, tmp_path):
    edit, error, names_file = HOSTILE[case]
    path = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "dcp_torch22_fsdp1_ws2/checkpoint", path)
    edited = edit(plain_metadata)
    assert edited != plain_metadata
    (path / ".metadata").write_bytes(edited)
    with pytest.raises(ScanDeclined):
        _outcome(path, "scan")
    assert _outcome(path, "auto") == _outcome(path, "unpickler")
    with pytest.raises(error) as info:
        ckptkit.open(str(path))
    assert not names_file or str(path / ".metadata") in str(info.value), info.value


def test_no_changed_byte_is_read_differently(plain_metadata, tmp_path):
    """Bytes changed at random (many inside the records the scan reads as columns: their
    ints, lengths, memo indices and opcodes): whenever the scan accepts the result it reads
    what the unpickler reads, and otherwise the unpickler's error stands."""
    path = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "dcp_torch22_fsdp1_ws2/checkpoint", path)
    rng = random.Random(28)
    start = plain_metadata.index(b"\x8c\x06chunks\x94")
    # bytes after a BININT1 opcode: mostly the ints of chunk boxes, offsets and lengths
    payloads = [m.start() + 1 for m in re.finditer(rb"K", plain_metadata[start:])]
    accepted = 0
    for attempt in range(100):
        edited = bytearray(plain_metadata)
        if attempt % 3:
            edited[start + rng.choice(payloads)] = rng.randrange(256)
        else:
            edited[rng.randrange(start, len(edited) - 1)] = rng.randrange(256)
        (path / ".metadata").write_bytes(bytes(edited))
        unpickled = _outcome(path, "unpickler")
        try:
            scanned = _outcome(path, "scan")
        except ScanDeclined:
            continue
        accepted += 1
        assert scanned == unpickled
    assert accepted > 30  # a changed int leaves a pickle the scan reads
