"""Locations that point to a checkpoint rather than being one: a file of a DCP, its
``.metadata``, a run folder of step directories. Each gets a message naming what to open,
never a damage report."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import ckptkit
from ckptkit.cli import main
from ckptkit.errors import FormatError, MissingFileError

OLMO = Path(__file__).parent / "fixtures" / "olmo_core3_trainer_ws2" / "step3"


def test_a_file_of_a_dcp_points_to_its_directory(ws2, capsys):
    data_file = sorted(ws2.path.glob("*.distcp"))[0]
    for inside, what in ((data_file, "a data file"), (ws2.path / ".metadata", "the metadata")):
        with pytest.raises(FormatError) as error:
            ckptkit.open(str(inside))
        message = str(error.value)
        assert f"{inside} is {what} of the DCP checkpoint {ws2.path}" in message
        assert "interrupted" not in message and "not a checkpoint" not in message
        assert main(["inspect", str(inside)]) == 2
        assert f"ckptkit inspect {ws2.path}" in capsys.readouterr().err


def test_a_data_file_without_metadata_is_still_reported_missing(ws2, tmp_path):
    """Without .metadata beside it there is no checkpoint to point to: the directory is the
    damaged one, and the message says what is missing."""
    copy = tmp_path / "ckpt"
    shutil.copytree(ws2.path, copy)
    (copy / ".metadata").unlink()
    with pytest.raises(MissingFileError, match="metadata is not"):
        ckptkit.open(str(copy))


def test_a_run_folder_lists_its_steps_in_natural_order(ws2, tmp_path, capsys):
    run = tmp_path / "run"
    for step in ("step3", "step10", "step1"):
        shutil.copytree(ws2.path, run / step)
    shutil.copytree(OLMO, run / "olmo_step3")
    (run / "notes").mkdir()
    with pytest.raises(FormatError) as error:
        ckptkit.open(str(run))
    message = str(error.value)
    assert "a folder of 4 checkpoint(s), not one: olmo_step3, step1, step3, step10" in message
    assert f"ckptkit inspect {run / 'step10'}" in message
    assert "notes" not in message.split("not one:")[1]
    assert main(["inspect", str(run)]) == 2
    assert "step10" in capsys.readouterr().err


def test_a_folder_with_no_checkpoint_below_says_what_it_looked_for(tmp_path):
    (tmp_path / "empty_step").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(FormatError, match="not a checkpoint ckptkit recognises"):
        ckptkit.open(str(tmp_path))
