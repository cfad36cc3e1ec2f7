"""Names and numbers from a checkpoint are untrusted: checkpoints written by torch (then edited
where torch itself would refuse the attack) must never make ckptkit write outside the
destination, drop a tensor silently, or allocate what a number merely announces.

Names: a hypothesis property over group and key names through unshard (both targets) and
convert to DCP. Numbers: each measured attack as a test, bounded in time and, where it used to
allocate gigabytes, run in a subprocess under an address-space limit.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import resource
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException

import ckptkit
from ckptkit.catalog.output_names import decode_stem, encode_stem
from ckptkit.cli import main as cli_main
from ckptkit.errors import CheckpointError, LimitExceededError, MissingFileError, OutputNameError
from ckptkit.formats.torch_save import group_of

from oracle import assert_bit_equal

FIXTURES = Path(__file__).parent / "fixtures"
#: Address space for subprocesses that must not allocate what a number announces.
ADDRESS_SPACE = 3 << 30


def save(state: dict, path: Path) -> Path:
    """A single-process DCP written by torch itself."""
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def edit_metadata(path: Path, edit) -> None:
    """Rewrite ``path/.metadata`` after ``edit(metadata)`` (torch's own classes, trusted here:
    the test wrote this file)."""
    metadata_file = path / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())
    edit(metadata)
    metadata_file.write_bytes(pickle.dumps(metadata))


def tree_hashes(root: Path) -> dict[str, str]:
    """Every file under ``root`` with its SHA-256 (bystanders must stay as they were)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() or p.is_symlink()]


def run_limited(script: str, *args: object, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -c script`` under an address-space limit; the limit is the test's point."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    return subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit,
        cwd=Path(__file__).parent,
    )


# -- output names -----------------------------------------------------------------------------

SUFFIXES = [".pt", ".safetensors", ".objects.pt", "-00001-of-00002.safetensors"]


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=80))
def test_encoded_stems_stay_in_their_folder_and_decode_back(group):
    try:
        stem = encode_stem(group)
    except OutputNameError:
        assert len(group.encode("utf-8", "surrogatepass")) * 3 > 200 or any(
            0xD800 <= ord(c) <= 0xDFFF for c in group
        )
        return
    for suffix in SUFFIXES:
        name = stem + suffix
        assert "/" not in name and "\\" not in name and "\x00" not in name
        assert not name.startswith(".")
        assert all(ord(c) >= 0x20 and ord(c) != 0x7F for c in name)
        assert len(name.encode()) <= 255
        assert group_of(name) == group, (group, name)
    assert decode_stem(stem) == group


@pytest.mark.parametrize(
    "group",
    ["..", ".", "../../escape", "/etc/passwd", "con", "NUL.txt", "model.objects", "a-1-of-2"],
)
def test_dangerous_groups_get_harmless_stems(group):
    stem = encode_stem(group)
    assert stem not in (".", "..") and "/" not in stem and not stem.startswith(".")
    assert stem.lower().split(".")[0] not in ("con", "nul")
    assert group_of(stem + ".pt") == group


#: Names as they come out of real checkpoints and out of an attacker's editor.
NAMES = st.one_of(
    st.sampled_from(
        ["..", ".", "../../x", "/abs/x", "con", "__metadata__", "a/b", "x" * 240, "\x1b]0;t\x07"]
    ),
    st.text(min_size=0, max_size=12),
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    groups=st.lists(NAMES, min_size=1, max_size=3, unique=True),
    inner=st.lists(NAMES, min_size=1, max_size=2, unique=True),
    target=st.sampled_from(["torch", "safetensors", "dcp"]),
)
def test_any_names_stay_inside_dst_and_nothing_is_lost(tmp_path_factory, groups, inner, target):
    state = {
        group: {name: torch.full((2,), float(i * 10 + j)) for j, name in enumerate(inner)}
        for i, group in enumerate(groups)
    }
    root = tmp_path_factory.mktemp("names")
    try:
        src = save(state, root / "src")
    except (ValueError, RuntimeError, CheckpointException):  # torch refuses (duplicate flat keys…)
        assume(False)
    dst = root / "deep" / "dst"
    bystanders = tree_hashes(root / "src")
    try:
        if target == "dcp":
            ckptkit.convert(str(src), str(dst), to="dcp", progress=False)
        else:
            ckptkit.unshard(str(src), str(dst), to=target, progress=False)
    except CheckpointError:
        written = [p for p in files_under(root) if not p.is_relative_to(root / "src")]
        assert written == [], "a refusal must write nothing"
        return
    finally:
        assert tree_hashes(root / "src") == bystanders  # the source is never modified
    for path in files_under(root):
        assert path.resolve().is_relative_to(src.resolve()) or path.resolve().is_relative_to(
            dst.resolve()
        ), path
    assert not [p for p in dst.iterdir() if p.name.startswith(".ckptkit-tmp")]
    out = ckptkit.open(str(dst))
    expected = ckptkit.open(str(src))
    assert sorted(out.catalog.entries) == sorted(expected.catalog.entries)
    for key in expected.catalog.entries:
        assert_bit_equal(out.read(key), expected.read(key), key)


def test_top_level_keys_cannot_write_outside_dst(tmp_path):
    src = save(
        {"../../escape": {"w": torch.ones(3)}, "/tmp/abs": {"v": torch.zeros(2)}}, tmp_path / "src"
    )
    dst = tmp_path / "a" / "b" / "dst"
    # a file already at dst/../../escape.pt, where the key points
    victim = tmp_path / "a" / "escape.pt"
    victim.parent.mkdir(parents=True)
    victim.write_bytes(b"precious")
    for target in ("torch", "safetensors"):
        for overwrite in (False, True):
            out = dst / f"{target}-{overwrite}"
            result = ckptkit.unshard(
                str(src), str(out), to=target, overwrite=overwrite, progress=False
            )
            assert {f.name for f in result.files} <= {p.name for p in out.iterdir()}
            for path in files_under(tmp_path):
                assert path.is_relative_to(out.parent) or path.is_relative_to(src) or path == victim
            assert sorted(ckptkit.open(str(out)).catalog.entries) == [
                "../../escape.w",
                "/tmp/abs.v",
            ]
    assert victim.read_bytes() == b"precious"
    assert not Path("/tmp/abs.pt").exists() and not Path("/tmp/abs.safetensors").exists()


def test_top_level_keys_cannot_leave_an_s3_destination(s3, tmp_path):
    import fsspec

    src = save({"../../other/escape": {"w": torch.ones(3)}}, tmp_path / "src")
    fs = fsspec.filesystem("s3")
    bucket = f"dst-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    url = f"s3://{bucket}/runs/out"
    ckptkit.unshard(str(src), url, to="safetensors", progress=False)
    fs.invalidate_cache()
    keys = fs.find(bucket)
    assert keys and all(k.startswith(f"{bucket}/runs/out/") for k in keys), keys
    assert sorted(ckptkit.open(url).catalog.entries) == ["../../other/escape.w"]


def test_safetensors_key_collision_is_refused_before_writing(tmp_path):
    src = save({"m": {"a": {"b": {"c": torch.ones(2)}, "x": torch.zeros(2)}}}, tmp_path / "src")

    def rename(metadata):  # ('m','a','x') → ('m','a.b','c'): dotted, both are m.a.b.c
        metadata.planner_data["m.a.x"] = ("m", "a.b", "c")

    edit_metadata(src, rename)
    dst = tmp_path / "dst"
    with pytest.raises(OutputNameError, match=r"m\.a\.b\.c.*m\.a\.x|m\.a\.x.*m\.a\.b\.c"):
        ckptkit.unshard(str(src), str(dst), to="safetensors", progress=False)
    assert not dst.exists() or files_under(dst) == []
    # torch output keeps both: nesting tells them apart
    ckptkit.unshard(str(src), str(dst), to="torch", progress=False)
    loaded = torch.load(dst / "m.pt", weights_only=True)
    assert set(loaded["a"]) == {"b"} and set(loaded["a.b"]) == {"c"}


def test_tensor_where_a_subtree_is_needed_is_refused(tmp_path):
    src = save({"m": {"a": {"b": torch.ones(2)}, "c": torch.zeros(2)}}, tmp_path / "src")

    def clash(metadata):  # m.c now sits below the tensor m.a.b
        metadata.planner_data["m.c"] = ("m", "a", "b", "c")

    edit_metadata(src, clash)
    for target in ("torch", "safetensors"):
        dst = tmp_path / target
        if target == "safetensors":  # flat keys do not clash: both are written
            ckptkit.unshard(str(src), str(dst), to=target, progress=False)
            assert len(ckptkit.open(str(dst)).catalog.entries) == 2
            continue
        with pytest.raises(OutputNameError, match=r"\('a', 'b'"):
            ckptkit.unshard(str(src), str(dst), to=target, progress=False)
        assert not dst.exists() or files_under(dst) == []
    with pytest.raises(OutputNameError):
        ckptkit.load_state_dict(str(src))


def test_huge_list_index_in_planner_data_is_refused(tmp_path):
    src = save({"optim": {"param_groups": [{"lr": 0.1}]}}, tmp_path / "src")

    def huge(metadata):
        (key,) = [k for k in metadata.planner_data if k.startswith("optim.param_groups")]
        metadata.planner_data[key] = ("optim", "param_groups", 10**12, "lr")

    edit_metadata(src, huge)
    script = (
        "import sys, ckptkit\n"
        "try:\n"
        "    ckptkit.unshard(sys.argv[1], sys.argv[2], progress=False)\n"
        "except ckptkit.LimitExceededError as exc:\n"
        "    print('refused:', exc)\n"
    )
    result = run_limited(script, src, tmp_path / "dst")
    assert result.returncode == 0, result.stderr
    assert "list index 1000000000000" in result.stdout
    assert not (tmp_path / "dst").exists() or files_under(tmp_path / "dst") == []


def test_a_huge_shape_over_a_small_record_is_refused_without_allocating(tmp_path):
    src = save({"w": torch.ones(1024), "v": torch.zeros(3)}, tmp_path / "src")

    def grow(metadata):  # the tensor claims 10**12 elements in its one chunk
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

        item = metadata.state_dict_metadata["w"]
        item.size = torch.Size([10**12])
        item.chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([10**12]))]
        (old,) = [k for k in metadata.storage_data if k.fqn == "w"]
        metadata.storage_data[MetadataIndex("w", torch.Size([0]))] = metadata.storage_data.pop(old)

    edit_metadata(src, grow)
    script = (
        "import sys, ckptkit\n"
        "ckpt = ckptkit.open(sys.argv[1])\n"
        "print(ckpt.read('v').tolist())\n"
        "try:\n"
        "    ckpt.read('w')\n"
        "except (ckptkit.LimitExceededError, ckptkit.MismatchError) as exc:\n"
        "    print('refused:', type(exc).__name__, exc)\n"
        "print(ckpt.verify()[['key', 'problem']].to_dict('records'))\n"
    )
    result = run_limited(script, src)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "[0.0, 0.0, 0.0]"  # the rest of the checkpoint stays readable
    assert lines[1].startswith("refused:") and "'w'" in lines[1]
    assert "'key': 'w'" in lines[2] and "'key': 'v'" not in lines[2]


def test_zstd_bomb_is_refused_at_the_size_the_metadata_allows(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    src = tmp_path / "src"
    dcp.save(
        {"w": torch.ones(4)},
        storage_writer=FileSystemWriter(str(src), _extensions=[ZStandard()]),
        no_dist=True,
    )
    (data_file,) = src.glob("*.distcp")
    bomb = zstandard.ZstdCompressor().compress(bytes(64 << 20))  # 64 MiB of zeros, ~2 KB

    offset = data_file.stat().st_size

    def point_at_bomb(metadata):
        for index, info in metadata.storage_data.items():
            if index.fqn == "w":
                info.offset, info.length = offset, len(bomb)

    with data_file.open("ab") as f:
        f.write(bomb)
    edit_metadata(src, point_at_bomb)
    ckpt = ckptkit.open(str(src))
    with pytest.raises(LimitExceededError, match="inflates past"):
        ckpt.read("w")


# -- counts, ranks and world sizes ------------------------------------------------------------


def test_a_huge_rank_number_costs_what_the_files_cost(tmp_path):
    ckpt = tmp_path / "step3"
    shutil.copytree(FIXTURES / "olmo_torch_legacy_ws2" / "step3", ckpt)
    shutil.copy(ckpt / "rank1.pt", ckpt / "rank99999999999.pt")
    (ckpt / "rank1.pt").unlink()
    script = (
        "import sys, ckptkit\n"
        "try:\n"
        "    ckptkit.open(sys.argv[1]).tensors\n"
        "except ckptkit.CoverageError as exc:\n"
        "    print('refused:', exc)\n"
    )
    result = run_limited(script, ckpt, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("refused:") and "rank99999999999.pt" in result.stdout


def test_olmo_local_world_size_beyond_its_files(tmp_path):
    ckpt = tmp_path / "step3"
    shutil.copytree(FIXTURES / "olmo_local_ws2" / "step3", ckpt)
    (ckpt / "metadata.yaml").write_text("world_size: 100000000\n")
    with pytest.raises(MissingFileError, match=r"rank2\.pt.*99999998 rank files in all"):
        ckptkit.open(str(ckpt))


# -- the command line -------------------------------------------------------------------------


def test_cli_escapes_control_characters_from_keys(tmp_path, capsys):
    src = save({"model": {"\x1b]52;c;ZXZpbA==\x07w": torch.ones(2)}}, tmp_path / "src")
    assert cli_main(["inspect", str(src)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "\\x1b]52;c;ZXZpbA==\\x07w" in out


def test_cli_errors_are_one_line_and_exit_2(tmp_path, capsys):
    src = save({"m": {"a": {"b": torch.ones(2)}, "c": torch.zeros(2)}}, tmp_path / "src")
    edit_metadata(src, lambda m: m.planner_data.__setitem__("m.c", ("m", "a", "b", "c")))
    assert cli_main(["unshard", str(src), str(tmp_path / "dst"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ckptkit: error: ") and err.count("\n") == 1
    assert "Traceback" not in err
    existing = tmp_path / "dst2"
    ckptkit.unshard(str(src), str(existing), to="safetensors", progress=False)
    assert cli_main(["unshard", str(src), str(existing), "--to", "safetensors", "--quiet"]) == 2
    assert "already exists" in capsys.readouterr().err


def test_every_error_class_is_a_checkpoint_error():
    names = [n for n in ckptkit.__all__ if n.endswith("Error")]
    assert len(names) >= 18
    for name in names:
        assert issubclass(getattr(ckptkit, name), ckptkit.CheckpointError), name
    assert issubclass(ckptkit.OutputExistsError, FileExistsError)
    assert issubclass(ckptkit.UsageError, ValueError)
    assert issubclass(ckptkit.DestinationError, OSError)
    with pytest.raises(ckptkit.UsageError):
        ckptkit.unshard(str(FIXTURES / "olmo_unsharded"), "/nonexistent", to="onnx")
    assert os.path.exists("/nonexistent") is False


# -- whatever a field of .metadata says, only ckptkit errors come out -------------------------

#: Values an edited field may take: wrong types, negative, huge, paths that leave the folder.
ODD_VALUES = st.one_of(
    st.none(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([10**12, 2**63, -1, 0, 1 << 31]),
    st.text(max_size=8),
    st.sampled_from(["../outside.distcp", "/etc/hostname", "__0_0.distcp", "", "a/../../b"]),
    st.lists(st.integers(min_value=-3, max_value=10**13), max_size=4).map(tuple),
    st.floats(allow_nan=True),
)


def _fields(metadata) -> list[tuple[object, str]]:
    """(object, attribute) pairs of the metadata an attacker would edit."""
    fields: list[tuple[object, str]] = []
    for item in metadata.state_dict_metadata.values():
        if hasattr(item, "chunks"):
            fields.append((item, "size"))
            for chunk in item.chunks:
                fields += [(chunk, "offsets"), (chunk, "sizes")]
    for index, info in metadata.storage_data.items():
        fields += [(info, "relative_path"), (info, "offset"), (info, "length"), (index, "offset")]
    return fields


@pytest.fixture(scope="module")
def fuzz_source(tmp_path_factory) -> Path:
    gen = torch.Generator().manual_seed(0)
    state = {
        "model": {"w": torch.randn(6, 4, generator=gen), "b": torch.randn(4, generator=gen)},
        "optim": {"param_groups": [{"lr": 0.1}], "step": 3},
    }
    return save(state, tmp_path_factory.mktemp("fuzz") / "src")


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_edited_metadata_fields_give_only_checkpoint_errors(fuzz_source, tmp_path_factory, data):
    src = tmp_path_factory.mktemp("edited") / "src"
    shutil.copytree(fuzz_source, src)
    outside = src.parent / "outside.distcp"
    outside.write_bytes(b"private" * 100)
    metadata = pickle.loads((src / ".metadata").read_bytes())
    fields = _fields(metadata)
    for _ in range(data.draw(st.integers(1, 3))):
        target, attribute = data.draw(st.sampled_from(fields))
        value = data.draw(ODD_VALUES)
        try:
            object.__setattr__(target, attribute, value)
        except (AttributeError, TypeError):
            continue
    (src / ".metadata").write_bytes(pickle.dumps(metadata))
    dst = src.parent / "dst"
    try:
        ckpt = ckptkit.open(str(src))
        ckpt.tensors  # noqa: B018 — the tables are built from every field
        for entry in ckpt.catalog.entries.values():
            (ckpt.read if entry.kind == "tensor" else ckpt.read_object)(entry.key)
        ckptkit.unshard(ckpt, str(dst), progress=False)
    except CheckpointError as exc:
        event(type(exc).__name__)
        assert not dst.exists() or files_under(dst) == []
    else:
        event("accepted")  # whatever was accepted was read from inside the checkpoint
        assert all(b"private" not in p.read_bytes() for p in files_under(dst) if p.suffix == ".pt")
