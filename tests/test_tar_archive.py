"""``ckptkit.storage.tar_archive`` / ``tar_headers``: a tar archive read in place as a directory
``Store``, its headers checked.

Archives are written by Python's ``tarfile`` (ustar, GNU and pax headers) or are the checked-in
NeMo fixtures; every member read through the view must equal what ``tarfile`` extracts, and
hostile edits of real headers (unsafe names, forged sizes, bad checksums, too many headers)
must fail with ckptkit's typed errors, quickly, before anything is read.
"""

from __future__ import annotations

import inspect
import io
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import fsspec
import pytest

from ckptkit.errors import (
    CorruptRecordError,
    LimitExceededError,
    MissingFileError,
    TruncatedFileError,
    UnsafePathError,
)
from ckptkit.storage import Storage, Store, tar_headers
from ckptkit.storage.tar_archive import TarArchive, open_tar_archive
from ckptkit.storage.tar_headers import is_tar_header

FIXTURES = Path(__file__).parent / "fixtures"
DIST_NEMO = FIXTURES / "nemo_megatron_dist" / "model.nemo"


def archive_of(path: Path) -> TarArchive:
    return open_tar_archive(Storage(str(path.parent)), path.name)


def members(path: Path) -> dict[str, bytes]:
    """Every regular member's bytes as ``tarfile`` extracts them, by normalised name."""
    with tarfile.open(path) as tar:
        return {
            m.name.removeprefix("./"): tar.extractfile(m).read()
            for m in tar.getmembers()
            if m.isfile()
        }


def write_tar(path: Path, files: dict[str, bytes], *, format: int = tarfile.PAX_FORMAT) -> Path:
    """A real tar written by ``tarfile``: ``files`` (names as given) in order."""
    with tarfile.open(path, "w:", format=format) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def header_offsets(path: Path) -> dict[str, int]:
    """Where each member's own header starts (after any pax header), as ``tarfile`` reads it."""
    with tarfile.open(path) as tar:
        return {m.name: m.offset_data - 512 for m in tar.getmembers()}


def edit_header(path: Path, at: int, field: slice, value: bytes, *, checksum: bool = True) -> None:
    """Overwrite a field of the header at ``at`` (padded with NULs) and, unless told not to,
    store the checksum of the edited header as tar does."""
    data = bytearray(path.read_bytes())
    header = data[at : at + 512]
    width = field.stop - field.start
    header[field] = value.ljust(width, b"\0")[:width]
    if checksum:
        header[148:156] = b"        "
        header[148:156] = b"%06o\0 " % tarfile.calc_chksums(bytes(header))[0]
    data[at : at + 512] = header
    path.write_bytes(bytes(data))


# -- the Store protocol -----------------------------------------------------------------------


def test_every_store_method_exists_with_the_same_parameters():
    for name, value in vars(Store).items():
        if inspect.isfunction(value) and not name.startswith("_"):
            mine = getattr(TarArchive, name)
            assert (
                list(inspect.signature(mine).parameters.values())[1:]
                == list(inspect.signature(value).parameters.values())[1:]
            ), name


def test_a_real_nemo_archive_reads_as_tarfile_extracts_it():
    archive = archive_of(DIST_NEMO)
    assert isinstance(archive, Store)
    expected = members(DIST_NEMO)
    assert archive.url == str(DIST_NEMO) and archive.root == str(DIST_NEMO)
    assert sorted(archive.listdir()) == ["model_config.yaml", "model_weights"]
    assert archive.listdir()["model_weights"] == -1 and archive.isdir("model_weights")
    weights = archive.child("model_weights")
    assert sorted(weights.listdir()) == sorted(
        name.removeprefix("model_weights/")
        for name in expected
        if name.startswith("model_weights/")
    )
    assert weights.describe("common.pt") == f"{DIST_NEMO}/model_weights/common.pt"
    parent, name = weights.parent()
    assert name == "model_weights" and parent.root == archive.root
    up, file = archive.parent()
    assert file == "model.nemo" and up.root == str(DIST_NEMO.parent)
    for member, data in expected.items():
        assert archive.exists(member) and not archive.isdir(member)
        assert archive.size(member) == len(data)
        assert archive.read_file(member) == data
        with archive.open_sequential(member) as stream:
            assert stream.read() == data
        assert bytes(archive.read_ranges([(member, 3, 40)])[0]) == data[3:40]
    assert archive.sizes(["model_config.yaml", "missing"]) == {
        "model_config.yaml": len(expected["model_config.yaml"]),
        "missing": None,
    }
    assert not archive.exists("missing") and not archive.isdir("missing")


@pytest.mark.parametrize("format", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_each_header_format_python_writes(tmp_path, format):
    """Long names (ustar prefix, GNU ``L`` records, pax ``path``), a non-ASCII name (pax),
    folders implied by their members."""
    long = "/".join(["folder"] * 12) + "/" + "n" * 60 + ".bin"  # > 100 bytes, < 155 + 100
    files = {"./a.txt": b"hello", long: bytes(range(256)) * 5, "./empty": b""}
    if format != tarfile.USTAR_FORMAT:
        files["./ünïcode/x.pt"] = b"\x00" * 1000
    path = write_tar(tmp_path / "t.tar", files, format=format)
    archive = archive_of(path)
    assert {name: archive.read_file(name) for name in members(path)} == members(path)
    assert archive.isdir("folder") and archive.isdir("folder/folder")
    assert archive.listdir("folder/" * 11 + "folder") == {"n" * 60 + ".bin": 1280}


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs the tar program")
@pytest.mark.parametrize("format", ["gnu", "posix", "ustar"])
def test_archives_the_tar_program_writes(tmp_path, format):
    """GNU tar's own headers (``./`` folder entries, GNU long names, pax records)."""
    src = tmp_path / "src"
    deep = src / "a" / ("b" * 90) / "c"
    deep.mkdir(parents=True)
    (deep / "w.bin").write_bytes(bytes(range(256)) * 9)
    (src / "model_config.yaml").write_text("a: 1\n")
    path = tmp_path / "t.tar"
    subprocess.run(["tar", f"--format={format}", "-cf", str(path), "-C", str(src), "."], check=True)
    archive = archive_of(path)
    assert {name: archive.read_file(name) for name in members(path)} == members(path)
    assert archive.listdir() == {"a": -1, "model_config.yaml": 5}


def test_gnu_base256_numbers_as_tarfile_writes_them():
    field = tarfile.itn(2**40 + 5, 12, tarfile.GNU_FORMAT)
    assert field[0] == 0x80
    assert tar_headers._octal(field) == 2**40 + 5
    assert tar_headers._octal(tarfile.itn(0o755, 8, tarfile.USTAR_FORMAT)) == 0o755


def test_a_range_past_a_member_never_reads_the_next_one(tmp_path):
    path = write_tar(tmp_path / "t.tar", {"a": b"A" * 10, "b": b"B" * 600})
    archive = archive_of(path)
    with pytest.raises(CorruptRecordError, match="truncated.*ends at 10"):
        archive.read_ranges([("a", 0, 11)])
    with pytest.raises(CorruptRecordError, match="invalid byte range"):
        archive.read_ranges([("a", 5, 2)])
    assert archive.read_ranges([("b", 590, 600)]) == [b"B" * 10]


def test_names_given_to_the_view_are_checked(tmp_path):
    archive = archive_of(write_tar(tmp_path / "t.tar", {"a": b"x"}))
    for bad in ("../a", "/etc/passwd", "a/../a", "a\x00b"):
        with pytest.raises(UnsafePathError):
            archive.read_file(bad)
        with pytest.raises(UnsafePathError):
            archive.child(bad)
    with pytest.raises(MissingFileError):
        archive.read_file("b")
    with pytest.raises(MissingFileError):
        archive.listdir("b")
    with pytest.raises(UnsafePathError, match="directory"):
        archive.size("")


def test_links_are_listed_never_followed(tmp_path):
    path = tmp_path / "t.tar"
    with tarfile.open(path, "w:") as tar:
        info = tarfile.TarInfo("escape")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
        info = tarfile.TarInfo("same")
        info.type, info.linkname = tarfile.LNKTYPE, "escape"
        tar.addfile(info)
    archive = archive_of(path)
    assert archive.listdir() == {"escape": 0, "same": 0}
    with pytest.raises(UnsafePathError, match="symbolic link to '/etc/passwd'"):
        archive.read_file("escape")
    with pytest.raises(UnsafePathError, match="hard link"):
        archive.read_ranges([("same", 0, 0)])


def test_reading_in_place_from_an_fsspec_store(tmp_path):
    """Any fsspec URL (``memory://``): the members by ranged reads of the archive object."""
    fs = fsspec.filesystem("memory")
    fs.pipe("/tar-test/sub/model.nemo", DIST_NEMO.read_bytes())
    try:
        archive = open_tar_archive(Storage("memory://tar-test/sub"), "model.nemo")
        assert archive.local is False
        assert {name: archive.read_file(name) for name in members(DIST_NEMO)} == members(DIST_NEMO)
        assert (
            archive.describe("model_config.yaml")
            == "memory://tar-test/sub/model.nemo/model_config.yaml"
        )
    finally:
        fs.rm("/tar-test", recursive=True)


def test_first_block_recognition():
    head = DIST_NEMO.read_bytes()[:512]
    assert is_tar_header(head)
    assert not is_tar_header(head[:300])
    assert not is_tar_header(head[:100] + b"x" + head[101:])  # checksum no longer matches
    assert not is_tar_header(bytes(512))


# -- hostile archives ---------------------------------------------------------------------------


@pytest.fixture
def nemo_copy(tmp_path) -> Path:
    path = tmp_path / "model.nemo"
    path.write_bytes(DIST_NEMO.read_bytes())
    return path


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        (b"./../../etc/cron.d/x", "'..' component"),
        (b"/etc/passwd", "an absolute path"),
        (b"./model_weights/../../x", "'..' component"),
        (b"./a\x1bb", "control character"),
        (b"./\xff\xfe", "lone surrogate"),
        (b"./a//b", "empty"),
    ],
)
def test_unsafe_member_names_are_refused(nemo_copy, name, problem):
    at = header_offsets(nemo_copy)["./model_config.yaml"]
    edit_header(nemo_copy, at, slice(0, 100), name)
    with pytest.raises(UnsafePathError, match=problem):
        archive_of(nemo_copy)


def test_a_pax_path_with_dot_dot_is_refused(tmp_path):
    path = write_tar(tmp_path / "t.tar", {"ok": b"1", "x" * 120 + "/../../../escape": b"2"})
    with pytest.raises(UnsafePathError, match="'..' component"):
        archive_of(path)


def test_a_size_beyond_the_archive_is_refused(nemo_copy):
    at = header_offsets(nemo_copy)["./model_weights/common.pt"]
    edit_header(nemo_copy, at, slice(124, 136), b"%011o" % (1 << 33))
    with pytest.raises(TruncatedFileError, match="common.pt.*the archive ends at"):
        archive_of(nemo_copy)


def test_a_bad_checksum_is_refused(nemo_copy):
    at = header_offsets(nemo_copy)["./model_weights/metadata.json"]
    edit_header(nemo_copy, at, slice(124, 136), b"%011o" % 1, checksum=False)
    with pytest.raises(CorruptRecordError, match=f"offset {at}: bad checksum"):
        archive_of(nemo_copy)


def test_a_truncated_archive_is_refused(nemo_copy):
    data = nemo_copy.read_bytes()
    at = header_offsets(nemo_copy)["./model_weights/common.pt"]
    nemo_copy.write_bytes(data[: at + 700])
    with pytest.raises(TruncatedFileError, match="truncated"):
        archive_of(nemo_copy)
    nemo_copy.write_bytes(data[: at + 100])  # a header cut short
    with pytest.raises(TruncatedFileError, match=f"header at offset {at}"):
        archive_of(nemo_copy)


def test_non_octal_numbers_and_refused_types(nemo_copy):
    at = header_offsets(nemo_copy)["./model_config.yaml"]
    edit_header(nemo_copy, at, slice(124, 136), b"12x4")
    with pytest.raises(CorruptRecordError, match="size field: not an octal number"):
        archive_of(nemo_copy)
    edit_header(nemo_copy, at, slice(124, 136), b"%011o" % 10)
    edit_header(nemo_copy, at, slice(156, 157), b"S")
    with pytest.raises(CorruptRecordError, match="sparse member: not supported"):
        archive_of(nemo_copy)


def test_a_member_given_twice_is_ambiguous(tmp_path):
    path = write_tar(tmp_path / "t.tar", {"./a": b"1", "a": b"2"})
    with pytest.raises(CorruptRecordError, match="twice"):
        archive_of(path)
    path = write_tar(tmp_path / "u.tar", {"a": b"1", "a/b": b"2"})
    with pytest.raises(CorruptRecordError, match="holds as a file"):
        archive_of(path)


def test_huge_header_counts_are_refused_in_bounded_time(tmp_path, monkeypatch):
    monkeypatch.setattr(tar_headers, "MAX_HEADERS", 1000)
    path = write_tar(
        tmp_path / "many.tar", {f"f{i}": b"" for i in range(5000)}, format=tarfile.USTAR_FORMAT
    )
    started = time.monotonic()
    with pytest.raises(LimitExceededError, match="more than 1000 tar headers"):
        archive_of(path)
    assert time.monotonic() - started < 5


def test_extended_headers_and_names_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(tar_headers, "MAX_EXTENDED_HEADER", 4096)
    path = write_tar(tmp_path / "long.tar", {"d/" * 3000 + "x": b"1"})  # a 6 kB pax path
    with pytest.raises(LimitExceededError, match="extended header"):
        archive_of(path)
    monkeypatch.setattr(tar_headers, "MAX_EXTENDED_HEADER", 1 << 20)
    with pytest.raises(LimitExceededError, match="one name"):
        archive_of(path)
    path = write_tar(tmp_path / "deep.tar", {"d/" * 100 + "x": b"1"})
    with pytest.raises(LimitExceededError, match="nested more than"):
        archive_of(path)
