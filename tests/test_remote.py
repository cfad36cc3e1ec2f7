"""Checkpoints in S3 (and on a plain HTTP mirror), against a real S3-protocol server.

The session's moto server (``s3`` fixture, see ``s3server.py``) logs every request with its
``Range`` header and body bytes, so the tests assert what ckptkit actually fetched, and it fails
chosen requests on purpose to exercise retries and error reporting.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import fsspec
import pytest
import torch

import ckptkit
import ckptkit.storage.retry as storage_module
from ckptkit import tunables
from ckptkit.errors import AccessDeniedError, CorruptRecordError, MissingFileError, StorageError
from ckptkit.storage import Storage

from oracle import assert_bit_equal

#: Fetched bytes may exceed the bytes asked for by at most this factor.
SLACK = 1.02


@pytest.fixture(autouse=True)
def fast_backoff_and_clean_log(monkeypatch, request):
    """Short retry backoffs; the server's log and pending failures cleared after each test."""
    monkeypatch.setattr(tunables, "RETRY_BACKOFF_S", 0.01)
    yield
    if "s3" in request.fixturenames:
        request.getfixturevalue("s3").traffic.reset()


def s3fs_() -> fsspec.AbstractFileSystem:
    return fsspec.filesystem("s3")


def upload(local: Path, bucket: str | None = None) -> str:
    """Upload the directory ``local`` under a fresh prefix; its ``s3://`` URL."""
    fs = s3fs_()
    bucket = bucket or f"ckpt-{uuid.uuid4().hex[:12]}"
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    key = f"{bucket}/runs/{uuid.uuid4().hex[:8]}/step2"
    fs.put(str(local), key, recursive=True)
    fs.invalidate_cache()  # ckptkit starts cold: no listing cached from the upload
    return f"s3://{key}"


def key_of(url: str, name: str = "") -> str:
    """The server path of ``url``/``name``: ``/bucket/key``."""
    path = "/" + url.removeprefix("s3://").rstrip("/")
    return f"{path}/{name}" if name else path


def record_bytes(entries) -> int:
    """Bytes of the distinct records behind ``entries`` (what reading them needs)."""
    return sum(
        length
        for length in {
            (c.record.file, c.record.offset): c.record.length
            for e in entries
            for c in e.chunks
            if c.record is not None
        }.values()
    )


@pytest.fixture(scope="module")
def sample(written):
    return written("fsdp2_ws2")


@pytest.fixture(scope="module")
def url(s3, sample) -> str:
    return upload(sample.path)


@pytest.fixture(scope="module")
def local(sample) -> ckptkit.Checkpoint:
    return ckptkit.open(str(sample.path))


# -- reading exactly what is needed -----------------------------------------------------------


def test_inspect_fetches_metadata_and_nothing_from_shards(s3, url, local):
    s3fs_().invalidate_cache()
    s3.traffic.reset()
    ckpt = ckptkit.open(url)
    tensors, chunks, files = ckpt.tensors, ckpt.chunks, ckpt.files

    assert tensors.equals(local.tensors)
    assert chunks.equals(local.chunks)
    assert files.equals(local.files)
    gets = s3.traffic.gets(key_of(url))
    assert [g.path for g in gets] == [key_of(url, ".metadata")]  # no .distcp at all
    assert gets[0].nbytes == Path(local.storage.path(".metadata")).stat().st_size


def test_one_tensor_fetches_its_records_only(s3, url, sample, local):
    ckpt = ckptkit.open(url)
    key = max(ckpt.catalog.tensors(), key=lambda e: e.nbytes).key
    entry = ckpt.entry(key)
    assert len({c.record.file for c in entry.chunks}) == 2  # sharded over both ranks' files
    s3.traffic.reset()
    value = ckpt.read(key)

    assert_bit_equal(value, local.read(key), key)
    fetched = s3.traffic.body_bytes(key_of(url))
    needed = record_bytes([entry])
    assert needed <= fetched <= SLACK * needed, (fetched, needed)
    ranges = sorted((g.path.rsplit("/", 1)[1], g.range) for g in s3.traffic.gets(key_of(url)))
    expected = sorted(
        (c.record.file, f"bytes={c.record.offset}-{c.record.offset + c.record.length - 1}")
        for c in entry.chunks
    )
    assert ranges == expected


def test_unshard_from_s3_fetches_record_bytes_and_matches_local(s3, url, local, tmp_path):
    ckpt = ckptkit.open(url)
    s3.traffic.reset()
    result = ckptkit.unshard(ckpt, str(tmp_path / "remote"), progress=False)
    fetched = s3.traffic.body_bytes(key_of(url))
    needed = record_bytes(ckpt.catalog.entries.values())
    assert needed <= fetched <= SLACK * needed, (fetched, needed)

    ckptkit.unshard(local, str(tmp_path / "local"), progress=False)
    names = sorted(f.name for f in result.files)
    assert names == sorted(p.name for p in (tmp_path / "local").iterdir())
    for name in names:
        assert (tmp_path / "remote" / name).read_bytes() == (tmp_path / "local" / name).read_bytes()


def test_load_state_dict_from_s3_equals_local(url, local):
    remote = ckptkit.load_state_dict(url, groups="model")
    expected = ckptkit.load_state_dict(local, groups="model")
    assert remote.keys() == expected.keys()
    flat = {k: v for k, v in remote["model"].items() if isinstance(v, torch.Tensor)}
    assert flat
    for k, v in flat.items():
        assert_bit_equal(v, expected["model"][k], k)


def test_large_ranges_are_fetched_in_bounded_pieces(s3, url, local, monkeypatch):
    """Requests never exceed MAX_REQUEST bytes: a record is fetched in pieces (in parallel),
    ``.metadata`` streamed in SEQUENTIAL_PIECE pieces, all exactly once."""
    monkeypatch.setattr(tunables, "MAX_REQUEST", 4096)
    monkeypatch.setattr(tunables, "SEQUENTIAL_PIECE", 8192)
    s3.traffic.reset()
    ckpt = ckptkit.open(url)
    metadata = s3.traffic.gets(key_of(url, ".metadata"))
    size = sum(r.nbytes for r in metadata)
    assert size == Path(local.storage.path(".metadata")).stat().st_size
    assert len(metadata) == -(-size // 8192) and max(r.nbytes for r in metadata) == 8192

    key = max(ckpt.catalog.tensors(), key=lambda e: e.nbytes).key
    s3.traffic.reset()
    assert_bit_equal(ckpt.read(key), local.read(key), key)
    gets = s3.traffic.gets(key_of(url))
    needed = record_bytes([ckpt.entry(key)])
    assert sum(r.nbytes for r in gets) == needed
    assert max(r.nbytes for r in gets) == 4096 and len(gets) >= needed // 4096


def test_client_side_count_matches_the_server(s3, url, tmp_path):
    """The notebook counts bytes with botocore's ``after-call`` event on ckptkit's client
    (Content-Length of each GetObject): it agrees with what the server sent."""
    counted = []
    fs = Storage(url).fs

    def record(http_response, **kwargs):
        counted.append(int(http_response.headers["content-length"]))

    client = fs.connect()
    client.meta.events.register("after-call.s3.GetObject", record)
    try:
        s3.traffic.reset()
        ckpt = ckptkit.open(url)
        assert ckpt.storage.fs is fs
        ckptkit.unshard(ckpt, str(tmp_path / "out"), progress=False)
        assert sum(counted) == s3.traffic.body_bytes(key_of(url)) > 0
    finally:
        client.meta.events.unregister("after-call.s3.GetObject", record)


@pytest.mark.parametrize("cache", ["blocks", "files"])
def test_cache_serves_repeated_reads_locally(s3, url, local, cache):
    ckpt = ckptkit.open(url, cache=cache)
    key = max(ckpt.catalog.tensors(), key=lambda e: e.nbytes).key
    s3.traffic.reset()
    first = ckpt.read(key)
    assert s3.traffic.body_bytes(key_of(url)) > 0
    s3.traffic.reset()
    second = ckpt.read(key)
    assert s3.traffic.gets(key_of(url)) == []  # all from the local cache
    assert_bit_equal(first, local.read(key), key)
    assert_bit_equal(second, local.read(key), key)


def test_memory_filesystem(sample, local):
    """Any fsspec URL: ``memory://`` (no credentials, no server)."""
    fs = fsspec.filesystem("memory")
    root = f"/ckptkit-test-{uuid.uuid4().hex[:8]}"
    fs.put(str(sample.path), root, recursive=True)
    try:
        ckpt = ckptkit.open(f"memory://{root}")
        assert ckpt.tensors.equals(local.tensors)
        key = max(ckpt.catalog.tensors(), key=lambda e: e.nbytes).key
        assert_bit_equal(ckpt.read(key), local.read(key), key)
    finally:
        fs.rm(root, recursive=True)


# -- a mirror that cannot list --------------------------------------------------------------


def test_http_mirror_without_listing(s3, sample, local):
    """Public objects over plain HTTP: no listing exists, detection probes ``.metadata`` and
    file sizes come from per-file look-ups; a 503 is retried by ckptkit (HTTP has no retries
    of its own)."""
    url = upload(sample.path)
    fs = s3fs_()
    for path in fs.find(url):
        fs.chmod(path, "public-read")
    http_url = f"{s3.endpoint}{key_of(url)}"
    s3.traffic.reset()
    ckpt = ckptkit.open(http_url)
    assert ckpt.format == "dcp"
    assert ckpt.tensors.equals(local.tensors)
    assert ckpt.files["size"].tolist() == local.files["size"].tolist()
    listings = [r for r in s3.traffic.snapshot() if r.method == "GET" and r.path == key_of(url)]
    assert all(r.status == 404 for r in listings)  # the server has no listing to give

    key = max(ckpt.catalog.tensors(), key=lambda e: e.nbytes).key
    s3.traffic.reset()
    s3.traffic.fail(lambda m, p: m == "GET" and p.endswith(".distcp"), times=2)
    assert_bit_equal(ckpt.read(key), local.read(key), key)
    statuses = [r.status for r in s3.traffic.snapshot() if r.path.endswith(".distcp")]
    assert statuses.count(503) == 2 and statuses.count(206) == 2


def test_public_bucket_that_refuses_listing(s3, sample, local):
    """Anonymous access to public objects in a bucket that does not let anonymous users list
    it (the usual public mirror; the server is told to refuse listings with 403): detection and
    file sizes work without a listing."""
    url = upload(sample.path)
    fs = s3fs_()
    for path in fs.find(url):
        fs.chmod(path, "public-read")
    bucket = key_of(url).split("/")[1]
    s3.traffic.reset()
    s3.traffic.fail(
        lambda m, p: m == "GET" and p == f"/{bucket}", status=403, code="AccessDenied", times=99
    )
    ckpt = ckptkit.open(url, storage_options={"anon": True})
    assert ckpt.tensors.equals(local.tensors)
    assert ckpt.files["size"].tolist() == local.files["size"].tolist()
    key = max(ckpt.catalog.tensors(), key=lambda e: e.nbytes).key
    assert_bit_equal(ckpt.read(key), local.read(key), key)
    listings = [r for r in s3.traffic.snapshot() if r.method == "GET" and r.path == f"/{bucket}"]
    assert listings and all(r.status == 403 for r in listings)


# -- failures ---------------------------------------------------------------------------------


def test_transient_503_is_retried_by_ckptkit(s3, url, local):
    """s3fs's and botocore's own retries are off (they would multiply with ckptkit's): the
    server sees ckptkit's attempts, a throttled one and a 503 one, then the good one."""
    ckpt = ckptkit.open(url)
    key = max(ckpt.catalog.tensors(), key=lambda e: e.nbytes).key
    s3.traffic.reset()
    s3.traffic.fail(lambda m, p: m == "GET" and p.endswith("__0_0.distcp"), code="SlowDown")
    s3.traffic.fail(
        lambda m, p: m == "GET" and p.endswith("__0_0.distcp"), code="ServiceUnavailable"
    )
    assert_bit_equal(ckpt.read(key), local.read(key), key)
    shard = [r for r in s3.traffic.snapshot() if r.path.endswith("__0_0.distcp")]
    assert [r.status for r in shard] == [503, 503, 206]


def test_metadata_read_is_retried(s3, url, local):
    s3fs_().invalidate_cache()
    s3.traffic.reset()
    s3.traffic.fail(lambda m, p: m == "GET" and p.endswith("/.metadata"), times=1)
    ckpt = ckptkit.open(url)
    assert ckpt.tensors.equals(local.tensors)
    assert [
        r.status
        for r in s3.traffic.snapshot()
        if r.method == "GET" and r.path.endswith("/.metadata")
    ] == [503, 206]


def test_persistent_failure_is_a_storage_error_naming_the_url(s3, url):
    ckpt = ckptkit.open(url)
    key = max(ckpt.catalog.tensors(), key=lambda e: e.nbytes).key
    s3.traffic.reset()
    s3.traffic.fail(lambda m, p: m == "GET" and p.endswith("__1_0.distcp"), times=100)
    with pytest.raises(StorageError, match=r"s3://.*/__1_0\.distcp: still failing after 5"):
        ckpt.read(key)
    attempts = [r for r in s3.traffic.snapshot() if r.path.endswith("__1_0.distcp")]
    assert len(attempts) == storage_module.RETRY_ATTEMPTS


def test_truncated_object_is_a_typed_error_naming_it(s3, sample):
    url = upload(sample.path)
    ckpt = ckptkit.open(url)
    shard = "__1_0.distcp"
    data = (sample.path / shard).read_bytes()
    records = sorted(
        (c.record.offset, c.record.length, e.key)
        for e in ckpt.catalog.tensors()
        for c in e.chunks
        if c.record.file == shard and c.record.length > 1000
    )
    cut_offset, cut_length, straddling = records[len(records) // 2]
    cut = cut_offset + cut_length // 2  # in the middle of a tensor record
    beyond = next(key for offset, _, key in records if offset > cut)
    s3fs_().pipe_file(key_of(url, shard)[1:], data[:cut])

    # the record's range and the object's real size are named, and no half tensor comes back
    end = cut_offset + cut_length
    with pytest.raises(
        CorruptRecordError,
        match=rf"s3://.*/{shard}: truncated: .*\[{cut_offset}, {end}\).* {cut}\b",
    ):
        ckpt.read(straddling)
    with pytest.raises(CorruptRecordError, match=rf"s3://.*/{shard}: truncated: .* {cut}\b"):
        ckpt.read(beyond)


def test_missing_objects_are_missing_file_errors_naming_the_url(s3, sample):
    with pytest.raises(MissingFileError, match=r"s3://ckpt-nowhere-[0-9a-f]+/nothing: no such"):
        ckptkit.open(f"s3://ckpt-nowhere-{uuid.uuid4().hex[:8]}/nothing")
    url = upload(sample.path)
    ckpt = ckptkit.open(url)
    s3fs_().rm_file(key_of(url, "__0_0.distcp")[1:])
    key = max(ckpt.catalog.tensors(), key=lambda e: e.nbytes).key
    with pytest.raises(MissingFileError, match=r"s3://.*/__0_0\.distcp: no such file"):
        ckpt.read(key)


def test_access_denied_names_the_url(s3, url, sample):
    """Anonymous on a private bucket: reading gets 403; so does listing when the bucket
    refuses it too (then the location itself is named)."""
    with pytest.raises(AccessDeniedError, match=rf"{url}/\.metadata: access denied"):
        ckptkit.open(url, storage_options={"anon": True})
    bucket = key_of(url).split("/")[1]
    s3.traffic.fail(
        lambda m, p: m == "GET" and p == f"/{bucket}", status=403, code="AccessDenied", times=99
    )
    with pytest.raises(AccessDeniedError, match=rf"{url}: access denied"):
        ckptkit.open(url, storage_options={"anon": True})
    s3.traffic.reset()
    ckpt = ckptkit.open(url)
    denied = Storage(url, {"anon": True})
    with pytest.raises(AccessDeniedError, match=rf"{url}/__0_0\.distcp: access denied"):
        denied.read_range("__0_0.distcp", 0, 10)
    assert (
        ckpt.storage.read_range("__0_0.distcp", 0, 10)
        == (sample.path / "__0_0.distcp").read_bytes()[:10]
    )


# -- writing to S3 -----------------------------------------------------------------------------


def test_unshard_and_convert_to_s3(s3, url, local, tmp_path):
    """Outputs go up only once everything is written (after the last source read), whole, and
    read back equal."""
    destination = upload_target(url, "unsharded")
    s3.traffic.reset()
    result = ckptkit.unshard(url, destination, progress=False)
    log = s3.traffic.snapshot()
    last_read = max(
        r.seq for r in log if r.method == "GET" and r.path.startswith(key_of(url) + "/")
    )
    puts = [r for r in log if r.method == "PUT" and r.path.startswith(key_of(destination))]
    assert sorted(r.path.rsplit("/", 1)[1] for r in puts) == sorted(f.name for f in result.files)
    assert min(r.seq for r in puts) > last_read

    ckptkit.unshard(local, str(tmp_path / "local"), progress=False)
    fs = s3fs_()
    for f in result.files:
        assert (
            fs.cat_file(key_of(destination, f.name)[1:])
            == (tmp_path / "local" / f.name).read_bytes()
        )

    converted = upload_target(url, "slim_dcp")
    ckptkit.convert(url, converted, to="dcp", groups="model", progress=False)
    back = ckptkit.open(converted)
    for entry in back.catalog.tensors():
        assert_bit_equal(back.read(entry.key), local.read(entry.key), entry.key)


def upload_target(url: str, name: str) -> str:
    return url.rsplit("/", 1)[0] + f"/{name}-{uuid.uuid4().hex[:6]}"


def test_unshard_to_s3_is_all_or_nothing(s3, url):
    fs = s3fs_()
    # A failure while reading: nothing is uploaded at all.
    destination = upload_target(url, "failed_read")
    s3.traffic.reset()
    s3.traffic.fail(lambda m, p: m == "GET" and p.endswith("__1_0.distcp"), times=100)
    with pytest.raises(StorageError, match=r"__1_0\.distcp: still failing"):
        ckptkit.unshard(url, destination, progress=False)
    assert not [r for r in s3.traffic.snapshot() if r.method == "PUT"]
    s3.traffic.reset()
    assert not fs.exists(key_of(destination)[1:])

    # A failure while uploading the second file: the first one is taken back.
    destination = upload_target(url, "failed_upload")
    s3.traffic.fail(
        lambda m, p: m == "PUT" and p.endswith("/optim.pt"), status=403, code="AccessDenied"
    )
    with pytest.raises(AccessDeniedError, match=r"optim\.pt: access denied"):
        ckptkit.unshard(url, destination, progress=False)
    log = s3.traffic.snapshot()
    assert [r.status for r in log if r.method == "PUT" and r.path.endswith("/model.pt")] == [200]
    assert [r for r in log if r.method == "DELETE" and r.path.endswith("/model.pt")]
    fs.invalidate_cache()
    assert fs.find(key_of(destination)[1:]) == []


def test_cli_storage_options_and_one_line_backend_errors(s3, sample):
    """``--storage-option KEY=VALUE`` reaches fsspec: with no endpoint in the environment the
    CLI finds the server only through it; a backend's own failure (no credentials) is one
    line and exit 2, never a botocore traceback."""
    import json
    import os
    import subprocess
    import sys

    url = upload(sample.path)
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_MAX_ATTEMPTS="1")

    def cli(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "ckptkit.cli", *args],
            capture_output=True,
            text=True,
            timeout=180,
            env={**env, **extra},
        )

    found = cli("inspect", url, "--json", "--storage-option", f"endpoint_url={s3.endpoint}")
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout)["summary"]["tensors"] == len(ckptkit.open(url).tensors)
    no_keys = {
        "AWS_ACCESS_KEY_ID": "",
        "AWS_SECRET_ACCESS_KEY": "",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
    }
    refused = cli("inspect", url, "--storage-option", f"endpoint_url={s3.endpoint}", **no_keys)
    assert refused.returncode == 2
    assert refused.stderr.startswith("ckptkit: error:") and refused.stderr.count("\n") == 1
    assert "Traceback" not in refused.stderr and "credentials" in refused.stderr.lower()
    bad = cli("inspect", url, "--storage-option", "no-equals-sign")
    assert bad.returncode == 2 and "KEY=VALUE" in bad.stderr
