"""A reader's reused read buffers (ckptkit.storage.local.ReadBuffers): large local reads land in
a small pool of buffers, reused once nothing views them, so streaming a checkpoint faults in no
fresh memory per record, and bytes handed out never change under their holder."""

from __future__ import annotations

import hashlib
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptkit
from ckptkit import tunables
from ckptkit.errors import CorruptRecordError
from ckptkit.reading.geometry import covering_chunks, tiles_first_dim
from ckptkit.storage import local

N_TENSORS = 5
SHAPE = (1024, 1024)  # float32: 4 MiB records, above local.LARGE_READ_MIN
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def large_records(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A DCP written by torch's own ``dcp.save`` (one process) whose tensor records are
    4 MiB each, and the tensors it holds."""
    path = tmp_path_factory.mktemp("large_records") / "ckpt"
    gen = torch.Generator().manual_seed(28)
    tensors = {f"w{i}": torch.randn(SHAPE, generator=gen) for i in range(N_TENSORS)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": tensors}, checkpoint_id=str(path))
    return path, tensors


@pytest.fixture
def new_buffers(monkeypatch) -> list[int]:
    """The sizes of the fresh anonymous buffers made from now on (pooled or not)."""
    made: list[int] = []
    make = local._anonymous

    def counted(size: int):
        made.append(size)
        return make(size)

    monkeypatch.setattr(local, "_anonymous", counted)
    return made


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def _tensor_entries(ckpt: ckptkit.Checkpoint) -> list:
    return sorted(ckpt.catalog.tensors(), key=lambda e: e.key)


def test_streaming_reuses_one_buffer_for_every_record(large_records, new_buffers):
    """Tensors streamed one after another, each piece let go before the next is read, all
    land in one pooled buffer: one fresh allocation for five 4 MiB records."""
    path, tensors = large_records
    ckpt = ckptkit.open(str(path))
    for entry in _tensor_entries(ckpt):
        digest = hashlib.sha256()
        for piece in ckpt.reader.iter_bytes(entry):
            digest.update(piece)
        del piece
        want = hashlib.sha256(_raw(tensors[entry.key.removeprefix("model.")])).digest()
        assert digest.digest() == want, entry.key
    assert len(new_buffers) == 1
    assert ckpt.reader.buffers.nbytes == new_buffers[0] >= SHAPE[0] * SHAPE[1] * 4


def test_pieces_kept_never_change_while_later_records_are_read(large_records, new_buffers):
    """Pieces a consumer keeps (as memoryviews and as numpy arrays) keep their buffers leased:
    later reads go elsewhere, and every kept piece still holds its own tensor's bytes."""
    path, tensors = large_records
    ckpt = ckptkit.open(str(path))
    entries = _tensor_entries(ckpt)
    kept = {}
    for i, entry in enumerate(entries):
        pieces = list(ckpt.reader.iter_bytes(entry))
        kept[entry.key] = pieces if i % 2 else [np.frombuffer(p, np.uint8) for p in pieces]
    for entry in entries:
        joined = b"".join(bytes(p) for p in kept[entry.key])
        assert joined == _raw(tensors[entry.key.removeprefix("model.")]), entry.key
    assert len(new_buffers) == len(entries)  # each kept record took a buffer of its own
    kept.clear()
    new_buffers.clear()
    for entry in entries:  # all let go: the pool serves every read again
        assert b"".join(ckpt.reader.iter_bytes(entry)) == _raw(
            tensors[entry.key.removeprefix("model.")]
        )
    assert new_buffers == []


def test_the_pool_holds_at_most_its_limit(large_records, new_buffers):
    """Past its limit the pool keeps no more buffers: reads beyond it get buffers of their
    own (freed with their last view), and their bytes are right."""
    path, tensors = large_records
    ckpt = ckptkit.open(str(path))
    buffers = ckpt.reader.buffers
    buffers.limit = 10 << 20  # two 4 MiB records (in 2 MiB steps: 2 x 6 MiB would not fit)
    kept = [list(ckpt.reader.iter_bytes(e)) for e in _tensor_entries(ckpt)]
    assert buffers.nbytes <= buffers.limit
    assert len(buffers._buffers) == 1
    assert len(new_buffers) == N_TENSORS
    for entry, pieces in zip(_tensor_entries(ckpt), kept, strict=True):
        assert b"".join(pieces) == _raw(tensors[entry.key.removeprefix("model.")])


def test_a_lease_is_reused_only_after_its_last_view_is_gone():
    """The same buffer comes back once every view (slices, casts, numpy arrays) is gone, and
    not before; a lease that needs more room than an idle buffer has gets another."""
    pool = local.ReadBuffers()
    first = pool.lease(3 << 20)
    address = np.frombuffer(first, np.uint8).ctypes.data
    array = np.frombuffer(first[1024:], np.float32)
    del first
    second = pool.lease(3 << 20)
    assert np.frombuffer(second, np.uint8).ctypes.data != address  # still viewed by array
    del array, second
    third = pool.lease(1 << 20)  # the smallest idle buffer that fits
    assert np.frombuffer(third, np.uint8).ctypes.data in (
        address,
        *(np.frombuffer(memoryview(b), np.uint8).ctypes.data for b in pool._buffers),
    )
    assert len(third) == 1 << 20 and not third.readonly
    del third
    bigger = pool.lease(9 << 20)
    assert len(bigger) == 9 << 20 and pool.nbytes <= pool.limit


def test_row_blocks_come_from_the_pool_and_stay_intact(new_buffers, monkeypatch):
    """Column-split tensors (Megatron TP=2 row-parallel weights) stream in row blocks leased
    from the reader's pool; blocks kept by the consumer are never overwritten, and blocks let
    go are reused."""
    monkeypatch.setattr(tunables, "ROW_BLOCK_BYTES", 1000)
    ckpt = ckptkit.open(str(FIXTURES / "megatron_mcore016_gpt_tp2_ws2" / "checkpoint"))
    split = [
        e
        for e in ckpt.catalog.tensors()
        if e.key.startswith("model.") and not tiles_first_dim(e, covering_chunks(e))
    ]
    assert len(split) == 4 and all(len(e.chunks) == 2 == len(e.shape) for e in split)
    for entry in split:
        kept = list(ckpt.reader.iter_bytes(entry))  # every block held to the end
        assert len(kept) > 2
        assert b"".join(kept) == ckpt.reader.read_array(entry).tobytes(), entry.key
    del kept
    before = len(new_buffers)
    for entry in split:  # blocks let go one by one: no fresh buffer needed
        joined = b"".join(ckpt.reader.iter_bytes(entry))
        assert joined == ckpt.reader.read_array(entry).tobytes(), entry.key
    assert len(new_buffers) == before


@pytest.mark.parametrize("to", ["safetensors", "torch"])
def test_unshard_through_reused_buffers_is_bit_equal(large_records, tmp_path, new_buffers, to):
    """Unsharding streams every record through one reused buffer and writes torch's tensors
    bit for bit (torch.save output: zip CRCs as zipfile computes them)."""
    path, tensors = large_records
    ckptkit.unshard(str(path), str(tmp_path), to=to, progress=False)
    if to == "safetensors":
        from safetensors.torch import load_file

        got = load_file(str(tmp_path / "model.safetensors"))
    else:
        with zipfile.ZipFile(tmp_path / "model.pt") as archive:
            assert archive.testzip() is None
        got = torch.load(tmp_path / "model.pt", weights_only=True)
    assert sorted(got) == sorted(tensors)
    for key, tensor in tensors.items():
        assert _raw(got[key]) == _raw(tensor), key
    assert len(new_buffers) == 1


def test_a_truncated_record_is_still_refused(large_records, tmp_path):
    """A data file cut short mid-record: the read into a pooled buffer comes back short and
    the reader refuses the record (never a short tensor, never SIGBUS)."""
    import shutil

    path, _ = large_records
    copy = tmp_path / "ckpt"
    shutil.copytree(path, copy)
    data = next(p for p in copy.iterdir() if p.suffix == ".distcp")
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - (1 << 20))
    ckpt = ckptkit.open(str(copy))
    last = max(ckpt.catalog.tensors(), key=lambda e: e.chunks[0].record.offset)
    with pytest.raises(CorruptRecordError, match="truncated"):
        ckpt.reader.read_array(last)
