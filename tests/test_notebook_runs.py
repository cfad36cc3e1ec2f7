"""``ckptkit notebooks DIR`` and ``ckptkit notebook NAME CHECKPOINT`` (ckptkit/notebook_runs.py):
the notebooks that ship with the package, copied and run with papermill on real checkpoints.
(The wheel holding them is checked by tests/test_install.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptkit import cli, notebook_runs
from ckptkit.errors import OutputExistsError, UsageError

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
DEEPSPEED = Path(__file__).parent / "fixtures" / "deepspeed_zero2_ws2" / "checkpoint"


def test_names_are_the_repository_notebooks_and_resolve_by_number_or_name():
    names = notebook_runs.notebook_names()
    assert names == sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) and len(names) >= 9
    for spelling in ("03", "3", "diff_tensors", "03_diff_tensors", "03_diff_tensors.ipynb"):
        assert notebook_runs.find_notebook(spelling) == "03_diff_tensors"
    for wrong in ("", "99", "diff"):
        with pytest.raises(UsageError, match="01_inspect"):
            notebook_runs.find_notebook(wrong)


def test_parameters_come_from_each_notebooks_parameters_cell():
    assert list(notebook_runs.notebook_parameters("03")) == [
        "checkpoint",
        "other",
        "storage_options",
    ]
    assert list(notebook_runs.notebook_parameters("09"))[0] == "run_path"
    assert "fsspec" in notebook_runs.notebook_parameters("01")["storage_options"]
    values = [notebook_runs.parameter_value(t) for t in ("True", "None", "3", "0.5", "true", "x")]
    assert values == [True, None, 3, 0.5, "true", "x"]  # as papermill's own -p


def test_notebooks_command_copies_them_and_refuses_to_overwrite(tmp_path, capsys):
    target = tmp_path / "mine"
    assert cli.main(["notebooks", str(target)]) == 0
    printed = capsys.readouterr().out.split()
    assert [Path(p).name for p in printed] == sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    for path in NOTEBOOKS.glob("*.ipynb"):
        assert (target / path.name).read_bytes() == path.read_bytes()
    (target / "01_inspect.ipynb").write_text("mine")
    assert cli.main(["notebooks", str(target)]) == cli.EXIT_ERROR
    assert "already there" in capsys.readouterr().err
    assert (target / "01_inspect.ipynb").read_text() == "mine"
    with pytest.raises(OutputExistsError):
        notebook_runs.copy_notebooks(target)
    notebook_runs.copy_notebooks(target, overwrite=True)
    assert (target / "01_inspect.ipynb").read_bytes() == (
        NOTEBOOKS / "01_inspect.ipynb"
    ).read_bytes()


def test_notebook_command_checks_names_and_parameters_before_running(tmp_path, capsys):
    assert cli.main(["notebook", "42", str(DEEPSPEED)]) == cli.EXIT_ERROR
    assert "no notebook '42'; the notebooks are: 01_inspect" in capsys.readouterr().err
    bad = ["notebook", "03", str(DEEPSPEED), "-p", "colour", "red", "-o", str(tmp_path / "o")]
    assert cli.main(bad) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert "no parameter 'colour'; its parameters: checkpoint, other, storage_options" in err
    twice = ["notebook", "03", str(DEEPSPEED), "-p", "checkpoint", "x"]
    assert cli.main(twice) == cli.EXIT_ERROR
    assert "'checkpoint' given twice" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    assert notebook_runs.EXIT_FAILED == cli.EXIT_ERROR


def test_cli_runs_a_notebook_on_a_deepspeed_checkpoint(tmp_path, capsys):
    out = tmp_path / "runs" / "ds.ipynb"
    command = ["notebook", "03", str(DEEPSPEED), "-o", str(out), "--html"]
    assert cli.main(command) == 0
    assert capsys.readouterr().out.split() == [str(out), str(out.with_suffix(".html"))]
    cells = json.loads(out.read_text())["cells"]
    injected = [c for c in cells if "injected-parameters" in c["metadata"].get("tags", [])]
    assert len(injected) == 1 and str(DEEPSPEED) in "".join(injected[0]["source"])
    shown = "".join(
        "".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
        for c in cells
        for o in c.get("outputs", [])
    )
    assert "model.fc1.weight" in shown  # the checkpoint's own keys, not the sample's
    assert "blocks.1.fc1" not in shown
    assert "<html" in out.with_suffix(".html").read_text()[:2000].lower()
    assert cli.main(command) == cli.EXIT_ERROR  # outputs exist: refused
    assert "already there" in capsys.readouterr().err


def test_cli_runs_report_a_failing_cell_in_one_line(tmp_path, capsys):
    out = tmp_path / "failed.ipynb"
    nothing = tmp_path / "not-a-checkpoint"
    nothing.mkdir()
    assert cli.main(["notebook", "07", str(nothing), "-o", str(out)]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("ckptkit: notebook 07_audit failed in cell ") and err.count("\n") == 1
    assert "NotACheckpointError" in err and str(out) in err
    assert out.is_file()  # the executed part, with the error, for the user to look at
