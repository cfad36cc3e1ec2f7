"""NeMo checkpoints (``ckptkit.formats.nemo``): ``.nemo`` archives read in place and NeMo 2
folders, on the fixtures of ``tests/fixtures/generators/nemo.py``.

Each weight layout opens, verifies and unshards bit-equal to an independent load: torch.load of
the archive's ``model_weights.ckpt`` as ``tarfile`` extracts it, and for the Megatron layouts the
``torch_dist`` fixture the archive / folder was made from, opened as a folder; a
tensor-parallel archive merges into the TP=1 model its ranks were split from. Over S3 the
tensors are read as exact ranges of the archive, inside the members; compressed,
pipeline-parallel, inconsistent and hostile archives are refused with typed errors naming what is
wrong.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import tarfile
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
import yaml
from safetensors.torch import load_file

import ckptkit
from ckptkit import cli
from ckptkit.decoding.run_config import flatten
from ckptkit.errors import (
    CorruptRecordError,
    FormatError,
    NotACheckpointError,
    TruncatedFileError,
    UnsafePathError,
    UnsupportedLayoutError,
)
from ckptkit.formats.parts.megatron_tp_rules import MegatronTPError

from oracle import assert_bit_equal, raw_bytes

FIXTURES = Path(__file__).parent / "fixtures"
ASR = FIXTURES / "nemo_asr" / "model.nemo"
DIST = FIXTURES / "nemo_megatron_dist" / "model.nemo"
TP2 = FIXTURES / "nemo_megatron_tp2" / "model.nemo"
NEMO2 = FIXTURES / "nemo2_gpt" / "checkpoint"
#: The Megatron torch_dist fixture each Megatron layout holds, byte for byte.
SOURCES = {
    DIST: FIXTURES / "megatron_mcore016_gpt_dp2_ws2" / "checkpoint",
    NEMO2: FIXTURES / "megatron_mcore015_gpt_tp2_ws2" / "checkpoint",
}


def member_bytes(path: Path, name: str) -> bytes:
    with tarfile.open(path) as tar:
        return tar.extractfile(f"./{name}").read()


def member_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Each regular member's ``(offset, size)`` of data in the archive, as tarfile reads it."""
    with tarfile.open(path) as tar:
        return {
            m.name.removeprefix("./"): (m.offset_data, m.size)
            for m in tar.getmembers()
            if m.isfile()
        }


def merged(intervals) -> list[tuple[int, int]]:
    """``[start, end)`` intervals joined where they touch or overlap."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def repacked(path: Path, out: Path, *, drop: str = "", **replace: bytes) -> Path:
    """The archive at ``path`` rewritten by tarfile as NeMo writes one, members in ``replace``
    given new bytes, ``drop`` left out."""
    with tarfile.open(path) as src, tarfile.open(out, "w:") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read() if member.isfile() else None
            name = member.name.removeprefix("./")
            if name == drop:
                continue
            if name in replace:
                data = replace[name]
                member.size = len(data)
            dst.addfile(member, io.BytesIO(data) if data is not None else None)
    return out


# -- each weight layout: open, verify, unshard --------------------------------------------------


def test_torch_save_layout_equals_torch_load_of_the_member():
    ckpt = ckptkit.open(str(ASR))
    assert ckpt.format == "nemo" and ckpt.url == str(ASR)
    expected = torch.load(io.BytesIO(member_bytes(ASR, "model_weights.ckpt")), weights_only=True)
    assert sorted(e.key for e in ckpt.catalog.tensors()) == sorted(
        f"model_weights.{key}" for key in expected
    )
    for key, value in expected.items():
        assert_bit_equal(ckpt.read(f"model_weights.{key}"), value, key)
    facts = ckpt.catalog.facts
    assert facts.layout == "NeMo .nemo archive: model_weights.ckpt (torch.save)"
    assert facts.config_file == "model_config.yaml"
    assert ckpt.config == yaml.safe_load(member_bytes(ASR, "model_config.yaml"))
    (artifact,) = facts.skipped_files
    assert artifact.endswith("_tokenizer.model")
    assert f"nemo:{artifact}" in facts.skipped_files[artifact]
    sizes = member_offsets(ASR)
    assert dict(zip(ckpt.files["file"], ckpt.files["size"], strict=True)) == {
        "model_weights.ckpt": sizes["model_weights.ckpt"][1],
        "model_config.yaml": sizes["model_config.yaml"][1],
    }
    config = {f"model_config.{key}": value for key, value in flatten(ckpt.config)}
    assert {key: ckpt.read_object(key) for key in ckpt.objects["key"]} == config


@pytest.mark.parametrize("path", [DIST, NEMO2], ids=["nemo-torch-dist", "nemo2"])
def test_megatron_layouts_equal_their_torch_dist_folder(path):
    ckpt, folder = ckptkit.open(str(path)), ckptkit.open(str(SOURCES[path]))
    assert ckpt.format == "nemo" and folder.format == "megatron_dist"
    config = "model_config" if path == DIST else "context"  # the config's values, beside
    weights = [key for key in ckpt.catalog.entries if not key.startswith(f"{config}.")]
    assert weights == list(folder.catalog.entries)
    for entry in folder.catalog.tensors():
        assert_bit_equal(ckpt.read(entry.key), folder.read(entry.key), entry.key)
    columns = ["key", "type", "preview"]
    objects = ckpt.objects[~ckpt.objects["key"].str.startswith(f"{config}.")]
    assert objects[columns].reset_index(drop=True).equals(folder.objects[columns])
    sub = "model_weights" if path == DIST else "weights"
    assert [f for f in ckpt.catalog.files if f.startswith(f"{sub}/")] == [
        f"{sub}/{n}" for n in folder.catalog.files
    ]
    assert ckpt.catalog.facts.alternate_groups == ("stacked",)
    assert ckpt.catalog.facts.world_size == folder.catalog.facts.world_size


def test_nemo2_context_is_the_config_and_io_json_is_checked():
    ckpt = ckptkit.open(str(NEMO2))
    facts = ckpt.catalog.facts
    assert facts.layout.startswith("NeMo 2 checkpoint: weights/ (Megatron-core torch_dist)")
    assert facts.config_file == "context/model.yaml"
    assert ckpt.config == yaml.safe_load((NEMO2 / "context" / "model.yaml").read_text())
    assert ckpt.config_table.set_index("key")["value"]["config.num_layers"] == 2
    assert ckpt.read_object("context.model.config.num_layers") == 2
    assert {"context/io.json", "context/nemo_tokenizer/"} <= set(facts.skipped_files)
    assert "weights/metadata.json" in facts.metadata_files


@pytest.mark.parametrize("path", [ASR, DIST, NEMO2], ids=["torch-save", "torch-dist", "nemo2"])
def test_verify_and_unshard_equal_the_extracted_checkpoint(path, tmp_path, capsys):
    """``ckptkit verify`` exits 0; ``ckptkit unshard --to safetensors`` writes the same bytes as
    unsharding the checkpoint the archive holds, extracted (or the Megatron folder it holds)."""
    assert cli.main(["verify", str(path)]) == 0
    assert cli.main(["unshard", str(path), str(tmp_path / "out"), "--to", "safetensors"]) == 0
    if path == ASR:
        extracted = tmp_path / "extracted"
        with tarfile.open(path) as tar:
            tar.extractall(extracted, filter="data")
        ckptkit.unshard(
            str(extracted / "model_weights.ckpt"),
            str(tmp_path / "ref"),
            to="safetensors",
            progress=False,
        )
    else:
        ckptkit.unshard(str(SOURCES[path]), str(tmp_path / "ref"), to="safetensors", progress=False)
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    config = "model_config.objects.pt" if path != NEMO2 else "context.objects.pt"
    assert config in written  # the config's values, as objects
    written.remove(config)
    assert written == sorted(p.name for p in (tmp_path / "ref").iterdir()) and written
    for name in written:
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), (
            name
        )
    back, ckpt = ckptkit.open(str(tmp_path / "out")), ckptkit.open(str(path))
    for entry in ckpt.catalog.select():
        if entry.kind == "tensor":
            assert_bit_equal(back.read(entry.key), ckpt.read(entry.key), entry.key)
    capsys.readouterr()


# -- refused layouts ------------------------------------------------------------------------------


# -- tensor-parallel archives: merged by Megatron's naming rules ----------------------------------


def with_config(path: Path, out: Path, **fields) -> Path:
    """The archive at ``path`` with its ``model_config.yaml`` fields set (None: removed)."""
    config = yaml.safe_load(member_bytes(path, "model_config.yaml"))
    for name, value in fields.items():
        if value is None:
            config.pop(name, None)
        else:
            config[name] = value
    text = yaml.safe_dump(config, sort_keys=False).encode()
    return repacked(path, out, **{"model_config.yaml": text})


def tp2_archive(tmp_path: Path, **fields) -> Path:
    """The TP=2 fixture (4 attention heads of 6 channels), its config changed by ``fields``."""
    return with_config(TP2, tmp_path / "tp2.nemo", **fields) if fields else TP2


def reference_tp2() -> dict[str, dict]:
    listed = json.loads((TP2.parent / "reference" / "tensors.sha256.json").read_text())
    return listed["model_weights.ckpt"]


def sha_of(tensor: torch.Tensor) -> dict:
    return {
        "shape": list(tensor.shape),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "sha256": hashlib.sha256(raw_bytes(tensor)).hexdigest(),
    }


def test_a_tensor_parallel_archive_is_merged_into_the_model_it_was_split_from(tmp_path, capsys):
    path = tp2_archive(tmp_path)
    found = ckptkit.detect(str(path))
    assert found.format == "nemo"
    assert "found mp_rank_00, mp_rank_01 (tensor-parallel ranks)" in found.evidence
    ckpt = ckptkit.open(str(path))
    facts = ckpt.catalog.facts
    assert facts.layout == (
        "NeMo .nemo archive: mp_rank_XX/model_weights.ckpt (Megatron GPT, TP=2, merged)"
    )
    assert facts.world_size == 2 and facts.config_file == "model_config.yaml"
    assert facts.rank_files == ("mp_rank_00/model_weights.ckpt", "mp_rank_01/model_weights.ckpt")
    reference = reference_tp2()
    assert sorted(e.key for e in ckpt.catalog.tensors()) == sorted(
        f"model_weights.{key}" for key in reference
    )
    for key, expected in reference.items():
        assert sha_of(ckpt.read(f"model_weights.{key}")) == expected, key
    qkv = ckpt.catalog.entries[
        "model_weights.model.language_model.encoder.layers.0.self_attention.query_key_value.weight"
    ]
    assert [(c.offsets, c.sizes, c.rank) for c in qkv.chunks] == [
        ((0, 0), (36, 24), 0),
        ((36, 0), (36, 24), 1),
    ]
    proj = ckpt.catalog.entries[
        "model_weights.model.language_model.encoder.layers.0.mlp.dense_4h_to_h.weight"
    ]
    assert [c.offsets for c in proj.chunks] == [(0, 0), (0, 24)]  # row-parallel: dim 1

    assert cli.main(["verify", str(path)]) == 0
    out = tmp_path / "out"
    assert cli.main(["unshard", str(path), str(out), "--to", "safetensors"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "model_config.objects.pt",
        "model_weights.safetensors",
    ]
    written = load_file(str(out / "model_weights.safetensors"))
    assert {key: sha_of(value) for key, value in written.items()} == reference
    capsys.readouterr()


def test_the_reference_is_what_the_rank_files_split(tmp_path):
    """The oracle: each rank's tensors, concatenated by torch along Megatron's split dimension,
    are the reference (checked independently of ckptkit)."""
    ranks = [
        torch.load(
            io.BytesIO(member_bytes(TP2, f"mp_rank_0{r}/model_weights.ckpt")), weights_only=True
        )
        for r in range(2)
    ]
    reference = reference_tp2()
    for key, expected in reference.items():
        row = "self_attention.dense." in key or "dense_4h_to_h" in key
        column = any(n in key for n in ("word_embeddings", "query_key_value", "dense_h_to_4h"))
        pieces = [rank[key] for rank in ranks]
        whole = torch.cat(pieces, dim=1 if row else 0) if row or column else pieces[0]
        assert sha_of(whole) == expected, key


def with_rank_tensor(path: Path, out: Path, key: str, value: torch.Tensor) -> Path:
    """The archive with ``key`` added to every rank file (torch.save'd again)."""
    replace = {}
    for r in range(2):
        name = f"mp_rank_0{r}/model_weights.ckpt"
        state = torch.load(io.BytesIO(member_bytes(path, name)), weights_only=True)
        state[key] = value
        buffer = io.BytesIO()
        torch.save(state, buffer)
        replace[name] = buffer.getvalue()
    return repacked(path, out, **replace)


QKV = "model_weights.model.language_model.encoder.layers.0.self_attention.query_key_value.weight"
REFUSALS = {
    "no-hidden-size": (
        {"hidden_size": None},
        MegatronTPError,
        r"model_config\.yaml: hidden_size is None, not a positive int \(needed to check",
        "model_config.yaml",
        "model_config.hidden_size",
    ),
    "three-heads-at-tp2": (
        {"num_attention_heads": 3},
        MegatronTPError,
        r"holds 3 query groups \(args\), not divisible by TP=2",
        "mp_rank_00/model_weights.ckpt",
        QKV,
    ),
    "ffn-size-disagrees": (
        {"ffn_hidden_size": 64},
        MegatronTPError,
        r"has shape \[24, 24\] on TP rank 0, but args give \[32, 24\]",
        "mp_rank_00/model_weights.ckpt",
        "model_weights.model.language_model.encoder.layers.0.mlp.dense_h_to_4h.weight",
    ),
    "unknown-activation": (
        {"activation": "swish-gate"},
        MegatronTPError,
        r"activation 'swish-gate' is not one ckptkit knows",
        "model_config.yaml",
        "model_config.activation",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_tensor_parallel_refusals_name_the_file_and_key(case, tmp_path, capsys):
    fields, error, message, file, key = REFUSALS[case]
    path = tp2_archive(tmp_path, **fields)
    with pytest.raises(error, match=message) as caught:
        ckptkit.open(str(path))
    assert (caught.value.file, caught.value.key) == (file, key)
    assert f"{path}/{file}" in str(caught.value)
    assert cli.main(["inspect", str(path)]) == 2
    assert f"{path}/{file}" in capsys.readouterr().err
    assert cli.main(["verify", str(path)]) == 1  # a format problem, as megatron_legacy's
    assert f"{path}/{file}" in capsys.readouterr().out


def test_a_parameter_without_a_rule_is_refused(tmp_path):
    expert = "model.language_model.encoder.layers.0.mlp.experts.0.weight"
    path = with_rank_tensor(tp2_archive(tmp_path), tmp_path / "moe.nemo", expert, torch.ones(4))
    with pytest.raises(MegatronTPError, match="has no Megatron tensor-parallel rule") as caught:
        ckptkit.open(str(path))
    assert caught.value.key == f"model_weights.{expert}"


def test_a_pipeline_parallel_archive_is_refused_by_name(tmp_path, capsys):
    path = tp2_archive(tmp_path, pipeline_model_parallel_size=2)
    with pytest.raises(
        UnsupportedLayoutError, match=r"a pipeline-parallel \.nemo archive \(mp_rank_00, mp_rank_01"
    ):
        ckptkit.open(str(path))
    assert cli.main(["verify", str(path)]) == 2
    assert "pipeline_model_parallel_size 2" in capsys.readouterr().err


def test_a_compressed_nemo_is_refused_with_the_commands(tmp_path):
    path = tmp_path / "asr.nemo"
    path.write_bytes(gzip.compress(ASR.read_bytes()))  # tarfile "w:gz", as NeMo < 1.7 wrote
    with tarfile.open(path) as tar:
        assert "./model_config.yaml" in tar.getnames()
    found = ckptkit.detect(str(path))
    assert (found.format, found.evidence) == (
        "nemo",
        ["asr.nemo is a gzip-compressed .nemo archive"],
    )
    with pytest.raises(
        UnsupportedLayoutError, match=r"compressed \.nemo archive.*tar -xzf asr\.nemo -C asr"
    ):
        ckptkit.open(str(path))


def test_a_nemo_name_alone_is_not_enough(tmp_path):
    path = tmp_path / "fake.nemo"
    path.write_bytes(b"not a tar: " + bytes(600))
    with pytest.raises(NotACheckpointError):
        ckptkit.open(str(path))
    path = repacked(ASR, tmp_path / "weightless.nemo", drop="model_weights.ckpt")
    with pytest.raises(FormatError, match=r"a \.nemo archive with no weights"):
        ckptkit.open(str(path))
    path = repacked(ASR, tmp_path / "configless.nemo", drop="model_config.yaml")
    with pytest.raises(FormatError, match=r"a \.nemo archive without model_config\.yaml"):
        ckptkit.open(str(path))


# -- remote archives ------------------------------------------------------------------------------


def upload_file(path: Path) -> str:
    fs = fsspec.filesystem("s3")
    bucket = f"nemo-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    key = f"{bucket}/models/{path.name}"
    fs.put(str(path), key)
    fs.invalidate_cache()
    return f"s3://{key}"


@pytest.mark.parametrize("path", [ASR, DIST], ids=["torch-save", "torch-dist"])
def test_s3_reads_exactly_the_records_inside_the_members(s3, path):
    url = upload_file(path)
    key = "/" + url.removeprefix("s3://")
    local, offsets = ckptkit.open(str(path)), member_offsets(path)
    s3.traffic.reset()
    ckpt = ckptkit.open(url)
    assert ckpt.format == "nemo" and ckpt.tensors.equals(local.tensors)
    # opening: the front of the archive, then headers and the members describe() reads
    for get in s3.traffic.gets(key):
        start, end = (int(n) for n in get.range.removeprefix("bytes=").split("-"))
        assert (
            start == 0
            or end + 1 - start <= 1536
            or any(o <= start and end < o + n for o, n in offsets.values())
        ), get.range

    entry = max(ckpt.catalog.tensors(), key=lambda e: e.nbytes)
    s3.traffic.reset()
    assert_bit_equal(ckpt.read(entry.key), local.read(entry.key), entry.key)
    records = {(offsets[c.record.file][0] + c.record.offset, c.record.length) for c in entry.chunks}
    gets = s3.traffic.gets(key)
    fetched = [tuple(int(n) for n in g.range.removeprefix("bytes=").split("-")) for g in gets]
    assert merged((start, end + 1) for start, end in fetched) == merged(
        (start, start + length) for start, length in records
    )
    assert sum(g.nbytes for g in gets) == sum(length for _, length in records)
    for chunk in entry.chunks:  # inside its member
        assert chunk.record.offset + chunk.record.length <= offsets[chunk.record.file][1]


def test_memory_filesystem_archive():
    fs = fsspec.filesystem("memory")
    root = f"/nemo-{uuid.uuid4().hex[:8]}"
    fs.pipe(f"{root}/model.nemo", DIST.read_bytes())
    try:
        ckpt, local = ckptkit.open(f"memory://{root}/model.nemo"), ckptkit.open(str(DIST))
        assert ckpt.tensors.equals(local.tensors)
        for entry in ckpt.catalog.tensors()[:8]:
            assert_bit_equal(ckpt.read(entry.key), local.read(entry.key), entry.key)
    finally:
        fs.rm(root, recursive=True)


# -- hostile archives and configs ----------------------------------------------------------------


def test_hostile_archives_are_typed_errors_through_open(tmp_path):
    data = bytearray(ASR.read_bytes())
    with tarfile.open(ASR) as tar:
        at = tar.getmember("./model_weights.ckpt").offset_data - 512
    name = data[at : at + 100]
    data[at : at + 100] = b"./../model_weights.ckpt".ljust(100, b"\0")
    header = data[at : at + 512]
    header[148:156] = b"        "
    data[at + 148 : at + 156] = b"%06o\0 " % tarfile.calc_chksums(bytes(header))[0]
    (tmp_path / "escape.nemo").write_bytes(bytes(data))
    with pytest.raises(UnsafePathError, match=r"tar member './../model_weights.ckpt'.*'\.\.'"):
        ckptkit.open(str(tmp_path / "escape.nemo"))

    data[at : at + 100] = name  # the checksum no longer matches the header
    (tmp_path / "checksum.nemo").write_bytes(bytes(data))
    with pytest.raises(CorruptRecordError, match="bad checksum"):
        ckptkit.open(str(tmp_path / "checksum.nemo"))

    (tmp_path / "cut.nemo").write_bytes(ASR.read_bytes()[: at + 2048])
    with pytest.raises(TruncatedFileError, match="model_weights.ckpt"):
        ckptkit.open(str(tmp_path / "cut.nemo"))


def test_configs_are_decoded_safely(tmp_path):
    marker = tmp_path / "ran"
    evil = f"!!python/object/apply:os.system ['touch {marker}']\n".encode()
    path = repacked(ASR, tmp_path / "evil.nemo", **{"model_config.yaml": evil})
    with pytest.raises(CorruptRecordError, match="model_config.yaml: not valid YAML"):
        ckptkit.open(str(path))
    assert not marker.exists()
    path = repacked(ASR, tmp_path / "list.nemo", **{"model_config.yaml": b"- 1\n- 2\n"})
    with pytest.raises(CorruptRecordError, match="not a mapping but list"):
        ckptkit.open(str(path))

    folder = tmp_path / "nemo2"
    shutil.copytree(NEMO2, folder)
    (folder / "context" / "io.json").write_text('{"root": ')
    with pytest.raises(CorruptRecordError, match="io.json: not valid JSON"):
        ckptkit.open(str(folder))
