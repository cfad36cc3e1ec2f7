"""The notebooks as tutorials on real checkpoints, and the facts about the sample they show.

Each notebook is executed once per kind of checkpoint. On the sample (its default) nbval runs
it in ``make test`` (``pytest tests notebooks --nbval-lax``, see notebooks/conftest.py); here
papermill runs it, in a fresh kernel from an unrelated working directory, on other real
checkpoints (``KINDS``): a DCP written by torch in this session (DTensors sharded along
columns, no optimizer) and, from tests/fixtures, OLMo, OLMo-core, DeepSpeed and Megatron
checkpoints (notebook 09 on their run folders). Each run must complete, its outputs must name
the checkpoint's own keys and format, never the sample's keys or sentences about the sample.
What the notebooks show about the sample is asserted below directly in Python, on the same
sample (``test_sample_*``).
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.examples import sample_checkpoint, sample_workspace, write_run
from ckptkit.views import plots

NOTEBOOKS = Path(__file__).parent.parent / "notebooks"
FIXTURES = Path(__file__).parent / "fixtures"
OLMO = FIXTURES / "olmo_torch_new_ws2" / "step3"
OLMO_LEGACY = FIXTURES / "olmo_torch_legacy_ws2" / "step3"
#: Keys only the sample has: a run on another checkpoint must not mention them.
SAMPLE_ONLY = ("model.odd", "adapter.up", "blocks.1.fc1")


@pytest.fixture(scope="session")
def samples() -> Iterator[Path]:
    """One sample workspace for the session (shared with the nbval run of notebooks/ when both
    run together), removed at the end; notebook kernels inherit it."""
    with sample_workspace() as workspace:
        yield workspace


@pytest.fixture(scope="session")
def sample(samples) -> Path:
    return sample_checkpoint()


def run(name: str, cwd: Path, **parameters) -> str:
    """Execute notebook ``name`` with papermill parameters; the text of all its outputs."""
    import papermill

    out = cwd / f"{name}.out.ipynb"
    papermill.execute_notebook(
        str(NOTEBOOKS / f"{name}.ipynb"),
        str(out),
        parameters={k: str(v) if isinstance(v, Path) else v for k, v in parameters.items()},
        kernel_name="python3",
        cwd=str(cwd),
        progress_bar=False,
        execution_timeout=600,
    )
    texts = []
    for cell in json.loads(out.read_text())["cells"]:
        for output in cell.get("outputs", []):
            texts.append("".join(output.get("text", "")))
            texts.append("".join(output.get("data", {}).get("text/plain", "")))
    return "\n".join(texts)


def largest(ckpt: ckptkit.Checkpoint, *, by_chunks: bool = False) -> str:
    """The key a notebook picks: the largest tensor (stored in the most pieces, if asked)."""
    if by_chunks:
        return ckpt.tensors.sort_values(["n_chunks", "nbytes"], ascending=False)["key"].iloc[0]
    return ckpt.tensors.nlargest(1, "nbytes")["key"].iloc[0]


# -- every notebook on real checkpoints ---------------------------------------------------------

#: Checked-in checkpoints of each kind the notebooks run on besides the sample and the DCP torch
#: writes in the session: OLMo (torch_new), OLMo-core's own DCP (its `model_and_optim` folder,
#: whose .metadata torch cannot read without olmo_core), DeepSpeed ZeRO-2 and Megatron-core.
FIXTURE_KINDS = {
    "olmo": OLMO,
    "olmo_core": FIXTURES / "olmo_core3_trainer_ws2" / "step3" / "model_and_optim",
    "deepspeed": FIXTURES / "deepspeed_zero2_ws2" / "checkpoint",
    "megatron": FIXTURES / "megatron_mcore016_gpt_tp2_ws2" / "checkpoint",
}
KINDS = ("dcp", *FIXTURE_KINDS)
#: Words only a run on the sample may print (the notebooks explain the sample's quirks).
SAMPLE_ONLY_TEXT = ("the sample", "TinyLM")
NEGATIVE_NUMBER = re.compile(r"(?<![\w.])-\d")


@pytest.fixture(scope="session")
def column_sharded(written) -> Path:
    """A DCP written by torch's own dcp.save from 2 ranks: DTensors sharded along columns."""
    return written("column_sharded").path


# No "sample" target: nbval runs every notebook on the sample in `make test`, and the
# test_sample_* tests below assert what those runs show. (`samples`: kernels inherit the
# session's workspace, so their scratch directories are removed with it.)
@pytest.fixture(params=KINDS)
def target(request, samples) -> tuple[str, Path]:
    """(label, checkpoint path) of a checkpoint other than the sample."""
    if request.param == "dcp":
        return "dcp", request.getfixturevalue("column_sharded")
    return request.param, FIXTURE_KINDS[request.param]


def _check_outputs(
    text: str, label: str, expected: str, ckpt: ckptkit.Checkpoint, *, shows_format: bool = True
) -> None:
    """The outputs name ``expected`` (and the format of ``ckpt``, the checkpoint the notebook
    ran on), neither keys only the sample has nor sentences about the sample."""
    assert expected in text, f"{label}: {expected!r} is not in the notebook's outputs"
    if shows_format:
        assert ckpt.format in text, f"{label}: its format {ckpt.format!r} is not in the outputs"
    own = set(ckpt.keys())
    sample_keys = [k for k in SAMPLE_ONLY if k in text and not any(k in key for key in own)]
    assert not sample_keys, f"{label}: the outputs mention the sample's keys {sample_keys}"
    said = [words for words in SAMPLE_ONLY_TEXT if words.lower() in text.lower()]
    assert not said, f"{label}: the outputs speak of the sample ({said})"


def _cell_output(cwd: Path, name: str, source_start: str) -> str:
    """The text of the outputs of the one cell of the executed notebook ``name`` (in ``cwd``,
    as :func:`run` leaves it) whose source starts with ``source_start``."""
    cells = json.loads((cwd / f"{name}.out.ipynb").read_text())["cells"]
    found = [c for c in cells if "".join(c["source"]).startswith(source_start)]
    assert len(found) == 1, (name, source_start, len(found))
    return "\n".join(
        "".join(output.get("text", "")) + "".join(output.get("data", {}).get("text/plain", ""))
        for output in found[0]["outputs"]
    )


def _open(path: Path) -> ckptkit.Checkpoint:
    return ckptkit.open(str(path))


def test_01_inspect(target, tmp_path):
    label, path = target
    # storage_options as `-p storage_options '{}'` passes it: text
    text = run("01_inspect", tmp_path, checkpoint=path, storage_options="{}")
    ckpt = _open(path)
    _check_outputs(text, label, largest(ckpt, by_chunks=True), ckpt)
    assert f"{ckpt.format} checkpoint" in text  # inspect_text's first line
    # the bytes on disk by rank, drawn as stacked bars: tensors, objects, framing, none negative
    on_disk = _cell_output(tmp_path, "01_inspect", "fig, (left, right)")
    assert "framing (zip + pickle)" in on_disk and not NEGATIVE_NUMBER.search(on_disk), on_disk


def test_02_compare_sizes(target, tmp_path):
    label, path = target
    # `others` as `-p others PATH` passes it: one path, not a list
    text = run("02_compare_sizes", tmp_path, checkpoint=path, others=str(path))
    ckpt = _open(path)
    _check_outputs(text, label, "other 1", ckpt)
    stored = int(ckpt.summary().by_group["stored_bytes"].sum())
    assert re.search(rf"\b{stored}\b", text), f"{label}: tensor bytes {stored} not shown"
    assert "equal" in text and "different" not in text  # the copies hold the same values
    overhead = _cell_output(tmp_path, "02_compare_sizes", "overhead = ")
    assert "overhead_share" in overhead and not NEGATIVE_NUMBER.search(overhead), overhead


def test_03_diff_tensors(target, tmp_path):
    label, path = target
    if label == "olmo":  # two checkpoints: the same step saved by two checkpointers
        text = run("03_diff_tensors", tmp_path, checkpoint=OLMO_LEGACY, other=path)
    else:  # the checkpoint against its own copy
        text = run("03_diff_tensors", tmp_path, checkpoint=path)
    ckpt = _open(path)
    real = set(ckpt.tensors["key"])
    shown = {key for key in real if key in text}
    assert len(shown) >= min(5, len(real)), f"{label}: outputs name {sorted(shown)}"
    _check_outputs(text, label, sorted(shown)[0], ckpt, shows_format=False)


def test_04_convert_and_unshard(target, tmp_path):
    label, path = target
    text = run("04_convert_and_unshard", tmp_path, checkpoint=path)
    ckpt = _open(path)
    _check_outputs(text, label, f"<Checkpoint {ckpt.format} ", ckpt)
    groups = list(ckpt.tensors["group"].unique())
    group = "model" if "model" in groups else groups[0]
    n = int((ckpt.tensors["group"] == group).sum())
    assert f"{group}.pt: {n} tensors, {n} equal to ckpt.read" in text
    assert f"{n} of {n} tensors come back equal through DCP" in text
    # torch's own converter: compared on a plain DCP it reads, said why not on one it cannot read
    if label == "dcp":
        same = re.search(rf"(\d+) of (\d+) entries of {group}\.pt equal dcp_to_torch_save's", text)
        assert same and same[1] == same[2], f"{label}: not all equal torch's: {same}"
    elif label == "olmo_core":
        from torch.distributed.checkpoint import CheckpointException
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with pytest.raises(CheckpointException, match="No module named 'olmo_core'"):
            dcp_to_torch_save(str(path), str(tmp_path / "torch.pt"))
        assert "torch's dcp_to_torch_save cannot read this checkpoint" in text
        assert "`olmo_core` is not installed here" in text
    else:
        assert f"a {ckpt.format} checkpoint, not a plain local DCP directory" in text


def test_05_remote_s3(target, tmp_path, s3):
    label, path = target
    text = run("05_remote_s3", tmp_path, checkpoint=path)
    ckpt = _open(path)
    _check_outputs(text, label, largest(ckpt), ckpt)
    files = re.search(r"(\d+) of (\d+) files identical", text)
    assert files and files[1] == files[2], f"{label}: unshard from S3 differs from local"


def test_06_browse(target, tmp_path):
    label, path = target
    text = run("06_browse", tmp_path, checkpoint=path)
    ckpt = _open(path)
    _check_outputs(text, label, largest(ckpt, by_chunks=True), ckpt)
    assert "different" in text and "equal" in text


def test_07_audit(target, tmp_path):
    label, path = target
    text = run("07_audit", tmp_path, checkpoint=path)
    assert "no problems found" in text
    ckpt = _open(path)
    damage = re.search(r"truncated (\S+) to [\d,]+ bytes; flipped a bit of (\S+) in", text)
    assert damage and damage[2] in set(ckpt.tensors["key"]), damage
    truncated = damage[1]
    report = _cell_output(tmp_path, "07_audit", "if damage:\n    problems = ")
    if "opening the damaged copy" in text:  # its metadata sits in the cut file (DeepSpeed)
        assert "corrupt record" in report, report
    else:
        assert truncated in report and "truncated" in report, report
    # reading the copy (or opening it, where it cannot be opened) raises an error naming the file
    error = rf"(TruncatedFileError|CorruptRecordError): [^\n]*{re.escape(truncated)}"
    assert re.search(error, text), f"{label}: no error names {truncated}"
    _check_outputs(text, label, damage[2], ckpt, shows_format=False)


def test_08_layouts(target, tmp_path):
    """The checkpoint and its own unsharded copy (the notebook's own pair, OLMo's legacy and
    torch_new checkpoints, is nbval's run; see test_olmo_layouts_hold_the_same_state)."""
    label, path = target
    second = tmp_path / "unsharded"
    ckptkit.unshard(str(path), str(second), progress=False)
    text = run("08_olmo_layouts", tmp_path, first=path, second=second)
    first = ckptkit.open(str(path))
    common = first.tensors.merge(_open(second).tensors[["key"]], on="key")
    _check_outputs(text, label, largest_common(common), first)
    statuses = re.search(r"status\n((?:\w+\s+\d+\n?)+)", text)
    assert statuses and set(re.findall(r"(\w+)\s+\d+", statuses[1])) == {"equal"}


def largest_common(common) -> str:
    return common.nlargest(1, "nbytes")["key"].iloc[0]


@pytest.fixture(scope="session")
def gapped_run(samples, tmp_path_factory) -> Path:
    """A DCP run folder saved at steps 1 and 4 by torch (TinyLM, FSDP2, 2 ranks): its two
    checkpoints are 3 steps apart, as a run saving every few steps leaves them."""
    return write_run(tmp_path_factory.mktemp("gapped") / "run", steps=[1, 4])


def _run_folder(label: str, path: Path, request, tmp_path: Path) -> Path:
    """The run folder of a kind: where its training job saved its checkpoints."""
    if label == "dcp":
        return request.getfixturevalue("gapped_run")
    if label == "megatron":  # Megatron's layout: iter_NNNNNNN/ and the tracker file
        iteration = ckptkit.open(str(path)).read_object("common.iteration")
        folder = tmp_path / "megatron_run"
        shutil.copytree(path, folder / f"iter_{iteration:07d}")
        (folder / "latest_checkpointed_iteration.txt").write_text(str(iteration))
        return folder
    if label == "deepspeed":  # `latest` naming global_step2/
        return path
    return path.parent if label == "olmo" else path.parent.parent  # holding step3/


def test_09_run_audit(target, tmp_path, request):
    """The run of each kind; update ratios per step when its checkpoints are steps apart."""
    label, path = target
    folder = _run_folder(label, path, request, tmp_path)
    text = run("09_run_audit", tmp_path, run_path=folder)
    audited = ckptkit.run(str(folder))
    steps, last = audited.steps, audited.steps[-1]
    model = ckptkit.fingerprint(audited.location(last), groups="model")
    _check_outputs(text, label, f"model fingerprint at step {last}: {model}", audited.open(last))
    assert f"alert(s) over {len(steps)} steps" in text
    if len(steps) == 1:
        assert "1 step(s): no consecutive pair to compare" in text
        return
    a, b = steps
    assert f"steps between the checkpoints compared: {{'{a}→{b}': {b - a}}}" in text
    per_step = audited.diff(a, b, keys="model.*").set_index("key")["rel_l2"] / (b - a)
    table = _cell_output(tmp_path, "09_run_audit", "ratios, gaps = ")
    shown = dict(re.findall(r"^(model\.\S+)\s+(\S+)$", table, flags=re.MULTILINE))
    shown = {key: float(value) for key, value in shown.items() if key in per_step.index}
    assert len(shown) >= 5, table
    for key, value in shown.items():
        assert value == pytest.approx(per_step[key], rel=1e-3, abs=1e-6), key


def test_notebooks_take_parameters_and_leave_nothing_behind():
    """Each notebook has a papermill `parameters` cell, and removes what it wrote."""
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        tagged = [c for c in cells if "parameters" in c["metadata"].get("tags", [])]
        assert len(tagged) == 1, path.name
        source = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        assert "mkdtemp" not in source and "ckptkit.cli" not in source, path.name
        assert "ckptkit.storage" not in source and "ckptkit.records" not in source, path.name
        if "scratch_directory(" in source:
            assert "shutil.rmtree(workdir" in source, path.name


# -- the sample, as the notebooks describe it -----------------------------------------------


def test_sample_is_written_once_and_reused(samples, sample):
    assert sample.parent.parent == samples and (sample / ".metadata").is_file()
    again = sample_checkpoint()
    assert (
        again == sample
        and (sample / ".metadata").stat().st_mtime_ns == (again / ".metadata").stat().st_mtime_ns
    )
    assert not [p for p in samples.iterdir() if p.name.startswith(".fsdp2-") and p.is_dir()]


def test_concurrent_callers_write_a_sample_once_and_never_see_half_of_one(tmp_path, monkeypatch):
    """Two kernels asking at once: one writes (under the lock), the other waits and reuses it;
    a writer that fails leaves nothing a later call would take for a sample."""
    import threading
    import time

    from ckptkit import examples

    calls = []

    def slow_writer(path, **kwargs):
        calls.append(path)
        path.mkdir()
        (path / "__0_0.distcp").write_bytes(b"x")
        time.sleep(0.5)
        (path / ".metadata").write_bytes(b"y")
        return path

    monkeypatch.setenv(examples.SAMPLES_ENV, str(tmp_path))
    monkeypatch.setattr(examples, "write_sample", slow_writer)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(sample_checkpoint(steps=7)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and results[0] == results[1]
    assert (results[0] / ".metadata").is_file()

    def failing_writer(path, **kwargs):
        path.mkdir()
        (path / "__0_0.distcp").write_bytes(b"half")
        raise RuntimeError("rank died")

    monkeypatch.setattr(examples, "write_sample", failing_writer)
    with pytest.raises(RuntimeError, match="rank died"):
        sample_checkpoint(steps=8)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [results[0].parent.name]


def test_sample_inspect(sample):
    """01: the awkward cases the sample covers, and reads equal the state the job held."""
    ckpt = ckptkit.open(str(sample))
    tensors = ckpt.tensors.set_index("key")
    assert tensors.loc["model.odd", "shape"] == (37, 19)
    assert tensors.loc["model.adapter.down.weight", "dtype"] == "bfloat16"
    assert set(tensors["group"]) == {"model", "optim"}
    odd = ckpt.chunks[ckpt.chunks["key"] == "model.odd"]
    assert odd["sizes"].tolist() == [(19, 19), (18, 19)] and odd["rank"].tolist() == [0, 1]
    assert ckpt.files["size"].sum() == sum(p.stat().st_size for p in sample.glob("*.distcp"))
    assert ckpt.read_object("train.step") == 2 and ckpt.read_object("train.run_name") == "sample"
    summary = ckpt.summary()
    assert summary.parameters == tensors.loc[tensors["group"] == "model", "numel"].sum()
    full = torch.load(sample.parent / "reference.pt", weights_only=True)
    assert torch.equal(ckpt.read("model.odd"), full["model"]["odd"])
    up = ckpt.read("model.adapter.up.weight")
    assert up.dtype == torch.bfloat16 and torch.equal(up, full["model"]["adapter.up.weight"])
    text = ckptkit.inspect_text(ckpt, top=5)
    # the path whole, on the first line or (when long) the next
    head = rf"dcp checkpoint\s+{re.escape(str(sample))}\n  {len(tensors)} tensors, 19 objects"
    assert re.match(head, text)
    assert ".qkv.weight" in text  # the largest tensors: 144 x 48
    # The tensor the notebook picks (most pieces, then largest) is among those it prints.
    key = largest(ckpt, by_chunks=True)
    assert key in text and (ckpt.chunks["key"] == key).sum() == 2
    assert ckptkit.detect(str(sample)).format == ckpt.format == "dcp"


def test_sample_sizes(samples, sample, tmp_path):
    """02: more ranks, more records and framing; unsharded files carry less; weights only."""
    ws4 = sample_checkpoint(world_size=4)
    ckptkit.unshard(str(sample), str(tmp_path / "pt"), progress=False)
    ckptkit.unshard(str(sample), str(tmp_path / "st"), to="safetensors", progress=False)
    ckptkit.convert(str(sample), str(tmp_path / "model"), groups="model", progress=False)
    labels = ["ws2", "ws4", "pt", "st", "model"]
    paths = [sample, ws4, tmp_path / "pt", tmp_path / "st", tmp_path / "model"]
    sizes = ckptkit.compare_sizes(*map(str, paths), labels=labels)
    full = sizes.drop(index="model")
    assert full["tensor_bytes"].nunique() == 1 and full["model"].nunique() == 1
    overhead = sizes["overhead_bytes"] + sizes["metadata_bytes"]
    assert overhead["st"] < overhead["pt"] < overhead["ws2"] < overhead["ws4"]
    assert sizes.loc["ws2", "records"] < sizes.loc["ws4", "records"]
    only = sizes.loc["model"]
    assert only["tensor_bytes"] == only["model"] == sizes.loc["ws2", "model"]
    assert only["optim"] == only["train"] == 0
    text = ckptkit.sizes_text(sizes)
    assert "ws4" in text and "x" in text
    # The notebook's table shows the sample's tensor bytes; its safetensors copy is all equal.
    total = int(ckptkit.open(str(sample)).tensors["nbytes"].sum())
    assert sizes.loc["ws2", "tensor_bytes"] == total
    same = ckptkit.diff(str(sample), str(tmp_path / "st"))
    assert set(same["status"]) == {"equal"}


def test_sample_diff(samples, sample, tmp_path):
    """03: one more AdamW step moves every weight, leaves buffers alone, and `odd` learns
    nothing (its gradient is ~0 through the final LayerNorm)."""
    step1 = sample_checkpoint(steps=1)
    d = ckptkit.diff(str(step1), str(sample))
    rows = d.set_index("key")
    assert rows.loc["model.temperature", "status"] == "equal"
    assert rows.loc["model.position_ids", "status"] == "equal"
    assert rows.loc["model.num_updates", "status"] == "different"
    assert rows.loc["model.num_updates", "max_abs"] == 1
    model = d[d["key"].str.startswith("model.")]
    weights = model[model["shape"].map(len) >= 2]
    assert set(weights["status"]) == {"different"}
    by_layer = plots.diff_by_layer(weights)
    assert by_layer.idxmax() == "embed"
    assert by_layer["odd"] < 1e-3 < by_layer.drop("odd").min()
    assert rows.loc["model.odd", "max_abs"] < 1e-5 < rows.loc["model.embed.weight", "max_abs"]
    changed = d[d["status"] == "object_changed"].set_index("key")["note"]
    assert changed["train.step"] == "1 → 2"
    ckptkit.unshard(str(sample), str(tmp_path / "st"), to="safetensors", progress=False)
    check = ckptkit.diff(str(sample), str(tmp_path / "st"))
    assert set(check["status"]) == {"equal"} and len(check) == len(ckptkit.open(str(sample)))
    text = ckptkit.diff_text(d)
    assert "DIFFERENT" in text and "model.embed.weight" in text
    real = set(ckptkit.open(str(sample)).tensors["key"])
    assert len({key for key in real if key in text}) >= 5


def test_sample_convert(sample, tmp_path):
    """04: output files per group, and models loaded from them compute the same logits."""
    from safetensors.torch import load_file

    from ckptkit.examples import BATCH, SEQ_LEN, VOCAB, TinyLM

    full = torch.load(sample.parent / "reference.pt", weights_only=False)
    st = ckptkit.unshard(str(sample), str(tmp_path / "st"), to="safetensors", progress=False)
    assert st.to_frame()["name"].tolist() == [
        "model.safetensors",
        "optim.safetensors",
        "optim.objects.pt",
        "train.objects.pt",
    ]
    pt = ckptkit.unshard(str(sample), str(tmp_path / "pt"), progress=False)
    assert pt.to_frame()["name"].tolist() == ["model.pt", "optim.pt", "train.pt"]
    tokens = torch.randint(VOCAB, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    reference = TinyLM()
    reference.load_state_dict(full["model"])
    loaded = TinyLM()
    loaded.load_state_dict(load_file(tmp_path / "st" / "model.safetensors"), strict=True)
    streamed = TinyLM()
    result = ckptkit.from_checkpoint(streamed, str(sample))
    assert result.missing_keys == [] and result.unexpected_keys == []
    with torch.no_grad():
        expected = reference(tokens)
        assert torch.equal(loaded(tokens), expected) and torch.equal(streamed(tokens), expected)
    train = torch.load(tmp_path / "pt" / "train.pt", weights_only=True)
    assert train == full["train"]


def _flatten(tree, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(dotted key, leaf) of a nested state dict, as notebook 04 flattens one."""
    if isinstance(tree, dict):
        for name, value in tree.items():
            yield from _flatten(value, f"{prefix}{name}.")
    elif isinstance(tree, list | tuple) and any(isinstance(v, torch.Tensor) for v in tree):
        for i, value in enumerate(tree):
            yield from _flatten(value, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def test_sample_unshard_round_trips_through_dcp(sample, tmp_path):
    """04: every tensor of model.pt equals ckpt.read, and comes back equal through DCP (model.pt
    converted to DCP, read back by torch's dcp_to_torch_save)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = ckptkit.open(str(sample))
    n = int((ckpt.tensors["group"] == "model").sum())
    ckptkit.unshard(ckpt, str(tmp_path / "torch"), to="torch", progress=False)
    state = torch.load(tmp_path / "torch" / "model.pt", weights_only=True, mmap=True)
    tensors = {k: v for k, v in _flatten(state, "model.") if isinstance(v, torch.Tensor)}
    assert len(tensors) == n
    assert sum(torch.equal(v, ckpt.read(k)) for k, v in tensors.items()) == n
    model_pt = tmp_path / "torch" / "model.pt"
    ckptkit.convert(str(model_pt), str(tmp_path / "dcp"), to="dcp", groups="model", progress=False)
    dcp_to_torch_save(str(tmp_path / "dcp"), str(tmp_path / "roundtrip.pt"))
    roundtrip = dict(_flatten(torch.load(tmp_path / "roundtrip.pt", weights_only=True)))
    assert sum(torch.equal(v, roundtrip[k]) for k, v in tensors.items()) == n


def test_sample_from_s3(sample, s3, tmp_path):
    """05: the sample uploaded to S3 names and reads its largest tensor as the local copy does,
    and unsharding it from S3 writes files identical to unsharding the local copy."""
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    bucket = f"ckptkit-sample-{uuid.uuid4().hex[:8]}"
    fs.mkdir(bucket)
    url = f"s3://{bucket}/run1/{sample.name}"
    try:
        fs.put(str(sample), url, recursive=True)
        remote, local = ckptkit.open(url), ckptkit.open(str(sample))
        key = largest(local)
        assert largest(remote) == key and torch.equal(remote.read(key), local.read(key))
        result = ckptkit.unshard(remote, str(tmp_path / "from_s3"), progress=False)
        ckptkit.unshard(str(sample), str(tmp_path / "from_local"), progress=False)
        names = [f.name for f in result.files]
        assert names and all(
            (tmp_path / "from_s3" / name).read_bytes()
            == (tmp_path / "from_local" / name).read_bytes()
            for name in names
        )
    finally:
        fs.rm(bucket, recursive=True)


def test_sample_browse(sample, tmp_path):
    """06: filters read nothing; a copy whose adapter was nudged differs there only."""
    from safetensors.torch import save_file

    ckpt = ckptkit.open(str(sample))
    ui = ckptkit.browse(ckpt)
    fc1 = ui.set_filter(r"blocks\.\d+\.fc1\.weight$", mode="regex")
    assert fc1 == ["model.blocks.0.fc1.weight", "model.blocks.1.fc1.weight"]
    assert ui.reads == []
    # The tensor the notebook selects: the browser's statistics are torch's.
    ui.set_filter("")
    key = largest(ckpt, by_chunks=True)
    stats, values = ui.select(key), ckpt.read(key).double()
    expected = (values.min(), values.max(), values.mean(), values.std(correction=0))
    for name, value in zip(("min", "max", "mean", "std"), expected, strict=True):
        assert stats[name] == pytest.approx(value.item(), rel=1e-6, abs=1e-9), (key, name)
    model_keys = ckpt.tensors.loc[ckpt.tensors["group"] == "model", "key"]
    weights = {key.removeprefix("model."): ckpt.read(key) for key in model_keys}
    weights["adapter.up.weight"] = (weights["adapter.up.weight"].float() + 0.01).bfloat16()
    save_file(weights, str(tmp_path / "model.safetensors"))
    compare = ckptkit.browse(ckpt, compare_to=str(tmp_path / "model.safetensors"))
    compare.set_filter("")
    compare.select("model.adapter.up.weight")
    assert compare.diff["status"] == "different" and 0 < compare.diff["rel_l2"] < 1
    compare.select("model.odd")
    assert compare.diff["status"] == "equal"
    compare.select("optim.state.odd.exp_avg")
    assert compare.diff["status"] == "only_a"


def test_sample_audit(sample, tmp_path):
    """07: the damage the notebook does (half of the largest file cut, one bit flipped in the
    largest record of another) is found, each problem naming its file and key."""
    assert ckptkit.verify(str(sample)).empty  # the notebook's "no problems found"
    ckpt = ckptkit.open(str(sample))
    bad = tmp_path / "bad"
    shutil.copytree(sample, bad)
    truncated = ckpt.files.nlargest(1, "size")["file"].iloc[0]
    half = (bad / truncated).stat().st_size // 2
    with open(bad / truncated, "r+b") as f:
        f.truncate(half)
    records = ckpt.chunks[ckpt.chunks["file"] != truncated]
    flipped = records.nlargest(1, "length").iloc[0]
    data = bytearray((bad / flipped["file"]).read_bytes())
    data[int(flipped["offset"]) + int(flipped["length"]) // 2] ^= 0x40
    (bad / flipped["file"]).write_bytes(data)

    problems = ckptkit.verify(str(bad))
    assert set(problems["problem"]) == {"truncated", "checksum"}
    assert set(problems.loc[problems["problem"] == "truncated", "file"]) == {truncated}
    assert list(problems.loc[problems["problem"] == "checksum", "key"]) == [flipped["key"]]
    damaged = ckptkit.open(str(bad))
    with pytest.raises(ckptkit.ChecksumError, match=re.escape(flipped["key"])):
        damaged.read(flipped["key"])
    truncated_key = problems.loc[problems["problem"] == "truncated", "key"].iloc[0]
    with pytest.raises(ckptkit.TruncatedFileError, match=re.escape(truncated)):
        damaged.read(truncated_key)


def test_olmo_layouts_hold_the_same_state():
    """08: OLMo's legacy and torch_new checkpointers saved the same step identically."""
    legacy, new = ckptkit.open(str(OLMO_LEGACY)), ckptkit.open(str(OLMO))
    assert (legacy.format, new.format) == ("rank_files", "olmo_dcp")
    assert legacy.summary().by_group.loc["model", "tensors"] == 29
    assert new.summary().by_group.loc["model", "tensors"] == 29
    assert legacy.read_object("train.global_step") == new.read_object("train.global_step") == 3
    assert new.config["sharded_checkpointer"] == "torch_new"
    report = ckptkit.diff(legacy, new, keys=["model.*", "optim.state.*"])
    assert (report["status"] == "equal").all() and len(report) == 116
    # The notebook's own comparison: every group but train, and the largest common tensor.
    groups = sorted(set(legacy.tensors["group"]) & set(new.tensors["group"]) - {"train"})
    statuses = ckptkit.diff(legacy, new, keys=[f"{g}.*" for g in groups])["status"]
    assert groups and set(statuses) == {"equal"}
    common = legacy.tensors.merge(new.tensors[["key"]], on="key")
    key = largest_common(common)
    assert (legacy.chunks["key"] == key).any() and (new.chunks["key"] == key).any()
