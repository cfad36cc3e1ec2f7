"""Every name, path, size and file type a checkpoint holds is untrusted input to storage.py.

Each attack is made with real files (torch's DCP, safetensors, FIFOs, symlinks, a real S3
server): names leading outside the checkpoint, special files, lengths beyond the file, a file
shrinking under a read, staging folders left behind, output names leaving the destination, and
write errors. Anything that could exhaust memory or block runs in a child process with an
address-space limit and a timeout, and must end with a typed ckptkit error.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader

import ckptkit
import ckptkit.storage.atomic as storage_module
from ckptkit import tunables
from ckptkit.errors import (
    CorruptRecordError,
    DestinationError,
    LimitExceededError,
    OutputExistsError,
    OutputNameError,
    UnsafePathError,
)
from ckptkit.storage import AtomicOutput, Storage, atomic_output

#: Names that must never be followed: absolute, climbing, empty components, controls, backslash.
UNSAFE_NAMES = [
    "/etc/passwd",
    "../private/x.safetensors",
    "a/../../private/x.safetensors",
    "..",
    ".",
    "",
    "a//b",
    "a/./b",
    "sub/",
    "..\\private\\x",
    "x\x00.safetensors",
    "x\n.safetensors",
]


def run_child(
    script: str, *args: object, memory: int | None = None, timeout: float = 60, env=None
) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter, its address space limited to ``memory`` bytes."""

    def limit() -> None:
        if memory is not None:
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit,
        env={**os.environ, "MALLOC_ARENA_MAX": "2", **(env or {})},
    )


def ok(result: subprocess.CompletedProcess) -> str:
    """The child's stdout, after checking it exited normally (no signal, no OOM, no hang)."""
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    return result.stdout


@pytest.fixture(scope="module")
def small_dcp(tmp_path_factory) -> Path:
    """A small DCP checkpoint written by torch (one ``__0_0.distcp``)."""
    path = tmp_path_factory.mktemp("dcp") / "ckpt"
    gen = torch.Generator().manual_seed(0)
    state = {
        "model": {"w": torch.randn(64, 64, generator=gen), "b": torch.randn(64, generator=gen)}
    }
    dcp.save(state, checkpoint_id=str(path))
    return path


@pytest.fixture
def dcp_copy(small_dcp, tmp_path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(small_dcp, target)
    return target


def _rewrite_relative_paths(path: Path, relative_path: str) -> None:
    """Point every record of ``path``'s ``.metadata`` at ``relative_path``."""
    metadata = FileSystemReader(str(path)).read_metadata()
    for info in metadata.storage_data.values():
        info.relative_path = relative_path
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


def _sharded_safetensors(folder: Path, outside: str) -> None:
    """An HF-style sharded safetensors folder whose index sends one tensor to ``outside``."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"a": torch.ones(4)}, str(folder / "model-00001-of-00002.safetensors"))
    index = {
        "metadata": {},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": outside},
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


# -- 1. names leading outside the checkpoint ----------------------------------------------------


@pytest.mark.parametrize("name", UNSAFE_NAMES + [None, 7])
def test_names_leading_outside_are_refused_by_every_local_method(tmp_path, name):
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "x.safetensors").write_bytes(b"secret")
    storage = Storage(str(root))
    calls = [
        lambda: storage.read_file(name),
        lambda: storage.read_range(name, 0, 6),
        lambda: storage.read_ranges([("sub/ok", 0, 0), (name, 0, 6)]),
        lambda: storage.size(name),
        lambda: storage.sizes([name]),
        lambda: storage.child(name),
        lambda: storage.open_sequential(name).__enter__(),
    ]
    if name != "":  # "" is the location itself for the look-ups below
        calls += [lambda: storage.exists(name), lambda: storage.isdir(name)]
        calls += [lambda: storage.path(name), lambda: storage.listdir(name)]
    for call in calls:
        with pytest.raises(UnsafePathError) as info:
            call()
        assert str(root) in str(info.value) and repr(name) in str(info.value)


def test_the_location_itself_and_nested_names_still_work(tmp_path):
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "f.bin").write_bytes(b"0123456789")
    storage = Storage(str(root))
    assert storage.exists("") and storage.isdir("") and storage.path("") == str(root)
    assert storage.read_range("sub/f.bin", 2, 5) == b"234"
    assert storage.child("sub").read_file("f.bin") == b"0123456789"
    assert storage.sizes(["sub/f.bin", "sub/none"]) == {"sub/f.bin": 10, "sub/none": None}
    parent, name = storage.parent()  # format detection climbs on purpose
    assert name == "ckpt" and parent.exists("ckpt")


@pytest.mark.parametrize("how", ["absolute", "climb"])
def test_dcp_relative_path_cannot_point_outside_the_checkpoint(dcp_copy, tmp_path, how):
    """``.metadata`` naming another checkpoint's data file: before, its bytes were read."""
    other = tmp_path / "other"
    shutil.copytree(dcp_copy, other)
    target = str(other / "__0_0.distcp") if how == "absolute" else "../other/__0_0.distcp"
    _rewrite_relative_paths(dcp_copy, target)
    (dcp_copy / "__0_0.distcp").unlink()
    with pytest.raises(UnsafePathError, match=r"refused the file name") as info:
        ckptkit.open(str(dcp_copy)).read("model.w")
    assert repr(target) in str(info.value)


def test_safetensors_index_cannot_point_outside_the_checkpoint(tmp_path):
    save_file({"b": torch.zeros(4)}, str(tmp_path / "private.safetensors"))
    _sharded_safetensors(tmp_path / "ckpt", "../private.safetensors")
    with pytest.raises(UnsafePathError, match=r"'\.\./private\.safetensors'"):
        ckptkit.open(str(tmp_path / "ckpt")).read("model.b")


# -- 1b. the same on S3 and over HTTP ---------------------------------------------------------


def _s3_prefix() -> tuple[fsspec.AbstractFileSystem, str]:
    fs = fsspec.filesystem("s3")
    bucket = f"safety-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    return fs, bucket


def _requests_for(s3, word: str) -> list:
    return [r for r in s3.traffic.snapshot() if word in r.path]


@pytest.mark.parametrize(
    "name", ["../secret/model.safetensors", "/other-bucket/key", "run/../../secret/x", "a//b"]
)
def test_s3_names_leading_outside_are_refused_without_a_request(s3, name):
    fs, bucket = _s3_prefix()
    fs.pipe(f"{bucket}/secret/model.safetensors", b"secret bytes")
    fs.pipe(f"{bucket}/run/ok.bin", b"fine")
    fs.invalidate_cache()
    storage = Storage(f"s3://{bucket}/run")
    s3.traffic.reset()
    for call in (
        lambda: storage.read_range(name, 0, 6),
        lambda: storage.read_file(name),
        lambda: storage.size(name),
        lambda: storage.exists(name),
        lambda: storage.sizes([name]),
        lambda: storage.child(name),
    ):
        with pytest.raises(UnsafePathError) as info:
            call()
        assert f"s3://{bucket}/run" in str(info.value) and repr(name) in str(info.value)
    assert _requests_for(s3, "secret") == [] and _requests_for(s3, "other-bucket") == []
    assert storage.read_range("ok.bin", 0, 4) == b"fine"


def test_s3_safetensors_index_pointing_outside_is_refused(s3, tmp_path):
    fs, bucket = _s3_prefix()
    save_file({"b": torch.zeros(4)}, str(tmp_path / "secret.safetensors"))
    fs.put_file(str(tmp_path / "secret.safetensors"), f"{bucket}/secret/model.safetensors")
    _sharded_safetensors(tmp_path / "ckpt", "../secret/model.safetensors")
    fs.put(str(tmp_path / "ckpt"), f"{bucket}/run", recursive=True)
    fs.invalidate_cache()
    s3.traffic.reset()
    with pytest.raises(UnsafePathError, match=r"'\.\./secret/model\.safetensors'"):
        ckptkit.open(f"s3://{bucket}/run").read("model.b")
    assert _requests_for(s3, "/secret/") == []


@pytest.mark.parametrize("name", ["%2e%2e/secret.bin", "..%2Fsecret.bin", "x?y=1", "x#frag"])
def test_http_names_that_leave_the_prefix_once_decoded_are_refused(s3, name):
    fs, bucket = _s3_prefix()
    fs.pipe(f"{bucket}/run/ok.bin", b"fine")
    fs.chmod(f"{bucket}/run/ok.bin", "public-read")
    storage = Storage(f"{s3.endpoint}/{bucket}/run")
    with pytest.raises(UnsafePathError, match="refused the file name"):
        storage.read_range(name, 0, 4)
    assert storage.read_range("ok.bin", 0, 4) == b"fine"


# -- 2. special files -----------------------------------------------------------------------


def test_symlink_to_dev_zero_is_refused_not_read(tmp_path):
    """``index.json`` and ``config.yaml`` linked to /dev/zero: before, read until memory ran out."""
    _sharded_safetensors(tmp_path / "ckpt", "model-00002-of-00002.safetensors")
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    index.unlink()
    index.symlink_to("/dev/zero")
    (tmp_path / "ckpt" / "config.yaml").symlink_to("/dev/zero")
    script = """
        import sys
        import ckptkit
        from ckptkit.storage import Storage
        from ckptkit.errors import UnsafePathError
        storage = Storage(sys.argv[1])
        for call in (
            lambda: storage.read_file("config.yaml"),
            lambda: storage.size("config.yaml"),
            lambda: storage.read_file("model.safetensors.index.json"),
            lambda: ckptkit.open(sys.argv[1]).tensors,
        ):
            try:
                call()
            except UnsafePathError as exc:
                print(exc)
            else:
                print("READ")
    """
    out = ok(run_child(script, tmp_path / "ckpt", memory=2 << 30, timeout=120))
    lines = out.splitlines()
    assert len(lines) == 4 and "READ" not in lines
    assert all("a symlink leading outside" in line and "/dev/zero" in line for line in lines)
    assert "config.yaml" in lines[0] and "model.safetensors.index.json" in lines[2]


def test_fifos_are_refused_without_blocking(dcp_copy, tmp_path):
    """A FIFO ``.distcp`` or ``index.json`` blocked open() forever."""
    (dcp_copy / "__0_0.distcp").unlink()
    os.mkfifo(dcp_copy / "__0_0.distcp")
    _sharded_safetensors(tmp_path / "st", "model-00002-of-00002.safetensors")
    (tmp_path / "st" / "model.safetensors.index.json").unlink()
    os.mkfifo(tmp_path / "st" / "model.safetensors.index.json")
    script = """
        import sys
        import ckptkit
        from ckptkit.storage import Storage
        from ckptkit.errors import UnsafePathError
        for call in (
            lambda: ckptkit.open(sys.argv[1]).read("model.w"),
            lambda: Storage(sys.argv[1]).read_range("__0_0.distcp", 0, 10),
            lambda: Storage(sys.argv[2]).read_file("model.safetensors.index.json"),
            lambda: Storage(sys.argv[2]).open_sequential("model.safetensors.index.json").__enter__(),
        ):
            try:
                call()
            except UnsafePathError as exc:
                print(exc)
    """
    lines = ok(run_child(script, dcp_copy, tmp_path / "st", timeout=60)).splitlines()
    assert len(lines) == 4
    assert all("not a regular file: a FIFO" in line for line in lines)
    assert "__0_0.distcp" in lines[0] and "index.json" in lines[2]


def test_devices_and_directories_are_not_regular_files(tmp_path):
    root = tmp_path / "ckpt"
    (root / "dir.bin").mkdir(parents=True)
    (root / "inside").mkdir()
    storage = Storage(str(root))
    with pytest.raises(UnsafePathError, match=r"dir\.bin: not a regular file: a directory"):
        storage.read_range("dir.bin", 0, 1)
    with pytest.raises(UnsafePathError, match="not a regular file: a directory"):
        storage.size("dir.bin")


def test_symlinks_inside_the_checkpoint_are_followed_and_outside_refused(dcp_copy, tmp_path):
    data = dcp_copy / "data"
    data.mkdir()
    (dcp_copy / "__0_0.distcp").rename(data / "real.distcp")
    (dcp_copy / "__0_0.distcp").symlink_to("data/real.distcp")
    original = ckptkit.open(str(dcp_copy)).read("model.w")
    assert original.shape == (64, 64)

    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "passwd").write_text("root:x:0:0")
    (dcp_copy / "sub").symlink_to(tmp_path / "outside")  # a folder link leading outside
    storage = Storage(str(dcp_copy))
    with pytest.raises(UnsafePathError, match="a symlink leading outside"):
        storage.read_file("sub/passwd")
    with pytest.raises(UnsafePathError, match="a symlink leading outside"):
        storage.sizes(["sub/passwd"])


# -- 3. sizes checked before anything is allocated ------------------------------------------------


def test_read_file_refuses_a_file_beyond_the_limit_before_reading(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "index.json").write_bytes(b"{}" + b" " * (2 << 20))
    storage = Storage(str(root))
    with pytest.raises(LimitExceededError) as info:
        storage.read_file("index.json", max_bytes=1 << 20)
    message = str(info.value)
    assert str(root / "index.json") in message and str((2 << 20) + 2) in message
    assert str(1 << 20) in message and "SMALL_FILE_LIMIT" in message
    monkeypatch.setattr(tunables, "SMALL_FILE_LIMIT", 1 << 20)
    with pytest.raises(LimitExceededError):
        storage.read_file("index.json")
    assert storage.read_file("index.json", max_bytes=3 << 20).startswith(b"{}")

    # A sparse 8 GiB config: refused at once, in a child that could not hold it.
    with open(root / "config.json", "wb") as handle:
        handle.truncate(8 << 30)
    script = """
        import sys
        from ckptkit.storage import Storage
        from ckptkit.errors import LimitExceededError
        try:
            Storage(sys.argv[1]).read_file("config.json")
        except LimitExceededError as exc:
            print(exc)
    """
    out = ok(run_child(script, root, memory=1 << 30))
    assert "config.json" in out and str(8 << 30) in out


def test_s3_read_file_refuses_beyond_the_limit_without_fetching(s3):
    fs, bucket = _s3_prefix()
    fs.pipe(f"{bucket}/run/index.json", b"{}" + b" " * (2 << 20))
    storage = Storage(f"s3://{bucket}/run")
    s3.traffic.reset()
    with pytest.raises(LimitExceededError, match=rf"s3://{bucket}/run/index\.json: 2097154 bytes"):
        storage.read_file("index.json", max_bytes=1 << 20)
    assert s3.traffic.gets(f"/{bucket}/run/index.json") == []
    assert len(storage.read_file("index.json")) == (2 << 20) + 2


def test_huge_record_length_on_a_small_file_is_a_truncation_not_an_allocation(tmp_path):
    """A 2 GiB record on a 5 KB file: before, read() allocated 2 GiB first."""
    (tmp_path / "small.distcp").write_bytes(os.urandom(5000))
    script = """
        import sys
        from ckptkit.storage import Storage
        from ckptkit.errors import CorruptRecordError
        storage = Storage(sys.argv[1])
        for ranges in (
            [("small.distcp", 0, 2 << 30)],
            [("small.distcp", 0, 10), ("small.distcp", 10, 2 << 30)],
            [("small.distcp", 4 << 30, 6 << 30)],
        ):
            try:
                storage.read_ranges(ranges)
            except CorruptRecordError as exc:
                print(exc)
    """
    lines = ok(run_child(script, tmp_path, memory=1 << 30)).splitlines()
    assert len(lines) == 3
    assert all("small.distcp: truncated" in line for line in lines)
    assert all(line.endswith("the file ends at 5000") for line in lines)


def test_s3_huge_record_length_is_a_truncation_not_an_allocation(s3):
    """Remote: a pieced buffer of the claimed length was preallocated; now the object's size is
    looked up first (and without a size, pieces are joined as they come)."""
    fs, bucket = _s3_prefix()
    fs.pipe(f"{bucket}/run/small.distcp", os.urandom(5000))
    script = """
        import sys
        from ckptkit.storage import Storage
        from ckptkit.errors import CorruptRecordError
        storage = Storage(sys.argv[1])
        for unsized in (False, True):
            if unsized:
                storage._size_or_none = lambda rel: None  # a server that does not tell sizes
            try:
                storage.read_range("small.distcp", 0, 2 << 30)
            except CorruptRecordError as exc:
                print(exc)
    """
    out = run_child(script, f"s3://{bucket}/run", memory=3 << 29, timeout=120)
    lines = ok(out).splitlines()
    assert len(lines) == 2
    assert all("small.distcp: truncated" in line and "ends at 5000" in line for line in lines)


def test_invalid_ranges_are_refused_before_reading(tmp_path):
    (tmp_path / "f.bin").write_bytes(b"0123456789")
    storage = Storage(str(tmp_path))
    for start, end in ((5, 2), (-1, 4)):
        with pytest.raises(CorruptRecordError, match=r"f\.bin: invalid byte range"):
            storage.read_range("f.bin", start, end)


# -- 4. a file shrinking under a read ---------------------------------------------------------


def test_file_shrinking_under_a_read_is_an_error_not_a_signal(tmp_path):
    """Memory-mapped reads died of SIGBUS when the source shrank (a Jupyter kernel with them)."""
    script = """
        import os, sys, threading, time, zlib
        from ckptkit.storage import Storage
        from ckptkit.errors import CorruptRecordError
        root = sys.argv[1]
        path = os.path.join(root, "big.distcp")
        size = 64 << 20
        with open(path, "wb") as handle:
            handle.write(os.urandom(size))
        storage = Storage(root)

        blob = storage.read_range("big.distcp", 0, size)
        os.truncate(path, 4096)
        print("crc", zlib.crc32(blob) == zlib.crc32(blob))  # the bytes read stay readable
        try:
            storage.read_range("big.distcp", 0, size)
        except CorruptRecordError as exc:
            print(exc)

        stop = time.monotonic() + 3
        def shrink_and_grow():
            while time.monotonic() < stop:
                os.truncate(path, 0)
                os.truncate(path, size)
        thread = threading.Thread(target=shrink_and_grow)
        thread.start()
        reads = errors = 0
        while time.monotonic() < stop:
            try:
                zlib.crc32(storage.read_range("big.distcp", 0, size))
                reads += 1
            except CorruptRecordError:
                errors += 1
        thread.join()
        print("raced", reads + errors)
    """
    result = run_child(script, tmp_path, timeout=120)
    assert result.returncode >= 0, f"killed by signal {-result.returncode}"
    lines = ok(result).splitlines()
    assert lines[0] == "crc True"
    assert "big.distcp: truncated" in lines[1] and "ends at 4096" in lines[1]
    assert lines[2].startswith("raced ") and int(lines[2].split()[1]) > 0


# -- 5. staging never left behind -----------------------------------------------------------


def _staging(dst: Path) -> list[Path]:
    return sorted(dst.glob(".ckptkit-tmp-*"))


def test_commit_refused_by_a_name_that_appeared_leaves_no_staging(tmp_path):
    dst = tmp_path / "out"
    output = AtomicOutput(Storage(str(dst)))
    with output.open("model.pt") as stream:
        stream.write(b"new")
    (dst / "model.pt").write_bytes(b"appeared meanwhile")
    with pytest.raises(OutputExistsError) as info:
        output.commit()
    assert isinstance(info.value, FileExistsError) and str(dst / "model.pt") in str(info.value)
    assert (dst / "model.pt").read_bytes() == b"appeared meanwhile"
    assert _staging(dst) == []


def test_two_outputs_into_one_destination(tmp_path):
    dst = tmp_path / "out"
    first, second = AtomicOutput(Storage(str(dst))), AtomicOutput(Storage(str(dst)))
    for output, data in ((first, b"first"), (second, b"second")):
        with output.open("model.pt") as stream:
            stream.write(data)
    first.commit()
    with pytest.raises(OutputExistsError):
        second.commit()
    assert (dst / "model.pt").read_bytes() == b"first"
    assert _staging(dst) == []


def test_unshard_twice_into_one_destination_leaves_no_staging(small_dcp, tmp_path):
    dst = tmp_path / "out"
    ckptkit.unshard(str(small_dcp), str(dst), progress=False)
    with pytest.raises(OutputExistsError):
        ckptkit.unshard(str(small_dcp), str(dst), progress=False)
    assert sorted(p.name for p in dst.iterdir()) == ["model.pt"]


_WRITER = """
    import sys, time
    from ckptkit.storage import AtomicOutput, Storage
    output = AtomicOutput(Storage(sys.argv[1]))
    with output.open("model.pt") as stream:
        stream.write(b"x" * 100000)
    print(output.staging, flush=True)
    time.sleep(600)
"""


def _start_writer(destination: str, env=None) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_WRITER), destination],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    return proc, Path(proc.stdout.readline().strip())


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()


def test_staging_of_a_killed_writer_is_removed_by_the_next_output(tmp_path):
    dst = tmp_path / "out"
    killed, killed_staging = _start_writer(str(dst))
    alive, alive_staging = _start_writer(str(dst))
    try:
        _kill(killed)
        assert killed.returncode == -signal.SIGKILL
        assert killed_staging.parent == dst and (killed_staging / "model.pt").exists()
        owner = json.loads((killed_staging / ".ckptkit-owner").read_text())
        assert owner["pid"] == killed.pid and owner["host"] == socket.gethostname()
        unowned = dst / ".ckptkit-tmp-unowned"  # perhaps being created: left alone
        unowned.mkdir()

        with atomic_output(Storage(str(dst))) as output, output.open("model.pt") as stream:
            stream.write(b"rerun")
        assert not killed_staging.exists()
        assert (alive_staging / "model.pt").exists()  # its owner still runs
        assert unowned.exists()
        assert (dst / "model.pt").read_bytes() == b"rerun"
    finally:
        _kill(alive)


def test_a_reused_pid_does_not_keep_a_staging_folder(tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    for name, start in (("reused", "1"), ("mine", storage_module._process_start(os.getpid()))):
        folder = dst / f".ckptkit-tmp-{name}"
        folder.mkdir()
        (folder / ".ckptkit-owner").write_text(json.dumps({**me, "start": start}))
    AtomicOutput(Storage(str(dst))).discard()
    assert [p.name for p in _staging(dst)] == [".ckptkit-tmp-mine"]


def test_remote_staging_of_a_killed_writer_is_removed(tmp_path, monkeypatch):
    """Remote destinations stage in the local temporary folder (``ckptkit-*``)."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    destination = f"memory://ckptkit-safety-{uuid.uuid4().hex[:8]}"
    killed, staging = _start_writer(destination, env={"TMPDIR": str(temp)})
    _kill(killed)
    assert staging.parent == temp and staging.name.startswith("ckptkit-")
    (temp / "ckptkit-someone-else").mkdir()  # no owner file: not ours to remove
    output = AtomicOutput(Storage(destination))
    assert not staging.exists() and (temp / "ckptkit-someone-else").exists()
    output.discard()


def test_a_commit_killed_mid_swap_gets_its_replaced_file_back(tmp_path):
    """A killed commit may have moved an earlier output aside: the cleanup puts it back."""
    dst = tmp_path / "out"
    dst.mkdir()
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
        timeout=60,
    )
    folder = dst / ".ckptkit-tmp-killed"
    (folder / ".ckptkit-replaced").mkdir(parents=True)
    (folder / ".ckptkit-replaced" / "model.pt").write_bytes(b"the earlier output")
    owner = {"pid": int(gone.stdout), "host": socket.gethostname(), "start": None}
    (folder / ".ckptkit-owner").write_text(json.dumps(owner))
    AtomicOutput(Storage(str(dst))).discard()
    assert (dst / "model.pt").read_bytes() == b"the earlier output"
    assert _staging(dst) == []


# -- 6. output names and write errors -------------------------------------------------------------


@pytest.mark.parametrize("name", UNSAFE_NAMES + [".ckptkit-owner", ".ckptkit-replaced/model.pt"])
def test_unsafe_output_names_are_refused(tmp_path, name):
    dst = tmp_path / "out"
    output = AtomicOutput(Storage(str(dst)))
    with pytest.raises(OutputNameError, match="refused the output name"):
        output.open(name)
    with pytest.raises(OutputNameError):
        output.refuse_existing([name])
    output.discard()
    assert list(tmp_path.iterdir()) == []  # the folder made for the output went with it


def test_output_names_written_twice_or_as_file_and_folder_are_refused(tmp_path):
    output = AtomicOutput(Storage(str(tmp_path / "out")))
    output.open("a.pt").close()
    with pytest.raises(OutputNameError, match="written twice"):
        output.open("a.pt")
    output.open("d/x.pt").close()
    with pytest.raises(OutputNameError, match="a file and a folder"):
        output.open("d")
    with pytest.raises(OutputNameError, match="a file and a folder"):
        output.open("a.pt/y.pt")
    output.discard()


def test_disk_full_is_a_destination_error_naming_the_file(tmp_path):
    """ENOSPC from the kernel (/dev/full): a DestinationError naming the final file."""
    dst = tmp_path / "out"
    with pytest.raises(DestinationError) as info, atomic_output(Storage(str(dst))) as output:
        os.symlink("/dev/full", os.path.join(output.staging, "model.pt"))
        with output.open("model.pt") as stream:
            stream.write(b"x" * (1 << 20))
            stream.flush()
    assert info.value.errno == errno.ENOSPC
    assert str(dst / "model.pt") in str(info.value) and "no space left" in str(info.value)
    assert not dst.exists()


def test_file_size_limit_while_unsharding_leaves_nothing(small_dcp, tmp_path):
    """A real write error (EFBIG under RLIMIT_FSIZE) in the middle of an unshard."""

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    dst = tmp_path / "out"
    dst.mkdir()
    script = """
        import sys
        import ckptkit
        from ckptkit.errors import DestinationError
        try:
            ckptkit.unshard(sys.argv[1], sys.argv[2], progress=False)
        except DestinationError as exc:
            print(exc.errno, exc)
    """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), str(small_dcp), str(dst)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit,
    )
    out = ok(result)
    assert out.startswith(f"{errno.EFBIG} ") and str(dst / "model.pt") in out
    assert list(dst.iterdir()) == []


def test_name_too_long_is_a_destination_error(tmp_path):
    dst = tmp_path / "out"
    output = AtomicOutput(Storage(str(dst)))
    with pytest.raises(DestinationError, match="name too long") as info:
        output.open("m" * 300 + ".pt")
    assert info.value.errno == errno.ENAMETOOLONG
    output.discard()
    assert not dst.exists()


def test_a_folder_under_a_final_name_is_not_replaced(tmp_path):
    dst = tmp_path / "out"
    (dst / "model.pt").mkdir(parents=True)
    (dst / "model.pt" / "keep.txt").write_text("keep me")
    destination = Storage(str(dst))
    with pytest.raises(DestinationError) as info, atomic_output(destination, overwrite=True) as out:
        for name in ("a.pt", "model.pt"):
            with out.open(name) as stream:
                stream.write(b"data")
    assert str(dst / "model.pt") in str(info.value)
    assert sorted(p.name for p in dst.iterdir()) == ["model.pt"]  # a.pt taken back
    assert (dst / "model.pt" / "keep.txt").read_text() == "keep me"


def test_a_refused_rename_keeps_permission_error_and_restores(tmp_path, monkeypatch):
    """EACCES while renaming: a DestinationError that is still a PermissionError."""
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "a.pt").write_bytes(b"old a")
    real_replace = os.replace

    def refuse(src, target, **dir_fds):
        if str(target).endswith("b.pt"):
            raise PermissionError(errno.EACCES, "Permission denied", str(target))
        return real_replace(src, target, **dir_fds)

    monkeypatch.setattr(storage_module.os, "replace", refuse)
    destination = Storage(str(dst))
    with pytest.raises(DestinationError) as info, atomic_output(destination, overwrite=True) as out:
        for name in ("a.pt", "b.pt"):
            with out.open(name) as stream:
                stream.write(b"new")
    assert isinstance(info.value, PermissionError) and info.value.errno == errno.EACCES
    assert str(dst / "b.pt") in str(info.value)
    assert (dst / "a.pt").read_bytes() == b"old a"
    assert sorted(p.name for p in dst.iterdir()) == ["a.pt"]
