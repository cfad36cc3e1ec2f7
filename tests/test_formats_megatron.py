"""Megatron-core ``torch_dist`` checkpoints (the ``megatron_*`` fixtures, written by megatron-core
0.15 / 0.16 itself) against Megatron's own outputs: ``load_plain_tensors`` (stored keys),
the reload into a TP=1 model (per-layer keys) and the ShardedObjects, hashed or saved in
``reference/``."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from byte_edits import unframed

import ckptkit
from ckptkit.errors import UnsafePickleError

from conformance_cases import FIXTURES, MEGATRON_ITEMS
from oracle import inspect_without_torch, raw_bytes

REFORMULATED = "nd_reformulated_orig_global_shape"


def _path(item: str) -> Path:
    return FIXTURES / item / "checkpoint"


def _hashes(item: str) -> dict:
    return json.loads((FIXTURES / item / "reference" / "tensors.sha256.json").read_text())


def _sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(raw_bytes(tensor)).hexdigest()


def _ours(ckpt: ckptkit.Checkpoint, stored: str) -> str:
    """The catalog key of a stored DCP key (see the adapter's docstring)."""
    if f"stacked.{stored}" in ckpt.catalog.entries:
        return f"stacked.{stored}"
    for prefix, group in (("optimizer.", "optimizer"), ("rng_state/", "rng_state")):
        if stored.startswith(prefix):
            return f"{group}.{stored[len(prefix) :]}"
    return f"model.{stored}"


@pytest.fixture(scope="module", params=MEGATRON_ITEMS)
def item(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def ckpt(item) -> ckptkit.Checkpoint:
    return ckptkit.open(str(_path(item)))


def test_detection_names_its_evidence(item):
    found = ckptkit.detect(str(_path(item)))
    assert found.format == "megatron_dist"
    assert found.evidence[0] == "found metadata.json (sharded_backend: torch_dist)"
    assert "found .metadata (DCP)" in found.evidence and "found common.pt" in found.evidence


def test_run_directory_opens_the_tracked_iteration(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(_path("megatron_mcore016_gpt_tp2_ws2"), run / "iter_0000002")
    (run / "iter_0000001").mkdir()  # an older iteration the tracker does not name
    (run / "latest_checkpointed_iteration.txt").write_text("2\n")
    found = ckptkit.detect(str(run))
    assert found.format == "megatron_dist"
    assert found.evidence[0] == "found latest_checkpointed_iteration.txt naming iter_0000002/"
    assert found.storage.url.rstrip("/").endswith("iter_0000002")
    direct = ckptkit.open(str(_path("megatron_mcore016_gpt_tp2_ws2")))
    via_run = ckptkit.open(str(run))
    assert list(via_run.catalog.entries) == list(direct.catalog.entries)
    key = "model.decoder.layers.1.mlp.linear_fc1.weight"
    assert torch.equal(via_run.read(key), direct.read(key))


def test_run_directory_naming_a_missing_iteration(tmp_path):
    (tmp_path / "iter_0000001").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    found = ckptkit.detect(str(tmp_path))
    assert found.format == "megatron_dist" and "iter_0000007/" in found.evidence[0]
    with pytest.raises(ckptkit.MissingFileError, match="iter_0000007"):
        ckptkit.open(str(tmp_path))


@pytest.mark.parametrize(
    ("tracker", "error", "says"),
    [
        ("abc", ckptkit.FormatError, r"latest_checkpointed_iteration\.txt: holds b'abc', not an"),
        ("20", ckptkit.MissingFileError, r"iter_0000020: missing \(latest_checkpointed_it"),
        ("release", ckptkit.MissingFileError, r"release: missing \(latest_checkpointed_it"),
        ("30", ckptkit.FormatError, r"iter_0000030: holds no Megatron checkpoint \(latest_"),
    ],
)
@pytest.mark.parametrize("layout", ["megatron_dist", "megatron_legacy"])
def test_a_tracker_naming_no_checkpoint_is_an_error_naming_the_iterations(
    tmp_path, layout, tracker, error, says
):
    """Megatron's loader fails on a tracker naming no checkpoint; so does ckptkit, for both
    layouts, never opening another iteration in its stead (the folder of one checkpoint would
    open it, with a note), and it names the iterations that hold one, the newest last."""
    run = tmp_path / "run"
    if layout == "megatron_dist":
        shutil.copytree(_path("megatron_mcore016_gpt_tp2_ws2"), run / "iter_0000010")
    else:
        shutil.copytree(FIXTURES / "megatron_legacy_tp2_ws2" / "run", run)
    (run / "iter_0000030").mkdir()  # an empty folder: a save that left nothing
    (run / "latest_checkpointed_iteration.txt").write_text(tracker)
    assert ckptkit.detect(str(run)).format == layout
    there = r"; iteration folders here: iter_0000010 \(open one: ckptkit inspect "
    with pytest.raises(error, match=f"{says}.*{there}.*iter_0000010\\)$"):
        ckptkit.open(str(run))
    (run / "latest_checkpointed_iteration.txt").write_text("10")
    assert ckptkit.open(str(run)).url.rstrip("/").endswith("iter_0000010")


def test_other_backend_is_recognised_and_refused(tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(_path("megatron_mcore016_gpt_tp2_ws2"), copy)
    config = json.loads((copy / "metadata.json").read_text())
    (copy / "metadata.json").write_text(json.dumps({**config, "sharded_backend": "zarr"}))
    assert ckptkit.detect(str(copy)).format == "megatron_dist"
    with pytest.raises(ckptkit.FormatError, match="'zarr' is recognised but not supported"):
        ckptkit.open(str(copy))


def test_plain_dcp_allowlist_stays_strict(tmp_path):
    """Without metadata.json the directory is plain DCP, whose allowlist has none of the
    Megatron stand-ins: the 0.16 metadata's getattr is refused, naming it."""
    copy = tmp_path / "ckpt"
    shutil.copytree(_path("megatron_mcore016_gpt_tp2_ws2"), copy)
    (copy / "metadata.json").unlink()
    assert ckptkit.detect(str(copy)).format == "dcp"
    with pytest.raises(UnsafePickleError, match="builtins.getattr"):
        ckptkit.open(str(copy))


def test_stored_tensors_equal_megatron_load_plain_tensors(item, ckpt):
    """Every tensor ``load_plain_tensors`` gives, bit for bit, under its stored key; the <= 0.15
    reformulated optimizer tensors, which it returns flattened, as stored (same bytes)."""
    reference = _hashes(item)["reference.pt"]
    assert len(reference) >= 19
    for stored, spec in reference.items():
        key = _ours(ckpt, stored)
        tensor = ckpt.read(key)
        assert str(tensor.dtype).removeprefix("torch.") == spec["dtype"], key
        if list(tensor.shape) != spec["shape"]:  # reformulated: load_plain_tensors flattens
            assert item == "megatron_mcore015_gpt_dp2_ws2" and key.startswith("optimizer."), key
            assert tensor.numel() == int(np.prod(spec["shape"])), key
        assert _sha(tensor) == spec["sha256"], key


def test_reformulated_optimizer_state_in_its_true_shape():
    """<= 0.15 ``fully_sharded_model_space``: stored [X//x, Y//y, Z//z, x·y·z], read in the
    shape ``mcore_data`` gives; the fp32 master copies then equal the model's parameters (an
    fp32 run), and the bytes equal Megatron's own (flattened) ``load_plain_tensors``."""
    item = "megatron_mcore015_gpt_dp2_ws2"
    ckpt = ckptkit.open(str(_path(item)))
    reference = _hashes(item)["reference.pt"]
    checked = 0
    for stored in (k for k in reference if k.startswith("optimizer.state.fp32_param.")):
        entry = ckpt.catalog.entries[stored]
        assert all(c.flat for c in entry.chunks), stored
        name = stored.removeprefix("optimizer.state.fp32_param.")
        param = _ours(ckpt, name)
        assert entry.shape == ckpt.catalog.entries[param].shape, stored
        assert torch.equal(ckpt.read(stored), ckpt.read(param)), stored
        checked += 1
    stacked_shape = ckpt.catalog.entries[
        "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc2.weight"
    ]
    assert stacked_shape.shape == (2, 32, 64)
    assert checked == 16


def test_per_layer_views_are_slices_of_the_stored_tensors(ckpt):
    stacked = [e for e in ckpt.catalog.entries.values() if e.group == "stacked"]
    assert stacked
    for entry in stacked:
        whole = ckpt.read(entry.key)
        stored = entry.key.removeprefix("stacked.")
        for layer in range(entry.shape[0]):
            name = stored.replace("layers.", f"layers.{layer}.", 1)
            view_key = name if name.startswith("optimizer.") else f"model.{name}"
            view = ckpt.catalog.entries[view_key]
            assert all(c.record is None or c.record.encoding == "raw" for c in view.chunks)
            assert torch.equal(ckpt.read(view_key), whole[layer]), (view_key, layer)


def test_per_layer_keys_equal_megatron_tp1_reload(item, ckpt):
    """Megatron's own reload into a TP=1 model; names correspond except the layer norms,
    which TransformerEngine-style specs store inside linear_qkv / linear_fc1."""
    matched = 0
    for key, spec in _hashes(item)["model_tp1.pt"].items():
        ours = f"model.{key}"
        if ours not in ckpt.catalog.entries:
            assert "layernorm" in key, key  # input_layernorm / pre_mlp_layernorm
            continue
        tensor = ckpt.read(ours)
        assert [list(tensor.shape), str(tensor.dtype).removeprefix("torch.")] == [
            spec["shape"],
            spec["dtype"],
        ], key
        assert _sha(tensor) == spec["sha256"], key
        matched += 1
    assert matched >= 20  # tied embeddings: no output_layer.weight in the dp2 items


def test_sharded_objects_equal_the_reference(item, ckpt):
    reference = torch.load(
        FIXTURES / item / "reference" / "objects.pt", weights_only=False
    )  # trusted: written by the fixture generator
    assert reference
    for stored, value in reference.items():
        prefix = _ours(ckpt, stored)
        entries = [
            e for k, e in ckpt.catalog.entries.items() if k == prefix or k.startswith(prefix + ".")
        ]
        assert entries, stored
        for entry in entries:
            expected = value
            for part in entry.path[2:]:  # dict keys became strings, as torch flattens them
                if isinstance(expected, dict):
                    part = next(k for k in expected if str(k) == part)
                expected = expected[part]
            if entry.kind == "tensor":
                assert torch.equal(ckpt.read(entry.key), expected), entry.key
            else:
                _assert_same(ckpt.read_object(entry.key), expected, entry.key)


def _assert_same(actual, expected, key):
    if isinstance(expected, np.ndarray):
        assert np.array_equal(actual, expected), key
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), key
        for k in expected:
            _assert_same(actual[k], expected[k], key)
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), key
        for a, e in zip(actual, expected, strict=True):
            _assert_same(a, e, key)
    elif isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), key
    else:
        assert actual == expected, key


def test_common_pt_objects(ckpt):
    assert ckpt.read_object("common.iteration") == 2
    assert ckpt.read_object("common.checkpoint_version") == 3.0
    assert ckpt.catalog.facts.layout == "Megatron-core torch_dist"
    assert ckpt.catalog.facts.world_size == 2
    assert set(ckpt.catalog.facts.metadata_files) == {".metadata", "metadata.json"}


def test_unshard_torch_and_sharded_safetensors(tmp_path):
    item = "megatron_mcore016_gpt_tp2_ws2"
    src = ckptkit.open(str(_path(item)))
    groups = ["model", "optimizer"]
    ckptkit.unshard(src, str(tmp_path / "st"), to="safetensors", groups=groups,
                    max_shard_size="16KB", progress=False)  # fmt: skip
    shards = sorted(p.name for p in (tmp_path / "st").glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "st" / "model.safetensors.index.json").exists()
    back = ckptkit.open(str(tmp_path / "st"))
    wanted = [e.key for e in src.catalog.select(groups=groups) if e.kind == "tensor"]
    assert sorted(e.key for e in back.catalog.tensors()) == sorted(wanted)
    for key in wanted:
        assert torch.equal(back.read(key), src.read(key)), key
    ckptkit.unshard(src, str(tmp_path / "pt"), to="torch", groups="model", progress=False)
    model = torch.load(tmp_path / "pt" / "model.pt", weights_only=False)
    tp1 = _hashes(item)["model_tp1.pt"]
    common = [k for k in tp1 if k in model]
    assert len(common) >= 20
    assert all(_sha(model[k]) == tp1[k]["sha256"] for k in common)


def test_stacked_view_is_left_out_unless_asked_for(tmp_path):
    """``stacked`` re-exposes the per-layer bytes: a default unshard writes each layer weight
    once (per layer), diff compares it once; naming the group still writes it as stored."""
    src = ckptkit.open(str(_path("megatron_mcore016_gpt_tp2_ws2")))
    assert src.catalog.facts.alternate_groups == ("stacked",)
    stacked = [e for e in src.catalog.tensors() if e.group == "stacked"]
    assert stacked
    result = ckptkit.unshard(src, str(tmp_path / "all"), progress=False)
    written = {p.name for p in (tmp_path / "all").iterdir()}
    assert "stacked.pt" not in written and "model.pt" in written, written
    per_layer = torch.load(tmp_path / "all" / "model.pt", weights_only=False)
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in per_layer
    assert not any(key.startswith("stacked.") for key in result.dropped)
    assert not ckptkit.diff(src, src)["key"].str.startswith("stacked.").any()
    ckptkit.unshard(src, str(tmp_path / "stacked"), groups="stacked", progress=False)
    as_stored = torch.load(tmp_path / "stacked" / "stacked.pt", weights_only=True)
    assert sorted(as_stored) == sorted(e.key.removeprefix("stacked.") for e in stacked)
    entry = stacked[0]
    assert torch.equal(as_stored[entry.key.removeprefix("stacked.")], src.read(entry.key))


def test_diff_and_verify_clean(ckpt):
    frame = ckptkit.diff(ckpt, ckpt)
    assert (frame["status"] == "equal").all()
    assert ckptkit.verify(ckpt).empty


def test_integrity_json_is_checked(tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(_path("megatron_mcore016_gpt_tp2_ws2"), copy)
    digests = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(copy.iterdir())
        if p.is_file()
    }
    (copy / "integrity.json").write_text(json.dumps(digests))
    assert ckptkit.verify(str(copy)).empty
    data = bytearray((copy / "common.pt").read_bytes())
    data[50] ^= 0xFF  # alignment padding after the first local header: no CRC covers it
    (copy / "common.pt").write_bytes(bytes(data))
    problems = ckptkit.verify(str(copy))
    flagged = problems[(problems["file"] == "common.pt") & (problems["problem"] == "checksum")]
    assert len(flagged) == 1 and "integrity.json" in flagged["detail"].iloc[0]


def test_damaged_stacked_record_still_opens_and_verify_names_it(tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(_path("megatron_mcore016_gpt_tp2_ws2"), copy)
    stored = "decoder.layers.mlp.linear_fc1.weight"
    entry = ckptkit.open(str(copy)).catalog.entries[f"stacked.{stored}"]
    record = entry.chunks[0].record
    data = bytearray((copy / record.file).read_bytes())
    end = record.offset + record.length
    at = data.rfind(b"PK\x05\x06", record.offset, end)  # the record's end-of-directory
    assert at > 0
    data[at : at + 4] = b"XXXX"
    (copy / record.file).write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="no per-layer views"):
        ckpt = ckptkit.open(str(copy))
    entries = ckpt.catalog.entries
    assert f"stacked.{stored}" in entries and f"model.{stored}" not in entries
    assert "model.decoder.layers.0.mlp.linear_fc1.weight" not in entries
    assert "model.decoder.layers.0.mlp.linear_fc2.weight" in entries  # the rest is intact
    problems = ckptkit.verify(ckpt)
    assert set(problems["key"]) == {f"stacked.{stored}"}
    assert (problems["file"] == record.file).all()


def test_cli_inspect():
    result = subprocess.run(
        [sys.executable, "-m", "ckptkit.cli", "inspect", str(_path(MEGATRON_ITEMS[0])), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["format"] == "megatron_dist"
    keys = {t["key"] for t in doc["tensors"]}
    assert "model.decoder.layers.0.self_attention.linear_qkv.weight" in keys
    assert "stacked.decoder.layers.self_attention.linear_qkv.weight" in keys


def test_cli_verify_diff_unshard(tmp_path):
    path = str(_path("megatron_mcore015_gpt_dp2_ws2"))

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "ckptkit.cli", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    verified = cli("verify", path)
    assert verified.returncode == 0 and "no problems found" in verified.stdout
    diffed = cli("diff", path, path, "--quiet")
    compared = len(ckptkit.open(path).catalog.select())  # every key but the stacked view
    assert diffed.returncode == 0 and f"{compared} equal" in diffed.stdout, diffed.stdout
    out = tmp_path / "out"
    done = cli("unshard", path, str(out), "--groups", "model", "--quiet")
    assert done.returncode == 0, done.stderr
    model = torch.load(out / "model.pt", weights_only=False)
    tp1 = _hashes("megatron_mcore015_gpt_dp2_ws2")["model_tp1.pt"]
    assert {k for k in tp1 if "layernorm" not in k or k in model} <= set(model)
    assert all(_sha(model[k]) == tp1[k]["sha256"] for k in tp1 if k in model)


def test_inspection_without_torch_reads_the_same_bytes():
    item = "megatron_mcore015_gpt_tp2_ws2"
    (report,) = inspect_without_torch(_path(item))
    assert report["tensors"]
    reference = _hashes(item)["reference.pt"]
    ckpt = ckptkit.open(str(_path(item)))
    for stored, spec in reference.items():
        assert report["tensors"][_ours(ckpt, stored)] == spec["sha256"], stored


@pytest.mark.parametrize(
    ("target", "attribute", "refused"),
    [
        # getattr(__import__('os'), 'system'): the import is refused by name
        (b"\x8c\x08builtins\x8c\x0a__import__\x93\x8c\x02os\x94\x85R", b"system", "__import__"),
        # getattr(<allowed enum stand-in>, '__globals__'): refused by the getattr stand-in
        (b"h\x00\x8c\x14_MEM_FORMAT_ENCODING\x94\x93", b"__globals__", "builtins.getattr"),
    ],
)
def test_hostile_getattr_in_metadata_is_refused(tmp_path, monkeypatch, target, attribute, refused):
    copy = tmp_path / "ckpt"
    shutil.copytree(_path("megatron_mcore016_gpt_tp2_ws2"), copy)
    data = unframed((copy / ".metadata").read_bytes())
    # the same number of MEMOIZE opcodes as the original, so later memo references still hold
    original = b"h\x00\x8c\x14_MEM_FORMAT_ENCODING\x94\x93\x94\x8c\x17TORCH_CONTIGUOUS_FORMAT\x94"
    assert original in data
    hostile = target + b"\x94\x8c" + bytes([len(attribute)]) + attribute + b"\x94"
    (copy / ".metadata").write_bytes(data.replace(original, hostile, 1))
    calls = []
    monkeypatch.setattr("os.system", lambda *a: calls.append(a))
    with pytest.raises(UnsafePickleError) as info:
        ckptkit.open(str(copy))
    assert refused in str(info.value)
    assert calls == []
