"""What the commands print for people: every line within the terminal's width (``COLUMNS``,
100 here; ``--wide`` shows everything), no ``nan`` / ``<NA>`` / ``None`` where a value does not
exist, singular for one, and a Ctrl-C once the outputs are published is not an interruption.
Run on the checked-in fixtures (DeepSpeed ZeRO-3, Megatron, torch 2.2 DCP) and on files torch
writes here."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.cli import EXIT_INTERRUPTED, main
from ckptkit.ops import distributed
from ckptkit.storage.atomic import AtomicOutput

FIXTURES = Path(__file__).parent / "fixtures"
ZERO3 = FIXTURES / "deepspeed_zero3_ws2" / "checkpoint"
ZERO2 = FIXTURES / "deepspeed_zero2_ws2" / "checkpoint"
MEGATRON_TP2 = FIXTURES / "megatron_mcore016_gpt_tp2_ws2" / "checkpoint"
MEGATRON_DP2 = FIXTURES / "megatron_mcore016_gpt_dp2_ws2" / "checkpoint"
DCP_TORCH22 = FIXTURES / "dcp_torch22_fsdp1_ws2" / "checkpoint"
#: A key of the Megatron fixture too long for a stats line of 100 columns.
LONG_KEY = "model.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"

#: A value that does not exist, printed as such ("nan %" names a column, "NaN or Inf" a line).
ABSENT_SPELLED = re.compile(r"<NA>|\b(nan|NaN|None)\b(?! %| or Inf)")
#: A count of one with a plural noun.
ONE_PLURAL = re.compile(r"(?<![\d.,])1 (files|objects|tensors|keys|chunks|entries|elements)\b")


@pytest.fixture(autouse=True)
def columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")


def printed(capsys, *argv: str, expect: int = 0) -> str:
    """Run the CLI; its stdout, checked: the exit status, no absent value spelled out, no
    "1 files"."""
    assert main(list(argv)) == expect, capsys.readouterr().err
    out = capsys.readouterr().out
    assert not ABSENT_SPELLED.search(out), ABSENT_SPELLED.search(out)
    assert not ONE_PLURAL.search(out), ONE_PLURAL.search(out)
    return out


def too_wide(text: str, *paths: object, width: int = 100) -> list[str]:
    """The lines over ``width``, but for one holding one of ``paths`` beside at most a short
    label: a path is printed whole, so a long one may overflow its own line and no other."""
    return [
        line
        for line in text.splitlines()
        if len(line) > width
        and not any(str(p) in line and len(line) - len(str(p)) <= 25 for p in paths)
    ]


@pytest.fixture(scope="module")
def far_away(tmp_path_factory) -> Path:
    """A folder whose path alone is wider than the terminal, linking to the fixtures: the
    reports must fit wherever a checkpoint (or this checkout) lives."""
    folder = tmp_path_factory.mktemp("a" * 40) / ("deeply-nested-" * 5)
    folder.mkdir()
    (folder / "fixtures").symlink_to(FIXTURES)
    return folder / "fixtures"


@pytest.mark.parametrize("path", [ZERO3, MEGATRON_TP2, DCP_TORCH22], ids=lambda p: p.parent.name)
@pytest.mark.parametrize("command", ["inspect", "stats", "verify"])
def test_reports_fit_100_columns(capsys, far_away, command, path):
    for where in (path, far_away / path.relative_to(FIXTURES)):
        out = printed(capsys, command, str(where), *(["--quiet"] if command == "stats" else []))
        assert not too_wide(out, where)
        if command == "verify":
            assert out.strip() == f"{where}: no problems found"


def test_inspect_shows_files_of_no_rank_as_a_dash(capsys):
    """ZeRO-3: the model-states file of rank 0 names no rank; its row is '—', explained."""
    assert ckptkit.open(str(ZERO3)).summary().by_rank.index.isna().any()
    out = printed(capsys, "inspect", str(ZERO3))
    by_rank = out.split("by rank:\n")[1].split("\n\n")[0].splitlines()
    assert by_rank[0].split() == ["rank", "size", "records"]  # no index-name line of its own
    assert [line.split()[0] for line in by_rank[1:]] == ["0", "1", "—", "—:"]
    assert "by group:\ngroup " in out and "by dtype:\ndtype " in out


def test_long_keys_are_cut_in_the_middle_and_wide_shows_them_whole(capsys):
    out = printed(capsys, "stats", str(MEGATRON_TP2), "--keys", "model.decoder.*", "--quiet")
    assert not too_wide(out, MEGATRON_TP2) and LONG_KEY not in out
    assert "model.decoder.layers" in out and "…" in out
    assert "left out to fit 100 columns; --wide shows them" in out
    wide = printed(
        capsys, "stats", str(MEGATRON_TP2), "--keys", "model.decoder.*", "--quiet", "--wide"
    )
    assert LONG_KEY in wide and "…" not in wide and "left out" not in wide
    header = wide.splitlines()[1].split()
    assert header[:3] == ["key", "dtype", "shape"] and "abs_max" in header and "l2" in header

    inspect = printed(capsys, "inspect", str(MEGATRON_TP2), "--top", "40", "--wide")
    assert "sharded_dims" in inspect and any(len(line) > 100 for line in inspect.splitlines())


def test_diff_fits_and_keeps_the_verdict_beside_the_counts(capsys):
    out = printed(capsys, "diff", str(ZERO3), str(ZERO2), "--quiet", expect=1)
    assert not too_wide(out, ZERO3, ZERO2)
    assert re.search(r"\d+ equal -> DIFFERENT$", out, re.MULTILINE)
    assert "optim.zero_stage" in out and "3 → 2" in out
    megatron = printed(capsys, "diff", str(MEGATRON_TP2), str(MEGATRON_DP2), "--quiet", expect=1)
    assert not too_wide(megatron, MEGATRON_TP2, MEGATRON_DP2)
    # object rows: no empty dtype and shape columns beside the note
    changed = megatron.split("object_changed (3):\n")[1].splitlines()[0]
    assert changed.split() == ["key", "note"]
    wide = printed(
        capsys, "diff", str(MEGATRON_TP2), str(MEGATRON_DP2), "--quiet", "--wide", expect=1
    )
    assert "frac_outside" in wide and too_wide(wide)


def test_sizes_fit_with_many_checkpoints(capsys):
    paths = [str(p) for p in (ZERO3, ZERO2, MEGATRON_TP2, DCP_TORCH22)]
    out = printed(capsys, "sizes", *paths)
    assert not too_wide(out)
    assert out.splitlines()[0].split()[0] == "checkpoint" and "overhead_bytes" in out
    labels = printed(capsys, "sizes", *paths[:2], "--labels", "zero3", "--labels", "zero2")
    assert labels.splitlines()[0].split() == ["checkpoint", "zero3", "zero2"]


@pytest.mark.parametrize("to", ["torch", "safetensors"])
def test_unshard_report_fits(capsys, tmp_path, to):
    """Megatron's objects name numpy and argparse globals: the sentence saying so is wrapped."""
    out = printed(capsys, "unshard", str(MEGATRON_TP2), str(tmp_path), "--to", to, "--quiet")
    assert out.startswith("wrote 6 files" if to == "safetensors" else "wrote 4 files")
    assert not too_wide(out) and "argparse.Namespace" in out


def test_verify_names_a_missing_file_without_nan(capsys, tmp_path):
    """A missing file (no key) beside a checksum problem (a key) in one report."""
    damaged = tmp_path / "dcp"
    shutil.copytree(DCP_TORCH22, damaged)
    (damaged / "__1_0.distcp").unlink()
    data = damaged / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    out = printed(capsys, "verify", str(damaged), expect=1)
    lines = out.splitlines()
    assert "missing file: __1_0.distcp" in lines
    assert any(line.startswith("checksum: __0_0.distcp ") for line in lines)
    details = [line for line in lines if line.startswith("    ")]
    assert details and not too_wide("\n".join(set(lines) - set(details)))  # details whole


def test_one_is_singular(capsys, tmp_path):
    torch.save({"weight": torch.ones(2, 3)}, tmp_path / "model.pt")
    out = printed(capsys, "inspect", str(tmp_path / "model.pt"))
    assert "1 tensor, 0 objects, 1 file, " in out and "largest 1 tensor:" in out
    stats = printed(capsys, "stats", str(tmp_path / "model.pt"), "--quiet")
    assert ": 1 tensor, 6 elements" in stats
    wrote = printed(capsys, "unshard", str(tmp_path / "model.pt"), str(tmp_path / "out"), "--quiet")
    assert wrote.startswith("wrote 1 file (") and wrote.splitlines()[1].endswith(
        "1 tensor, 0 objects"
    )
    assert repr(ckptkit.open(str(tmp_path / "model.pt"))).endswith(": 1 tensor, 0 objects, 1 file>")


def test_a_0d_tensor_shows_its_value_not_nan(capsys, tmp_path):
    torch.save({"scale": torch.tensor(3.5), "weight": torch.arange(4.0)}, tmp_path / "model.pt")
    out = printed(capsys, "stats", str(tmp_path / "model.pt"), "--quiet", "--wide")
    header = out.splitlines()[1].split()  # "zero %" splits in two: compare up to it
    row = next(line for line in out.splitlines() if "scale" in line).split()
    cells = dict(zip(header[: header.index("zero")], row, strict=False))
    assert cells["shape"] == "[]" and cells["dtype"] == "float32"
    assert cells["min"] == cells["max"] == cells["mean"] == "3.5" and cells["std"] == "—"


def test_ctrl_c_after_publishing_is_success(capsys, tmp_path, monkeypatch):
    """The progress bar closes after the outputs are in place: a Ctrl-C there changes nothing,
    the summary is printed and the exit status is 0."""
    reference = tmp_path / "reference"
    assert main(["unshard", str(ZERO3), str(reference), "--quiet"]) == 0
    expected = capsys.readouterr().out.replace(str(reference), str(tmp_path / "out"))
    close = distributed.JobProgress.close

    def close_then_interrupt(self, failed: bool = False) -> None:
        close(self, failed)
        if not failed:
            raise KeyboardInterrupt

    monkeypatch.setattr(distributed.JobProgress, "close", close_then_interrupt)
    out = printed(capsys, "unshard", str(ZERO3), str(tmp_path / "out"), "--quiet")
    assert out == expected and out.startswith("wrote 4 files")
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == sorted(p.name for p in reference.iterdir())  # no staging folder left
    for name in written:
        assert (tmp_path / "out" / name).read_bytes() == (reference / name).read_bytes()


def test_ctrl_c_before_publishing_is_an_interruption(capsys, tmp_path, monkeypatch):
    """Interrupted while putting the files in place: exit 130 and nothing under a final name."""

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(AtomicOutput, "publish", interrupted)
    assert main(["unshard", str(ZERO3), str(tmp_path / "out"), "--quiet"]) == EXIT_INTERRUPTED
    assert "interrupted" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
