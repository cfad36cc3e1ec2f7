"""Large outputs to S3 go up as multipart-upload parts while they are written (never staged on
local disk), against the session's real S3-protocol server: the objects equal a local run's
bytes, a failure leaves no object and no upload in progress, and a killed run's uploads are
aborted by the next run into that destination."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path
from urllib.parse import parse_qs

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from byte_edits import damaged_copy

import ckptkit
from ckptkit import tunables
from ckptkit.errors import ChecksumError
from ckptkit.storage import multipart

#: Parts of the protocol's minimum size, so a ~20 MiB file goes up in several.
PART = multipart.MIN_PART_BYTES


@pytest.fixture(scope="module")
def large(tmp_path_factory) -> Path:
    """A 20 MiB DCP checkpoint written by torch's own writer (one process): five 4 MiB
    tensors, so ``model.pt`` / ``model.safetensors`` take four parts and a piece."""
    path = tmp_path_factory.mktemp("large") / "ckpt"
    generator = torch.Generator().manual_seed(7)
    state = {
        "model": {f"layer{i}.w": torch.randn(1024, 1024, generator=generator) for i in range(5)}
    }
    state["model"]["bias"] = torch.randn(1000, generator=generator)
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, checkpoint_id=str(path))
    return path


@pytest.fixture
def bucket(s3) -> str:
    fs = fsspec.filesystem("s3")
    name = f"uploads-{uuid.uuid4().hex[:10]}"
    fs.mkdir(name)
    return name


@pytest.fixture(autouse=True)
def small_parts(monkeypatch, s3):
    """Parts of the minimum size, short retry backoffs; the server's log and pending failures
    cleared after each test."""
    monkeypatch.setattr(tunables, "UPLOAD_PART_BYTES", PART)
    monkeypatch.setattr(tunables, "RETRY_BACKOFF_S", 0.01)
    yield
    s3.traffic.reset()


def uploads_in_progress(bucket: str) -> list[str]:
    found = fsspec.filesystem("s3").call_s3("list_multipart_uploads", Bucket=bucket)
    return [upload["Key"] for upload in found.get("Uploads", [])]


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("to", ["torch", "safetensors"])
def test_a_large_file_goes_up_in_parts_as_it_is_written(s3, large, bucket, tmp_path, to, workers):
    local = ckptkit.unshard(str(large), str(tmp_path / "local"), to=to, progress=False)
    destination = f"s3://{bucket}/out"
    s3.traffic.reset()
    result = ckptkit.unshard(str(large), destination, to=to, workers=workers, progress=False)
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    assert [f.name for f in result.files] == [f.name for f in local.files]
    for file in local.files:
        assert (
            fs.cat_file(f"{bucket}/out/{file.name}")
            == (tmp_path / "local" / file.name).read_bytes()
        )
    model = next(f for f in local.files if f.name.startswith("model."))
    requests = [r for r in s3.traffic.snapshot() if r.path == f"/{bucket}/out/{model.name}"]
    parts = [r for r in requests if r.method == "PUT" and "partNumber" in parse_qs(r.query)]
    numbers = sorted(int(parse_qs(r.query)["partNumber"][0]) for r in parts)
    assert numbers == list(range(1, -(-model.nbytes // PART) + 1)), numbers
    assert all(r.status == 200 for r in parts)
    assert not [r for r in requests if r.method == "PUT" and not r.query]  # never put whole
    created = [
        r.seq
        for r in requests
        if r.method == "POST" and "uploads" in parse_qs(r.query, keep_blank_values=True)
    ]
    completed = [r.seq for r in requests if r.method == "POST" and "uploadId" in parse_qs(r.query)]
    assert len(created) == len(completed) == 1 and created[0] < min(r.seq for r in parts)
    assert completed[0] > max(r.seq for r in parts)  # the object appears once, whole
    assert uploads_in_progress(bucket) == []


def test_a_failure_leaves_no_object_and_no_upload_in_progress(s3, large, bucket, tmp_path):
    damaged, key = damaged_copy(large, tmp_path / "damaged")
    destination = f"s3://{bucket}/failed"
    s3.traffic.reset()
    with pytest.raises(ChecksumError, match=key):
        ckptkit.unshard(str(damaged), destination, to="safetensors", workers=2, progress=False)
    assert [r for r in s3.traffic.snapshot() if "partNumber" in r.query]  # parts had gone up
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    assert fs.find(f"{bucket}/failed") == []
    assert uploads_in_progress(bucket) == []


#: Killed after its first part went up. argv: source, destination.
DIE_AFTER_A_PART = textwrap.dedent(
    """
    import os, sys
    from ckptkit import tunables
    from ckptkit.storage import multipart

    tunables.UPLOAD_PART_BYTES = multipart.MIN_PART_BYTES
    send = multipart.RangedUpload._send

    def dying(self, index, data):
        send(self, index, data)
        os._exit(9)

    multipart.RangedUpload._send = dying
    import ckptkit
    ckptkit.unshard(sys.argv[1], sys.argv[2], to="safetensors", progress=False)
    """
)


def test_a_killed_runs_upload_is_aborted_by_the_next_run(s3, large, bucket, tmp_path, monkeypatch):
    staging = tmp_path / "tmp"
    staging.mkdir()
    script = tmp_path / "die.py"
    script.write_text(DIE_AFTER_A_PART)
    destination = f"s3://{bucket}/killed"
    environment = {**__import__("os").environ, "TMPDIR": str(staging)}
    done = subprocess.run(
        [sys.executable, str(script), str(large), destination],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 9, done.stderr
    assert uploads_in_progress(bucket) == ["killed/model.safetensors"]
    assert len(list(staging.iterdir())) == 1  # the dead run's staging folder, listing its upload
    monkeypatch.setattr(tempfile, "tempdir", str(staging))
    ckptkit.unshard(str(large), destination, to="safetensors", progress=False)
    assert uploads_in_progress(bucket) == []
    assert list(staging.iterdir()) == []
    local = ckptkit.unshard(str(large), str(tmp_path / "local"), to="safetensors", progress=False)
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    for file in local.files:
        assert (
            fs.cat_file(f"{bucket}/killed/{file.name}")
            == (tmp_path / "local" / file.name).read_bytes()
        )


def test_pieces_in_any_order_from_many_threads_make_the_object(s3, bucket):
    """Blocks filled by several writers, in any order, one byte or a block at a time, and a
    gap never written (zeros): the object is exactly the bytes, and a second write to a byte
    already sent is refused."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    from ckptkit.errors import DestinationError
    from ckptkit.storage import Storage

    size = 3 * PART + 12345
    data = bytearray(random.Random(3).randbytes(size))
    gap = (PART + 100, PART + 200)
    data[gap[0] : gap[1]] = bytes(gap[1] - gap[0])
    cuts = sorted({0, size, *random.Random(4).sample(range(1, size), 60), PART, 2 * PART, *gap})
    pieces = [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if (a, b) != gap]
    random.Random(5).shuffle(pieces)
    upload = multipart.RangedUpload(Storage(f"s3://{bucket}/direct"), "blob.bin", size)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda piece: upload.write_at(piece[0], data[piece[0] : piece[1]]), pieces))
    with pytest.raises(DestinationError, match="written twice"):
        upload.write_at(0, b"x")
    with pytest.raises(DestinationError, match="beyond its planned size"):
        upload.write_at(size - 1, b"xy")
    upload.close()
    upload.complete()
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    assert fs.cat_file(f"{bucket}/direct/blob.bin") == bytes(data)
    assert uploads_in_progress(bucket) == []


def test_a_part_the_store_refuses_fails_the_job_and_leaves_nothing(s3, large, bucket):
    from ckptkit.errors import AccessDeniedError

    destination = f"s3://{bucket}/refused"
    s3.traffic.reset()
    s3.traffic.fail(
        lambda method, path: method == "PUT" and path.endswith("/refused/model.safetensors"),
        status=403,
        code="AccessDenied",
    )
    with pytest.raises(AccessDeniedError, match=r"refused/model\.safetensors"):
        ckptkit.unshard(str(large), destination, to="safetensors", workers=2, progress=False)
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    assert fs.find(f"{bucket}/refused") == []
    assert uploads_in_progress(bucket) == []
