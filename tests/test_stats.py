"""ckptkit.stats / fingerprint and ``ckptkit stats`` on checkpoints torch wrote; torch computes
the expected numbers on the fully loaded tensors.

Tolerances: min, max, abs_max (but of complex magnitudes: 1e-15 relative), numel and the zero / NaN / Inf fractions are exact; mean and l2
within 1e-12 relative (float64 sums in a different order than torch's), std within 1e-9
relative (its cancellation-free merge against torch's two-pass float64).
"""

from __future__ import annotations

import importlib
import io
import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemWriter

import ckptkit
from ckptkit import tunables
from ckptkit.cli import main
from ckptkit.reading import Reader

from oracle import lookup, raw_bytes, torch_keys

STATS = importlib.import_module(
    "ckptkit.ops.stats"
)  # the module (``ckptkit.stats`` is the function)

# the fixtures ws2 (fsdp2_ws2) and unsharded (its ckptkit unshards) are in conftest.py


def expected_stats(tensor: torch.Tensor) -> dict[str, float]:
    """What the statistics must be, computed by torch in float64 on the whole tensor."""
    values = tensor.to(torch.complex128).abs() if tensor.is_complex() else tensor
    values = values.to(torch.float64).flatten()
    n = values.numel()
    finite = values[torch.isfinite(values)]
    some = finite.numel() > 0
    return {
        "numel": n,
        "min": finite.min().item() if some else math.nan,
        "max": finite.max().item() if some else math.nan,
        "mean": finite.mean().item() if some else math.nan,
        "std": finite.std().item() if finite.numel() > 1 else math.nan,
        "l2": torch.linalg.vector_norm(finite).item(),
        "abs_max": finite.abs().max().item() if some else math.nan,
        "frac_zero": (values == 0).sum().item() / n if n else 0.0,
        "frac_nan": values.isnan().sum().item() / n if n else 0.0,
        "frac_inf": values.isinf().sum().item() / n if n else 0.0,
    }


def assert_stats_match(row: pd.Series, tensor: torch.Tensor, key: str) -> None:
    want = expected_stats(tensor)
    assert row["numel"] == want["numel"], key
    assert row["dtype"] == str(tensor.dtype).removeprefix("torch."), key
    assert row["shape"] == tuple(tensor.shape), key
    exact = ("min", "max", "abs_max") if not tensor.is_complex() else ()  # |z|: hypot's last ulp
    for column in (*exact, "frac_zero", "frac_nan", "frac_inf"):
        assert row[column] == want[column] or (math.isnan(row[column]) and math.isnan(want[column])), (key, column)  # fmt: skip
    for column in ("min", "max", "abs_max") if tensor.is_complex() else ():
        assert row[column] == pytest.approx(want[column], rel=1e-15), (key, column)
    for column, rel in (("mean", 1e-12), ("l2", 1e-12), ("std", 1e-9)):
        if math.isnan(want[column]):
            assert math.isnan(row[column]), (key, column)
        else:
            assert row[column] == pytest.approx(want[column], rel=rel, abs=1e-300), (key, column)


def test_stats_equal_torch_on_every_tensor_of_a_training_checkpoint(ws2):
    reference = ws2.reference()
    ckpt = ckptkit.open(str(ws2.path))
    frame = ckptkit.stats(ckpt)
    assert frame.columns.tolist() == STATS.COLUMNS
    assert frame["key"].tolist() == [e.key for e in ckpt.catalog.tensors()]
    assert sorted(frame["key"]) == sorted(torch_keys(ws2.path, tensors_only=True))
    for _, row in frame.iterrows():
        assert_stats_match(row, lookup(reference, ckpt.entry(row["key"]).path), row["key"])
    assert frame["group"].tolist() == [key.split(".")[0] for key in frame["key"]]
    assert frame.attrs["format"] == "dcp" and frame.attrs["url"] == str(ws2.path)
    assert frame.attrs["fingerprint"] == ckptkit.fingerprint(str(ws2.path))


def special_state() -> dict[str, dict[str, torch.Tensor]]:
    """Tensors with what statistics get wrong: NaN/±Inf, zeros and -0.0, a large offset with a
    tiny spread (and a moderate one), bf16/fp8/fp16/int/bool/complex, empty and 0-d, and more
    elements than one block (:data:`ckptkit.diff.BLOCK_ELEMENTS`) and one sub-block."""
    gen = torch.Generator().manual_seed(7)
    big = 1000.0 + 1e-3 * torch.randn(1_200_000, generator=gen, dtype=torch.float64)
    holes = torch.randn(300_000, generator=gen)
    holes[[5, 70_000, 299_999]] = torch.tensor([math.nan, math.inf, -math.inf])
    holes[1000:1100] = 0.0
    holes[2000] = -0.0
    model = {
        "offset": big.to(torch.float32),
        "offset64": big.reshape(1200, 1000),
        # a spread of 1e-2 around 1 (LayerNorm weights): Σx² − n·mean² cancels ~13 bits
        "near_one": 1.0 + 1e-2 * torch.randn(300_000, generator=gen),
        "near_ten64": 10.0 + 0.1 * torch.randn(300_000, generator=gen, dtype=torch.float64),
        "holes": holes.reshape(3, 100_000),
        "all_nan": torch.full((4,), math.nan),
        "bf16": (3 * torch.randn(200_001, generator=gen)).to(torch.bfloat16),
        "fp8": torch.randn(40, 50, generator=gen).to(torch.float8_e4m3fn),
        "fp8_e5m2": (1e3 * torch.randn(999, generator=gen)).to(torch.float8_e5m2),
        "fp16": torch.tensor([65504.0, -65504.0, 0.0, 1e-7, math.inf], dtype=torch.float16),
        "int64": torch.arange(-50, 50, dtype=torch.int64).reshape(10, 10),
        "uint8": torch.arange(256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True, True]),
        "complex": torch.randn(7, 3, generator=gen, dtype=torch.complex64),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }
    return {"model": model}


@pytest.fixture(scope="module")
def special(tmp_path_factory):
    """special_state saved three ways: dcp.save (one process), torch.save, safetensors."""
    root = tmp_path_factory.mktemp("special")
    state = special_state()
    with pytest.warns(UserWarning):  # torch: "no process group: saving without one"
        dcp.save(state, storage_writer=FileSystemWriter(root / "dcp"))
    (root / "pt").mkdir()
    torch.save(state["model"], root / "pt" / "model.pt")
    (root / "st").mkdir()
    save_file(dict(state["model"]), root / "st" / "model.safetensors")
    return root, state


def test_stats_equal_torch_on_special_values_in_every_format(special):
    root, state = special
    frames = {
        where: ckptkit.stats(str(root / where)).set_index("key") for where in ("dcp", "pt", "st")
    }
    for name, tensor in state["model"].items():
        for where, frame in frames.items():
            assert_stats_match(frame.loc[f"model.{name}"], tensor, f"{where}: {name}")
    rows = frames["dcp"]
    assert rows.loc["model.holes", "frac_nan"] == 1 / 300_000
    assert rows.loc["model.holes", "frac_inf"] == 2 / 300_000
    assert rows.loc["model.holes", "frac_zero"] == 101 / 300_000  # -0.0 is a zero
    assert rows.loc["model.offset64", "std"] == pytest.approx(1e-3, rel=0.01)
    fingerprints = {where: frame["fingerprint"].to_dict() for where, frame in frames.items()}
    assert fingerprints["dcp"] == fingerprints["pt"] == fingerprints["st"]
    assert len(set(fingerprints["dcp"].values())) == len(state["model"])


def test_fingerprint_is_sha256_of_dtype_shape_and_canonical_bytes(special):
    root, state = special
    frame = ckptkit.stats(str(root / "st")).set_index("key")
    for name, tensor in state["model"].items():
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        shape = ",".join(str(n) for n in tensor.shape)
        header = f"\0{str(tensor.dtype).removeprefix('torch.')}\0[{shape}]\0".encode()
        digest = STATS.hashlib.sha256(STATS.TENSOR_DOMAIN + header + raw).hexdigest()
        assert frame.loc[f"model.{name}", "fingerprint"] == digest, name


def test_fingerprints_equal_across_formats_and_world_sizes(ws2, unsharded, ws4_resave):
    model = ckptkit.fingerprint(str(ws2.path), groups="model")
    assert ckptkit.fingerprint(str(ws4_resave)) == model  # DCP, 4 ranks, column shards
    assert ckptkit.fingerprint(str(unsharded / "st"), groups="model") == model
    assert ckptkit.fingerprint(str(unsharded / "pt"), groups="model") == model
    whole = ckptkit.fingerprint(str(ws2.path))  # model and optimizer state, objects aside
    assert whole != model
    assert ckptkit.fingerprint(str(unsharded / "st")) == whole
    assert ckptkit.fingerprint(str(unsharded / "pt")) == whole
    per_tensor = ckptkit.stats(str(ws4_resave)).set_index("key")["fingerprint"]
    ours = ckptkit.stats(str(ws2.path), groups="model").set_index("key")["fingerprint"]
    assert per_tensor.sort_index().equals(ours.sort_index())


def test_one_changed_element_changes_the_fingerprint(unsharded, tmp_path):
    shutil.copytree(unsharded / "st", tmp_path / "st")
    path = tmp_path / "st" / "model.safetensors"
    tensors = load_file(path)
    before = ckptkit.stats(str(tmp_path / "st"), groups="model").set_index("key")
    key = "blocks.1.fc1.weight"
    changed = tensors[key].clone()
    changed[3, 7] = torch.nextafter(changed[3, 7], torch.tensor(math.inf))  # one ulp
    tensors[key] = changed
    save_file(tensors, path)
    after = ckptkit.stats(str(tmp_path / "st"), groups="model").set_index("key")
    assert sorted(before.index) == sorted(after.index)
    after = after.reindex(before.index)
    moved = before.index[before["fingerprint"] != after["fingerprint"]].tolist()
    assert moved == [f"model.{key}"]
    assert before.attrs["fingerprint"] != after.attrs["fingerprint"]
    # the same bytes under another shape are another tensor
    tensors[key] = changed.reshape(-1)
    save_file(tensors, path)
    assert ckptkit.stats(str(tmp_path / "st"), keys=f"model.{key}")["fingerprint"].iloc[0] not in (
        before.loc[f"model.{key}", "fingerprint"],
        after.loc[f"model.{key}", "fingerprint"],
    )


def test_one_pass_reads_every_record_once(ws2, monkeypatch):
    reads: list[tuple[str, int, int]] = []
    original = Reader.read_ranges

    def counting(self, ranges, key):
        reads.extend(ranges)
        return original(self, ranges, key)

    monkeypatch.setattr(Reader, "read_ranges", counting)
    ckpt = ckptkit.open(str(ws2.path))
    ckptkit.stats(ckpt)
    records = {
        (c.record.file, c.record.offset, c.record.offset + c.record.length)
        for e in ckpt.catalog.tensors()
        for c in e.chunks
    }
    assert len(reads) == len(set(reads)) == len(records)
    assert set(reads) == records


def test_memory_stays_bounded_for_a_large_tensor(special):
    root, _ = special
    import tracemalloc

    source = ckptkit.open(str(root / "st"))
    entry = source.entry("model.offset64")  # 9.6 MB of float64
    tracemalloc.start()
    try:
        STATS.tensor_rows(source, [entry])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # a block of 2**20 float64 elements (8 MiB) and sub-block buffers; never the float64 copy
    # of more than a sub-block (the tensor itself is memory-mapped, not allocated)
    assert peak < 12 * 2**20


def test_two_lanes_and_one_lane_give_the_same_rows(ws2, monkeypatch):
    """Two tensors stream at once when the reader's buffers for both fit the memory goal; the
    rows are the same either way (each tensor's blocks are folded in the same order), also
    with small blocks handed to the helper thread while the next ones are read."""
    ckpt = ckptkit.open(str(ws2.path))
    entries = STATS.select_tensors(ckpt, None, None)
    monkeypatch.setattr(tunables, "BLOCK_ELEMENTS", 1000)
    monkeypatch.setattr(STATS._Lane, "INLINE", 0)  # every tensor through the helper thread
    assert STATS._two_lanes_fit(entries)
    two = ckptkit.stats(ckpt)
    monkeypatch.setattr(STATS, "LANE_SLACK", -(1 << 62))
    assert not STATS._two_lanes_fit(entries)
    one = ckptkit.stats(ckpt)
    pd.testing.assert_frame_equal(one, two)
    reference = ws2.reference()
    for _, row in one.iterrows():
        assert_stats_match(row, lookup(reference, ckpt.entry(row["key"]).path), row["key"])
    assert one.attrs["fingerprint"] == ckptkit.fingerprint(ckpt)


def test_two_lanes_only_when_both_tensors_fit_the_memory_goal(ws2, tmp_path, monkeypatch):
    """What the reader holds per tensor (its largest batch of records) decides whether two
    tensors may stream at once: their sum must stay within the largest tensor + LANE_SLACK."""
    (tmp_path / "st").mkdir()
    save_file(
        {"a": torch.zeros(1 << 18), "b": torch.ones(1 << 18)}, tmp_path / "st" / "m.safetensors"
    )
    pair = STATS.select_tensors(ckptkit.open(str(tmp_path / "st")), None, None)
    assert [STATS._held_bytes(e) for e in pair] == [1 << 20, 1 << 20]  # the tensor's bytes
    monkeypatch.setattr(STATS, "LANE_SLACK", (1 << 20) - 1)
    assert not STATS._two_lanes_fit(pair)
    monkeypatch.setattr(STATS, "LANE_SLACK", 1 << 20)
    assert STATS._two_lanes_fit(pair)
    # a DCP tensor saved by two ranks: both torch.save records in one batch, or one each
    entry = ckptkit.open(str(ws2.path)).entry("model.blocks.0.fc1.weight")
    lengths = sorted(c.record.length for c in entry.chunks)
    assert len(lengths) == 2 and STATS._held_bytes(entry) == sum(lengths) > entry.nbytes
    monkeypatch.setattr(tunables, "BATCH_BYTES", lengths[1])
    assert STATS._held_bytes(entry) == lengths[1]


def test_a_corrupt_record_raises_a_typed_error_naming_the_tensor(special, tmp_path):
    """A flipped byte in one tensor's storage fails its CRC-32 check, whichever lane reads it;
    with ``verify_crc=False`` it only changes that tensor's fingerprint."""
    root, _ = special
    shutil.copytree(root / "dcp", tmp_path / "dcp")
    chunk = ckptkit.open(str(tmp_path / "dcp")).entry("model.offset").chunks[0]
    path = tmp_path / "dcp" / chunk.record.file
    data = bytearray(path.read_bytes())
    data[chunk.record.offset + chunk.record.length // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(ckptkit.ChecksumError, match=r"model\.offset"):
        ckptkit.stats(str(tmp_path / "dcp"))
    good = ckptkit.stats(str(root / "dcp")).set_index("key")["fingerprint"]
    bad = ckptkit.stats(ckptkit.open(str(tmp_path / "dcp"), verify_crc=False))
    bad = bad.set_index("key")["fingerprint"]
    assert good[good != bad].index.tolist() == ["model.offset"]


def test_selection_and_errors(ws2):
    frame = ckptkit.stats(str(ws2.path), keys="model.blocks.0.*", fingerprints=False)
    assert frame["key"].str.startswith("model.blocks.0.").all() and len(frame) == 12
    assert frame["fingerprint"].isna().all() and "fingerprint" not in frame.attrs
    assert set(ckptkit.stats(str(ws2.path), groups=["optim"])["group"]) == {"optim"}
    with pytest.raises(ckptkit.KeyNotFoundError, match="no tensor matches"):
        ckptkit.stats(str(ws2.path), keys="model.nope*")


# -- CLI ------------------------------------------------------------------------------------


def test_cli_json_csv_and_text(special, capsys):
    root, state = special
    path = str(root / "dcp")
    assert main(["stats", path, "--json", "--fingerprint"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["format"] == "dcp"
    assert document["fingerprint"] == ckptkit.fingerprint(path)
    rows = {row["key"]: row for row in document["tensors"]}
    assert rows["model.all_nan"]["min"] is None and rows["model.all_nan"]["frac_nan"] == 1.0
    assert rows["model.holes"]["shape"] == [3, 100_000]

    assert main(["stats", path, "--csv", "--groups", "model"]) == 0
    table = pd.read_csv(io.StringIO(capsys.readouterr().out))
    assert len(table) == len(state["model"]) and "fingerprint" not in table
    holes = table.set_index("key").loc["model.holes"]
    assert holes["frac_inf"] == 2 / 300_000

    assert main(["stats", path, "--quiet", "--fingerprint"]) == 0
    text = capsys.readouterr().out
    assert "model.offset64" in text and f"fingerprint: {document['fingerprint']}" in text
    assert "tensor(s) hold NaN or Inf: model.holes, model.all_nan" in text

    assert main(["stats", path, "--keys", "nothing*"]) == 2
    assert "no tensor matches" in capsys.readouterr().err


# -- checked-in fixtures: every format, written by other projects ------------------------------

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE_CHECKPOINTS = sorted(
    path
    for item in FIXTURES.iterdir()
    if (item / "reference").is_dir()
    for path in [item / "checkpoint", *item.glob("step3*")]
    if path.is_dir()
)


@pytest.mark.parametrize("path", FIXTURE_CHECKPOINTS, ids=lambda p: p.parent.name)
def test_fingerprints_hash_what_reads_return_in_every_fixture_format(path):
    ckpt = ckptkit.open(str(path))
    frame = ckptkit.stats(ckpt).set_index("key")
    # every tensor but alternate views of bytes other keys hold (Megatron's stacked layers)
    tensors = [e for e in ckpt.catalog.select() if e.kind == "tensor"]
    assert len(frame) == len(tensors) > 0
    for key, row in frame.iterrows():
        tensor = ckpt.read(key)
        header = f"\0{row['dtype']}\0[{','.join(str(n) for n in row['shape'])}]\0".encode()
        digest = STATS.hashlib.sha256(STATS.TENSOR_DOMAIN + header + raw_bytes(tensor))
        assert row["fingerprint"] == digest.hexdigest(), key
        assert row["numel"] == tensor.numel(), key


def test_same_training_state_saved_by_different_checkpointers_has_one_fingerprint():
    """OLMo saved the same step of one job with several checkpointers (fixtures README)."""
    legacy = FIXTURES / "olmo_torch_legacy_ws2" / "step3"  # rank{N}.pt ShardedTensors
    new = FIXTURES / "olmo_torch_new_ws2" / "step3"  # DCP under model_and_optim/
    for group in ("model", "optim"):
        assert ckptkit.fingerprint(str(legacy), groups=group) == ckptkit.fingerprint(
            str(new), groups=group
        )
    local = FIXTURES / "olmo_local_ws2" / "step3"  # FSDP1 flat-parameter shards
    core = FIXTURES / "olmo_core_v010_ws2" / "step3"  # rank_N.safetensors, flat offsets
    unsharded = FIXTURES / "olmo_unsharded" / "step3-unsharded-safetensors"  # OLMo's unshard
    model = ckptkit.fingerprint(str(local), groups="model")
    assert ckptkit.fingerprint(str(core), groups="model") == model
    assert ckptkit.fingerprint(str(unsharded), groups="model") == model
    assert ckptkit.fingerprint(str(new), groups="model") != model  # another job
