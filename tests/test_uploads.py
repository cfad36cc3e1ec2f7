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


def assert_objects_equal(prefix: str, folder: Path) -> None:
    """Every file in the local ``folder`` is an object under ``prefix`` with the same bytes."""
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    for file in folder.iterdir():
        assert fs.cat_file(f"{prefix}/{file.name}") == file.read_bytes(), file.name


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("to", ["torch", "safetensors"])
def test_a_large_file_goes_up_in_parts_as_it_is_written(s3, large, bucket, tmp_path, to, workers):
    local = ckptkit.unshard(str(large), str(tmp_path / "local"), to=to, progress=False)
    destination = f"s3://{bucket}/out"
    s3.traffic.reset()
    result = ckptkit.unshard(str(large), destination, to=to, workers=workers, progress=False)
    assert [f.name for f in result.files] == [f.name for f in local.files]
    assert_objects_equal(f"{bucket}/out", tmp_path / "local")
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
    ckptkit.unshard(str(large), str(tmp_path / "local"), to="safetensors", progress=False)
    assert_objects_equal(f"{bucket}/killed", tmp_path / "local")


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


#: A torchrun job unsharding into S3, every rank writing parts of the one large file. argv:
#: source, destination, target, workers, folder for each rank's result (files, or the error).
SHARED_UPLOAD = textwrap.dedent(
    """
    import json, os, sys
    import torch.distributed as dist
    import ckptkit
    from ckptkit import tunables
    from ckptkit.storage import multipart

    tunables.UPLOAD_PART_BYTES = multipart.MIN_PART_BYTES
    tunables.SPLIT_FILE_BYTES = 0
    dist.init_process_group("gloo")
    src, dst, to, workers, out = sys.argv[1:6]
    try:
        result = ckptkit.unshard(src, dst, to=to, workers=int(workers), progress=False)
        found = [[f.name, f.nbytes] for f in result.files]
    except Exception as exc:
        found = [type(exc).__name__, str(exc)]
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as handle:
        json.dump(found, handle)
    dist.destroy_process_group()
    """
)


def _run_shared_upload(tmp_path, source, destination, to, workers) -> tuple[list, Path]:
    """Run :data:`SHARED_UPLOAD` on 2 ranks (each with its own staging folder); each rank's
    result and the folder of their logs."""
    import json

    from isolated import torchrun

    script, out, logs = tmp_path / "job.py", tmp_path / "results", tmp_path / "logs"
    script.write_text(SHARED_UPLOAD)
    out.mkdir()
    staging = tmp_path / "tmp"
    staging.mkdir()
    env = {"CKPTKIT_RANK_LOGS": str(logs), "TMPDIR": str(staging)}
    torchrun(script, source, destination, to, workers, out, env=env)
    assert list(staging.glob("*ckptkit*")) == []  # no staging folder left on any rank
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)], logs


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("to", ["torch", "safetensors"])
def test_ranks_under_torchrun_share_one_upload(s3, large, bucket, tmp_path, to, workers):
    """Two ranks write parts of the one large object: each sends the parts it wrote whole,
    hands the blocks it shares with the other rank to the one that started the upload, which
    completes it. The object equals one process's file; every part goes up once."""
    import re

    local = ckptkit.unshard(str(large), str(tmp_path / "local"), to=to, progress=False)
    destination = f"s3://{bucket}/shared"
    s3.traffic.reset()
    results, logs = _run_shared_upload(tmp_path, large, destination, to, workers)
    expected = [[f.name, f.nbytes] for f in local.files]
    assert results == [expected, expected]
    assert_objects_equal(f"{bucket}/shared", tmp_path / "local")
    model = next(f for f in local.files if f.name.startswith("model."))
    for rank in range(2):  # each rank wrote parts of it
        text = (logs / f"rank{rank}.log").read_text()
        found = re.search(rf"writing (\d+) of the (\d+) parts of {re.escape(model.name)} ", text)
        assert found and int(found[1]) >= 1 and int(found[2]) == 2 * workers, text
    requests = [r for r in s3.traffic.snapshot() if r.path == f"/{bucket}/shared/{model.name}"]
    parts = [r for r in requests if r.method == "PUT" and "partNumber" in parse_qs(r.query)]
    numbers = sorted(int(parse_qs(r.query)["partNumber"][0]) for r in parts)
    assert numbers == list(range(1, -(-model.nbytes // PART) + 1)), numbers  # each once
    posts = [r for r in requests if r.method == "POST"]
    assert len(posts) == 2  # one upload created, and completed
    assert not [r for r in requests if r.method == "PUT" and not r.query]
    assert uploads_in_progress(bucket) == []


def test_a_damaged_part_under_torchrun_fails_every_rank_and_leaves_no_upload(
    s3, large, bucket, tmp_path
):
    damaged, key = damaged_copy(large, tmp_path / "damaged")
    destination = f"s3://{bucket}/shared-failed"
    results, _ = _run_shared_upload(tmp_path, damaged, destination, "safetensors", 1)
    assert all(kind == "DistributedError" for kind, _ in results), results
    assert all("ChecksumError" in message and key in message for _, message in results), results
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    assert fs.find(f"{bucket}/shared-failed") == []
    assert uploads_in_progress(bucket) == []


def test_a_joined_upload_hands_its_parts_and_pieces_to_the_one_that_completes_it(s3, bucket):
    """The upload two ranks share, in one process: the joined side sends the blocks it wrote
    whole and hands over the rest; the creator takes them, completes, and the object is the
    bytes. A hand-over cut in other part sizes, or naming a part sent twice, is refused."""
    import random

    from ckptkit.errors import DestinationError
    from ckptkit.storage import Storage

    size = 4 * PART + 777
    data = random.Random(8).randbytes(size)
    cut = 2 * PART + 12345  # inside the third block: both sides write part of it
    storage = Storage(f"s3://{bucket}/joined")
    owner = multipart.RangedUpload(storage, "blob.bin", size)
    joined = multipart.RangedUpload(storage, "blob.bin", size, upload_id=owner.handle)
    assert joined.joined and not owner.joined
    joined.write_at(cut, data[cut:])
    handover = joined.hand_over()
    assert sorted(handover.sent) == [3, 4]  # the blocks it wrote whole went up
    assert [(p, len(b)) for p, b in handover.pieces] == [(cut, 3 * PART - cut)]
    with pytest.raises(DestinationError, match="parts of"):
        owner.take_over([multipart.Handover(PART * 2, {}, [])])
    owner.write_at(0, data[:cut])
    with pytest.raises(DestinationError, match="written twice"):
        owner.take_over([multipart.Handover(PART, {0: "etag"}, [])])
    owner.take_over([handover])
    owner.close()
    joined.abort()  # handed over: aborting it is the creator's, not this side's
    owner.complete()
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    assert fs.cat_file(f"{bucket}/joined/blob.bin") == data
    assert uploads_in_progress(bucket) == []
