"""ckptkit.run on run folders: steps found in every layout, statistics over steps equal to
ckptkit.stats of each step, the parquet cache reused (reads counted) and invalidated, diffs."""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path

import pytest

import ckptkit
from ckptkit.examples import write_run
from ckptkit.reading import Reader
from ckptkit.runs import RUN_COLUMNS, step_number

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """One FSDP2 training job (2 ranks, gloo/CPU) that saved DCP checkpoints at steps 1-3."""
    return write_run(tmp_path_factory.mktemp("run") / "run", steps=[1, 2, 3])


@pytest.fixture
def count_reads(monkeypatch) -> Counter:
    """Tensors streamed, counted per checkpoint directory name (``step2``)."""
    counts: Counter = Counter()
    original = Reader.iter_bytes

    def counting(self, entry):
        counts[Path(self.storage.url).name] += 1
        return original(self, entry)

    monkeypatch.setattr(Reader, "iter_bytes", counting)
    return counts


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("step1000", 1000),
        ("step1000-unsharded", 1000),
        ("global_step120", 120),
        ("iter_0000300", 300),
        ("checkpoint-500", 500),
        ("epoch=1-step=42", 42),
        ("ckpt_0007", 7),
        ("latest", None),
    ],
)
def test_step_numbers_from_names(name, step):
    assert step_number(name) == step


def test_finds_the_steps_of_a_training_run_in_order(trained_run, tmp_path):
    run = ckptkit.run(str(trained_run))
    assert run.steps == [1, 2, 3] and len(run) == 3
    assert run.table["format"].tolist() == ["dcp"] * 3
    assert run.location(2) == str(trained_run / "step2")
    assert run.open(3).read_object("train.step") == 3
    # the same steps among what else a run folder holds, step 10 after step 9
    mixed = tmp_path / "mixed"
    shutil.copytree(trained_run / "step1", mixed / "step10")
    shutil.copytree(trained_run / "step2", mixed / "step9")
    (mixed / "step11-tmp").mkdir()  # a save that has not begun writing
    (mixed / "logs").mkdir()
    (mixed / "latest").write_text("step10")
    again = ckptkit.run(str(mixed))
    assert [c.name for c in again] == ["step9", "step10"]
    with pytest.raises(ckptkit.KeyNotFoundError, match="no checkpoint for step 4"):
        again.location(4)


def test_finds_steps_of_other_layouts(tmp_path):
    deepspeed = ckptkit.run(str(FIXTURES / "deepspeed_zero2_ws2" / "checkpoint"))
    assert [(c.step, c.name, c.format) for c in deepspeed] == [
        (2, "global_step2", "deepspeed_zero")
    ]
    olmo_core = ckptkit.run(str(FIXTURES / "olmo_core_v010_ws2"))
    assert olmo_core.steps == [3]
    megatron = tmp_path / "megatron"
    shutil.copytree(
        FIXTURES / "megatron_mcore016_gpt_dp2_ws2" / "checkpoint", megatron / "iter_0000002"
    )
    (megatron / "latest_checkpointed_iteration.txt").write_text("2")
    found = ckptkit.run(str(megatron))
    assert [(c.step, c.format) for c in found] == [(2, "megatron_dist")]
    stats = found.stats(cache=False)
    assert set(stats["step"]) == {2}
    selected = ckptkit.open(str(megatron / "iter_0000002")).catalog.select()
    assert len(stats) == sum(e.kind == "tensor" for e in selected)  # stacked view left out


def test_not_a_run(trained_run, tmp_path):
    with pytest.raises(ckptkit.FormatError, match="no step checkpoints below"):
        ckptkit.run(str(trained_run / "step1"))
    with pytest.raises(ckptkit.MissingFileError):
        ckptkit.run(str(tmp_path / "nothing"))


def test_stats_over_steps_equal_stats_of_each_step(trained_run):
    run = ckptkit.run(str(trained_run))
    frame = run.stats(cache=False)
    assert frame.columns.tolist() == RUN_COLUMNS
    assert frame["step"].tolist() == sorted(frame["step"])
    for step in run.steps:
        single = ckptkit.stats(run.location(step))
        rows = frame[frame["step"] == step].drop(columns=["step", "checkpoint"])
        assert rows.reset_index(drop=True).equals(single), step
    # weights move between steps, frozen buffers do not
    fingerprints = frame.pivot(index="key", columns="step", values="fingerprint")
    assert fingerprints.loc["model.embed.weight"].nunique() == 3
    assert fingerprints.loc["model.position_ids"].nunique() == 1
    only_model = run.stats(groups="model", keys="*.weight", cache=False)
    assert set(only_model["group"]) == {"model"} and only_model["key"].str.endswith(".weight").all()


def test_cache_reads_only_new_and_changed_steps(trained_run, tmp_path, count_reads):
    folder, cache = tmp_path / "run", tmp_path / "cache" / "stats.parquet"
    for name in ("step1", "step2"):
        shutil.copytree(trained_run / name, folder / name)
    run = ckptkit.run(str(folder))
    first = run.stats(cache=cache)
    tensors = len(ckptkit.open(str(folder / "step1")).catalog.tensors())
    assert count_reads == {"step1": tensors, "step2": tensors}
    assert first.attrs["read"] == ["step1", "step2"] and cache.exists()

    count_reads.clear()
    shutil.copytree(trained_run / "step3", folder / "step3")  # a new step lands
    second = ckptkit.run(str(folder)).stats(cache=cache)
    assert count_reads == {"step3": tensors}
    assert second.attrs["cached"] == ["step1", "step2"] and second.attrs["read"] == ["step3"]
    fresh = ckptkit.run(str(folder)).stats(cache=False)
    assert second.equals(fresh)

    count_reads.clear()
    data = next((folder / "step2").glob("*.distcp"))
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10**9))  # rewritten
    third = ckptkit.run(str(folder)).stats(cache=cache)
    assert count_reads == {"step2": tensors}
    assert third.equals(fresh)

    count_reads.clear()  # another selection is computed (and cached) on its own
    model = ckptkit.run(str(folder)).stats(groups="model", cache=cache)
    assert set(count_reads) == {"step1", "step2", "step3"}
    assert model.equals(fresh[fresh["group"] == "model"].reset_index(drop=True))
    count_reads.clear()
    ckptkit.run(str(folder)).stats(groups="model", cache=cache)
    ckptkit.run(str(folder)).stats(cache=cache)
    assert count_reads == {}


def test_a_damaged_cache_is_recomputed(trained_run, tmp_path, count_reads):
    cache = tmp_path / "stats.parquet"
    cache.write_bytes(b"PAR1 not really parquet")
    run = ckptkit.run(str(trained_run))
    with pytest.warns(UserWarning, match="unreadable statistics cache"):
        frame = run.stats(steps=[1], cache=cache)
    assert frame.attrs["read"] == ["step1"] and set(count_reads) == {"step1"}
    assert run.stats(steps=[1], cache=cache).attrs["cached"] == ["step1"]


def test_an_unreadable_step_is_left_out_with_a_warning(trained_run, tmp_path):
    folder = tmp_path / "run"
    for name in ("step1", "step2"):
        shutil.copytree(trained_run / name, folder / name)
    data = sorted((folder / "step2").glob("*.distcp"))[0]
    with open(data, "r+b") as f:  # an interrupted copy
        f.truncate(data.stat().st_size // 2)
    run = ckptkit.run(str(folder))
    with pytest.warns(UserWarning, match="step2: left out"):
        frame = run.stats(cache=tmp_path / "cache.parquet")
    assert set(frame["step"]) == {1}
    assert list(frame.attrs["failed"]) == ["step2"]
    assert "step2" not in run.stats(steps=[1], cache=tmp_path / "cache.parquet").attrs["failed"]


def test_diff_between_steps_is_the_update(trained_run):
    run = ckptkit.run(str(trained_run))
    frame = run.diff(1, 2, keys="model.*").set_index("key")
    expected = ckptkit.diff(run.location(1), run.location(2), keys="model.*").set_index("key")
    assert frame.equals(expected)
    assert frame.loc["model.embed.weight", "status"] == "different"
    assert 0 < frame.loc["model.embed.weight", "rel_l2"] < 0.5
    assert frame.loc["model.position_ids", "status"] == "equal"


def test_a_run_in_s3_reads_only_new_steps(trained_run, tmp_path, s3):
    import uuid

    import fsspec

    fs = fsspec.filesystem("s3")
    bucket = f"run-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    for name in ("step1", "step2"):
        fs.put(str(trained_run / name), f"{bucket}/run/{name}", recursive=True)
    fs.invalidate_cache()
    url, cache = f"s3://{bucket}/run", tmp_path / "stats.parquet"
    first = ckptkit.run(url).stats(cache=cache)
    assert first.attrs["read"] == ["step1", "step2"]
    fs.put(str(trained_run / "step3"), f"{bucket}/run/step3", recursive=True)
    fs.invalidate_cache()
    s3.traffic.reset()
    second = ckptkit.run(url).stats(cache=cache)
    assert second.attrs["cached"] == ["step1", "step2"] and second.attrs["read"] == ["step3"]
    data = [r.path for r in s3.traffic.gets(f"/{bucket}/run/") if r.path.endswith(".distcp")]
    assert data and all(path.startswith(f"/{bucket}/run/step3/") for path in data)
    local = ckptkit.run(str(trained_run)).stats(cache=False)
    assert second.drop(columns="checkpoint").equals(local.drop(columns="checkpoint"))
    s3.traffic.reset()
