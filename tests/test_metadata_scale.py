"""Metadata at scale (issue 18): the DCP ``.metadata`` pickle is scanned and unpickled piece by
piece (never held twice), its catalog is built with the cyclic GC paused and then promoted past
the young generations, the chunks table is built column-wise, and ``read_object`` decodes a
file's pickle once. Each change must leave what is read exactly as it was."""

from __future__ import annotations

import gc
import random
import shutil

import pytest
import torch

import ckptkit
from ckptkit.catalog import tables
from ckptkit.decoding import pickle_limits, pickle_stream, unpickler
from ckptkit.decoding.dcp_scan import ScanDeclined
from ckptkit.errors import CheckpointError, CorruptRecordError
from ckptkit.formats.parts import dcp_metadata

from oracle import assert_catalog_matches_torch


def _catalog_dump(ckpt: ckptkit.Checkpoint) -> list:
    """Everything the catalog says, as plain comparable values."""

    def record(r):
        if r is None:
            return None
        return (r.file, r.offset, r.length, r.encoding, r.transform, r.name, r.stride,
                r.storage_offset, r.crc32)  # fmt: skip

    return [
        (e.key, e.path, e.kind, e.dtype, e.shape,
         [(c.offsets, c.sizes, c.rank, c.flat, record(c.record)) for c in e.chunks])
        for e in ckpt.catalog.entries.values()
    ]  # fmt: skip


def _outcome(fn, *args) -> object:
    try:
        fn(*args)
    except CheckpointError as exc:
        return type(exc).__name__, str(exc)
    return "ok"


# -- the pickle in pieces ------------------------------------------------------------------


@pytest.fixture(scope="module")
def many_keys(tmp_path_factory):
    """A single-process ``dcp.save`` of 3,000 small tensors: a ~1 MB .metadata, past the size
    up to which pickles are simulated whole (so it is scanned and fed in pieces)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    path = tmp_path_factory.mktemp("many_keys") / "ckpt"
    state = {"model": {f"layer{i}.w": torch.full((2, 3), float(i)) for i in range(3000)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(path))
    size = (path / ".metadata").stat().st_size
    assert size > pickle_limits.METADATA_LIMITS.simulate_bytes
    return path


def _declined(*args, **kwargs):
    raise ScanDeclined("this test reads metadata with the unpickler")


def test_metadata_read_in_small_pieces_gives_the_same_catalog(many_keys, monkeypatch):
    whole = ckptkit.open(str(many_keys))
    seen: list[int] = []
    reader_init = pickle_stream.PiecesReader.__init__

    def spy(self, pieces):
        seen.append(len(pieces))
        reader_init(self, pieces)

    monkeypatch.setattr(pickle_stream.PiecesReader, "__init__", spy)
    monkeypatch.setattr(pickle_stream, "PIECE", 997)  # an odd size: opcodes straddle pieces
    # the unpickler reads in pieces (the DCP scan, tried first, reads the file whole)
    monkeypatch.setattr(dcp_metadata, "_read_scanned", _declined)
    in_pieces = ckptkit.open(str(many_keys))
    assert seen and seen[0] > 500, seen  # the metadata really was fed in pieces
    assert _catalog_dump(in_pieces) == _catalog_dump(whole)
    assert len(whole.catalog.entries) == 3000
    assert_catalog_matches_torch(in_pieces, many_keys)
    assert in_pieces.read("model.layer2999.w").tolist() == [[2999.0] * 3] * 2


def test_pieces_reader_lets_go_of_what_was_read():
    reader = pickle_stream.PiecesReader([b"a" * 10, b"b" * 10, b"c" * 5])
    first = bytearray(12)
    assert reader.readinto(first) == 12 and bytes(first) == b"a" * 10 + b"bb"
    assert len(reader.pieces) == 2  # the first piece is released
    rest = bytearray(100)
    assert reader.readinto(rest) == 13 and bytes(rest[:13]) == b"b" * 8 + b"c" * 5
    assert not reader.pieces and reader.readinto(bytearray(4)) == 0


def test_scan_in_pieces_agrees_with_the_scan_of_the_whole(written):
    """Real pickles (a DCP .metadata, torch.save data.pkl, protocols 0-5) whole, truncated and
    damaged, split at random places: the verdict, error text included, never changes."""
    import pickle
    import zipfile

    path = written("fsdp2_ws2").path
    blobs = [(path / ".metadata").read_bytes()]
    data_pkl = path.parent / "data.pt"
    torch.save({"w": torch.ones(3), "meta": {"lr": 0.1, "name": "x" * 300}}, data_pkl)
    with zipfile.ZipFile(data_pkl) as archive:
        blobs += [archive.read(n) for n in archive.namelist() if n.endswith("data.pkl")]
    value = {"a": [1, 2.5, "s" * 300, b"b" * 7_000], "t": ("x",) * 5, "n": list(range(300))}
    blobs += [pickle.dumps(value, protocol=p) for p in range(6)]
    rng = random.Random(18)
    limits = pickle_limits.METADATA_LIMITS
    checked = 0
    for blob in blobs:
        damaged = bytearray(blob)
        for _ in range(3):
            damaged[rng.randrange(len(blob))] = rng.randrange(256)
        for variant in (blob, blob[: len(blob) // 2], blob[:-1], bytes(damaged)):
            expected = _outcome(pickle_limits.scan, variant, limits, "x")
            for n_cuts in (1, 3, 40):
                cuts = sorted(rng.sample(range(1, len(variant)), min(n_cuts, len(variant) - 1)))
                bounds = [0, *cuts, len(variant)]
                pieces = [variant[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
                assert _outcome(pickle_limits.scan_pieces, pieces, limits, "x") == expected
                checked += 1
        assert _outcome(pickle_limits.scan, blob, limits, "x") == "ok"
    assert checked == len(blobs) * 12


def test_truncated_metadata_is_refused_when_streamed(written, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(written("fsdp2_ws2").path, copy)
    metadata = copy / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:-7])
    with pytest.raises(CorruptRecordError, match=r"\.metadata.*truncated"):
        ckptkit.open(str(copy))


# -- the GC --------------------------------------------------------------------------------


def test_gc_is_enabled_again_after_a_failed_open(written, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(written("fsdp2_ws2").path, copy)
    metadata = copy / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[: metadata.stat().st_size // 2])
    assert gc.isenabled()
    with pytest.raises(CheckpointError):
        ckptkit.open(str(copy))
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_gc_left_disabled_when_the_caller_disabled_it(written):
    gc.disable()
    try:
        ckptkit.open(str(written("fsdp2_ws2").path))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_catalog_objects_skip_the_young_generations(written):
    """The chunks and records of a fresh catalog are in the oldest generation (not scanned by
    young collections), and nothing is left frozen."""
    gc.collect()
    ckpt = ckptkit.open(str(written("fsdp2_ws4").path))
    chunks = [c for e in ckpt.catalog.entries.values() for c in e.chunks]
    ids = {id(c) for c in chunks} | {id(c.record) for c in chunks if c.record is not None}
    assert len(ids) > 50
    young = {id(o) for o in gc.get_objects(generation=0)} | {
        id(o) for o in gc.get_objects(generation=1)
    }
    assert not ids & young
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert ids <= oldest
    assert gc.get_freeze_count() == 0


def test_objects_the_caller_froze_stay_frozen(written):
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        ckptkit.open(str(written("fsdp2_ws2").path))
        # not unfrozen (0), nor the catalog frozen too (more); frozen objects that other code
        # frees by reference counting leave the count as they go
        assert frozen - 100 <= gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


# -- tables --------------------------------------------------------------------------------


def test_chunks_table_lists_every_chunk_and_its_record(written):
    """The column-wise chunks table holds, row by row, each chunk and its record as the
    catalog has them."""
    ckpt = ckptkit.open(str(written("empty_chunks").path))
    frame = tables.chunks_table(ckpt.catalog)
    expected = [
        (e.key, c.offsets, c.sizes, c.numel, c.rank,
         c.record.file if c.record else None, c.record.offset if c.record else None,
         c.record.length if c.record else 0, c.record.encoding.value if c.record else None,
         c.record.transform if c.record else None)
        for e in ckpt.catalog.tensors() for c in e.chunks
    ]  # fmt: skip
    rows = list(frame.astype(object).where(frame.notna(), None).itertuples(False, None))
    assert rows == expected
    assert any(row[3] == 0 for row in rows)  # rank 3's empty chunk of few_rows
    assert str(frame["rank"].dtype) == str(frame["offset"].dtype) == "Int64"
    assert frame["numel"].dtype.kind == "i" and frame["length"].dtype.kind == "i"


# -- read_object ---------------------------------------------------------------------------


def test_read_object_decodes_a_file_pickle_once(tmp_path, monkeypatch):
    """200 objects of one torch.save file: one read of the file's pickle, one decode, and
    the values torch.load gives."""
    state = {
        "model": {f"layer{i}.weight": torch.full((64, 64), float(i)) for i in range(20)},
        "meta": {
            f"obj{i}": {"step": i, "name": f"n{i}", "lrs": [0.1 * i, 0.2]} for i in range(200)
        },
    }
    torch.save(state, tmp_path / "ckpt.pt")
    ckpt = ckptkit.open(str(tmp_path / "ckpt.pt"))
    keys = [f"ckpt.meta.obj{i}.name" for i in range(200)]
    assert set(keys) <= set(ckpt.keys())

    reads: list[list] = []
    read_ranges = ckpt.reader.storage.read_ranges

    def counting_reads(ranges, *args, **kwargs):
        reads.append(list(ranges))
        return read_ranges(ranges, *args, **kwargs)

    decodes = []
    load = unpickler._Unpickler.load

    def counting_load(self):
        decodes.append(self)
        return load(self)

    monkeypatch.setattr(ckpt.reader.storage, "read_ranges", counting_reads)
    monkeypatch.setattr(unpickler._Unpickler, "load", counting_load)
    values = [ckpt.read_object(key) for key in keys]
    assert values == [f"n{i}" for i in range(200)]
    assert len(decodes) == 1
    assert sum(len(r) for r in reads) == 1
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert ckpt.read_object("ckpt.meta.obj7.lrs") == loaded["meta"]["obj7"]["lrs"]
