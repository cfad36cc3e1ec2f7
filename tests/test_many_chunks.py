"""Many small chunks and column shards: a DCP written by torch from 2 gloo ranks (hundreds of
small row-sharded DTensors of a few shapes and dtypes, plus column-sharded ones) is unsharded
bit-equal to torch's ``dcp_to_torch_save``, with its records fetched in a few batches of reads
and decoded mostly by their zip layout; damage to one record in such a batch still raises a
typed error naming the file and the key; column shards stream in bounded row blocks."""

from __future__ import annotations

import random
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import ckptkit
from ckptkit import reading, tunables
from ckptkit.catalog.coverage import check_coverage, first_fault
from ckptkit.catalog.model import Chunk, Entry
from ckptkit.decoding import record_layouts
from ckptkit.decoding.records import TorchArchive
from ckptkit.dtypes import dtype as ckpt_dtype
from ckptkit.errors import ChecksumError, CorruptRecordError, CoverageError, TruncatedFileError
from ckptkit.examples import _spawn
from ckptkit.storage import Storage

from oracle import assert_bit_equal

WORLD_SIZE = 2
N_SMALL = 240  # row-sharded tensors of 2 chunks each
#: (shape, dtype) of the small tensors, in turn: several record layouts of several lengths
SMALL_KINDS = [
    ((4, 3), torch.float32),
    ((6, 5), torch.bfloat16),
    ((2, 7), torch.int64),
    ((8,), torch.float16),
]
COLUMNS = {  # column-sharded tensors: name → shape (the second dimension split unevenly)
    "wide": (96, 41),
    "tall": (300, 9),
}


def small_key(i: int) -> str:
    return f"blocks.{i // 10}.w{i % 10}"


def small_full(i: int) -> torch.Tensor:
    """Small tensor ``i`` in full (every rank computes the same values)."""
    shape, dt = SMALL_KINDS[i % len(SMALL_KINDS)]
    values = torch.arange(i * 100, i * 100 + torch.Size(shape).numel(), dtype=torch.float64)
    return values.reshape(shape).to(dt)


def column_full(name: str) -> torch.Tensor:
    shape = COLUMNS[name]
    return torch.randn(shape, generator=torch.Generator().manual_seed(len(name)))


def _save_rank(rank: int, world_size: int, path: str) -> None:
    """Rank body: small tensors built from each rank's own rows (no collective per tensor),
    column shards scattered by ``distribute_tensor``; saved by ``dcp.save``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    model = {}
    for i in range(N_SMALL):
        full = small_full(i)
        local = full.chunk(world_size)[rank].contiguous()
        model[small_key(i)] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )
    for name in COLUMNS:
        model[name] = distribute_tensor(column_full(name), mesh, [Shard(1)])
    dcp.save({"model": model}, storage_writer=FileSystemWriter(path))


@pytest.fixture(scope="module")
def many(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """The checkpoint, and what torch's own ``dcp_to_torch_save`` makes of it (the oracle)."""
    root = tmp_path_factory.mktemp("many_chunks")
    _spawn(_save_rank, WORLD_SIZE, str(root / "ckpt"))
    dcp_to_torch_save(root / "ckpt", root / "reference.pt")
    return root / "ckpt", torch.load(root / "reference.pt", weights_only=True)["model"]


@pytest.fixture
def damaged(many, tmp_path) -> Path:
    """A private copy of the checkpoint, free to damage."""
    target = tmp_path / "ckpt"
    shutil.copytree(many[0], target)
    return target


class _Counts:
    """Calls of the record parser and of storage reads while unsharding."""

    def __init__(self, monkeypatch) -> None:
        self.parsed = self.reads = 0
        parse, read = reading.fetch.decode_tensor_record, Storage.read_ranges

        def counted_parse(*args, **kwargs):
            self.parsed += 1
            return parse(*args, **kwargs)

        def counted_read(storage, ranges):
            self.reads += 1
            return read(storage, ranges)

        monkeypatch.setattr(reading.fetch, "decode_tensor_record", counted_parse)
        monkeypatch.setattr(Storage, "read_ranges", counted_read)


@pytest.mark.parametrize("to", ["safetensors", "torch"])
def test_unshard_many_small_chunks_bit_equal(many, tmp_path, monkeypatch, to):
    path, expected = many
    ckpt = ckptkit.open(str(path))
    chunks = sum(len(e.chunks) for e in ckpt.catalog.tensors())
    assert chunks >= 2 * N_SMALL + 2 * len(COLUMNS)
    counts = _Counts(monkeypatch)
    ckptkit.unshard(str(path), str(tmp_path / "out"), to=to, progress=False)
    if to == "safetensors":
        got = load_file(tmp_path / "out" / "model.safetensors")
    else:
        got = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    assert got.keys() == expected.keys()
    for key, tensor in expected.items():
        assert_bit_equal(got[key], tensor, key)
    # records of one layout are decoded by comparison, not parsed one by one …
    assert counts.parsed <= 3 * len(SMALL_KINDS) + 2 * WORLD_SIZE * len(COLUMNS), counts.parsed
    # … and fetched many per batch of reads, not one round per tensor
    assert counts.reads <= 40, counts.reads


def test_read_ahead_in_any_order(many):
    """Tensors announced in one order and asked for in others come out the same."""
    path, expected = many
    ckpt = ckptkit.open(str(path))
    tensors = ckpt.catalog.tensors()
    reader = ckpt.reader
    reader.read_ahead(tensors)
    shuffled = list(tensors)
    random.Random(0).shuffle(shuffled)
    for order in (list(reversed(tensors)), shuffled, tensors):
        for entry in order:
            got = b"".join(reader.iter_bytes(entry))
            want = expected[entry.key.removeprefix("model.")]
            assert got == want.contiguous().view(torch.uint8).numpy().tobytes(), entry.key


def test_column_shards_stream_in_row_blocks(many, monkeypatch):
    """A column-sharded tensor larger than a row block streams in several pieces of at most
    a block each, which join to torch's tensor; small blocks are forced here."""
    path, expected = many
    monkeypatch.setattr(tunables, "ROW_BLOCK_BYTES", 1000)
    ckpt = ckptkit.open(str(path))
    for name in COLUMNS:
        entry = ckpt.catalog.entries[f"model.{name}"]
        assert len({c.offsets for c in entry.chunks}) == WORLD_SIZE
        assert all(c.offsets[0] == 0 and c.offsets[1] for c in entry.chunks[1:])  # columns
        pieces = list(ckpt.reader.iter_bytes(entry))
        row = entry.shape[1] * 4
        assert len(pieces) > 1
        assert all(len(p) <= max(row, 1000) for p in pieces)
        want = expected[name].contiguous().view(torch.uint8).numpy().tobytes()
        assert b"".join(pieces) == want
        assert_bit_equal(ckpt.read(f"model.{name}"), expected[name], name)


def _record_of(path: Path, key: str, rank: int):
    ckpt = ckptkit.open(str(path))
    entry = ckpt.catalog.entries[key]
    return entry, next(c.record for c in entry.chunks if c.record.file == f"__{rank}_0.distcp")


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("member", ["data/0", "data.pkl"])
def test_damaged_record_in_a_batch_names_file_and_key(damaged, tmp_path, member):
    """One byte flipped in the storage (CRC-32) or the pickle of a record in the middle of a
    batch of same-layout records: unshard and read raise a typed error naming both."""
    key = f"model.{small_key(101)}"
    _, record = _record_of(damaged, key, 1)
    blob = (damaged / record.file).read_bytes()[record.offset : record.offset + record.length]
    archive = TorchArchive(blob, "record")
    found = archive.members[archive.prefix + member]
    _flip(damaged / record.file, record.offset + found.offset + found.size // 2)
    for attempt in (
        lambda: ckptkit.unshard(str(damaged), str(tmp_path / "out"), progress=False),
        lambda: ckptkit.open(str(damaged)).read(key),
    ):
        with pytest.raises((ChecksumError, CorruptRecordError)) as error:
            attempt()
        assert key in str(error.value) and record.file in str(error.value)
    assert not (tmp_path / "out").exists()
    # without CRC checks a flipped storage byte reads as what the file now holds
    if member == "data/0":
        reader = reading.Reader(Storage(str(damaged)), verify_crc=False)
        entry = ckptkit.open(str(damaged)).catalog.entries[key]
        assert not torch.equal(
            reading.geometry.tensor_from_numpy(reader.read_array(entry), entry.dtype),
            small_full(101),
        )


def test_truncated_file_names_the_first_key_past_its_end(damaged, tmp_path):
    ckpt = ckptkit.open(str(damaged))
    file = damaged / "__1_0.distcp"
    cut = file.stat().st_size // 2
    past = [
        e.key
        for e in ckpt.catalog.tensors()
        if any(
            c.record.file == file.name and c.record.offset + c.record.length > cut for c in e.chunks
        )
    ]
    with open(file, "r+b") as f:
        f.truncate(cut)
    with pytest.raises(TruncatedFileError) as error:
        ckptkit.unshard(str(damaged), str(tmp_path / "out"), to="safetensors", progress=False)
    assert file.name in str(error.value)
    assert any(repr(key) in str(error.value) for key in past)


def _entry(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> Entry:
    chunks = tuple(Chunk(offsets, sizes, None) for offsets, sizes in boxes)
    return Entry("t", ("t",), "tensor", chunks, ckpt_dtype("float32"), shape)


@pytest.mark.parametrize(
    "boxes",
    [
        [((0, 0), (2, 4)), ((2, 0), (2, 4))],  # rows in order: tiles
        [((2, 0), (2, 4)), ((0, 0), (2, 4))],  # out of order: tiles
        [((0, 0), (2, 4)), ((3, 0), (1, 4))],  # a hole
        [((0, 0), (3, 4)), ((2, 0), (2, 4))],  # an overlap
        [((0, 0), (2, 4)), ((2, 0), (1, 4))],  # short of the end
        [((0, 0), (2, 4)), ((2, 0), (2, 3))],  # a missing column
        [((0, 0), (2.0, 4)), ((2, 0), (2, 4))],  # not an int
        [((0, 0), (True, 4)), ((1, 0), (3, 4))],  # a bool (counts as 1)
        [((0, 0), (0, 4)), ((0, 0), (4, 4))],  # an empty chunk first
    ],
)
def test_row_fast_path_agrees_with_the_exact_check(boxes):
    """The one-pass check for rows in order decides exactly as the general corner check."""
    entry = _entry((4, 4), boxes)
    well_formed = all(type(v) in (int, bool) for o, n in boxes for v in (*o, *n))
    held = [(o, n) for o, n in boxes if all(n)]
    expected_ok = well_formed and first_fault((4, 4), held) is None
    if expected_ok:
        check_coverage(entry, list(entry.chunks))
    else:
        with pytest.raises(CoverageError):
            check_coverage(entry, list(entry.chunks))


def test_layout_is_not_trusted_past_a_differing_byte(many):
    """A learnt layout decodes another record torch wrote the same way (rank 1's, other
    values), and no longer matches once a byte of the zip headers differs."""
    path, _ = many
    _, record = _record_of(path, f"model.{small_key(0)}", 0)
    blob = (path / record.file).read_bytes()[record.offset : record.offset + record.length]
    layout = record_layouts.Layout.of(blob, "record")
    assert layout is not None and layout.matches(blob)
    damaged = bytearray(blob)
    struct.pack_into("<I", damaged, layout.segments[0][0] + 18, 12345)  # data.pkl's size
    assert not layout.matches(bytes(damaged))
    _, other_record = _record_of(path, f"model.{small_key(4)}", 1)  # same kind, rank 1
    again = (path / other_record.file).read_bytes()[
        other_record.offset : other_record.offset + other_record.length
    ]
    assert layout.matches(again)
    data = layout.tensor(again)
    assert (
        bytes(data.buffer)
        == small_full(4).chunk(2)[1].contiguous().view(torch.uint8).numpy().tobytes()
    )


def test_adjacent_records_are_read_as_one_range_per_file(many):
    """torch writes each rank's records back to back: coalesced, a batch of them is one
    range per file, and every record's bytes are found at its place inside it."""
    path, _ = many
    ckpt = ckptkit.open(str(path))
    records = [c.record for e in ckpt.catalog.tensors() for c in e.chunks]
    ranges = [(r.file, r.offset, r.offset + r.length) for r in records]
    ranges += ranges[:5]  # the same record asked twice (replicas) joins its range too
    merged, pieces = reading.fetch._coalesced(ranges)
    assert sorted(file for file, _, _ in merged) == [f"__{r}_0.distcp" for r in range(WORLD_SIZE)]
    data = {f: (path / f).read_bytes() for f, _, _ in merged}
    for (file, start, end), (group, a, b) in zip(ranges, pieces, strict=True):
        m_file, m_start, m_end = merged[group]
        assert m_file == file and m_start + a == start and m_start + b == end <= m_end
        assert data[file][m_start:m_end][a:b] == data[file][start:end]
