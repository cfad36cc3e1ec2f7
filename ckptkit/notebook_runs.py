"""The notebooks that come with the package, for a pip user: ``ckptkit notebooks DIR`` copies
them into a folder; ``ckptkit notebook 03 CHECKPOINT [-p KEY VALUE]…`` runs one with papermill
on the user's checkpoint and writes the executed notebook (and ``--html``, a page of it).

In the wheel they are ``ckptkit/notebooks/*.ipynb`` (pyproject.toml maps the repository's
``notebooks/`` there); in a checkout or an editable install, the repository's ``notebooks/``.
Running one needs the ``[notebooks]`` extra (papermill, a kernel, torch for the sample).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from collections.abc import Callable, Mapping
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from .errors import MissingFileError, OutputExistsError, UsageError
from .extras import require
from .views.terminal import printable

__all__ = [
    "EXIT_FAILED",
    "add_commands",
    "copy_notebooks",
    "find_notebook",
    "notebook_names",
    "notebook_parameters",
    "parameter_value",
    "run_notebook",
]

#: Exit status of ``ckptkit notebook`` when a cell raised (``ckptkit.cli.EXIT_ERROR``).
EXIT_FAILED = 2
#: The parameter a positional CHECKPOINT sets when the notebook has it (else its first one).
CHECKPOINT_PARAMETER = "checkpoint"


def _notebooks() -> dict[str, Traversable]:
    """Every shipped notebook by name (file stem), in order."""
    packaged = resources.files("ckptkit") / "notebooks"
    folder = packaged if packaged.is_dir() else Path(__file__).resolve().parents[1] / "notebooks"
    if not folder.is_dir():
        raise MissingFileError(f"no notebooks in this installation of ckptkit ({packaged})")
    found = {
        f.name.removesuffix(".ipynb"): f for f in folder.iterdir() if f.name.endswith(".ipynb")
    }
    return dict(sorted(found.items()))


def notebook_names() -> list[str]:
    """The shipped notebooks' names, in order: ``01_inspect``, ``02_compare_sizes``…"""
    return list(_notebooks())


def find_notebook(name: str) -> str:
    """The notebook ``name`` means: its full name, its number (``03``), the rest of its name
    (``diff_tensors``) or its file name; anything else is a :class:`UsageError` listing them."""
    names = notebook_names()
    wanted = name.removesuffix(".ipynb")
    if wanted.isdigit():  # 3 → 03
        wanted = f"{int(wanted):02d}"
    matches = [
        n for n in names if wanted in (n, n.split("_", 1)[0], n.split("_", 1)[-1]) and wanted
    ]
    if len(matches) != 1:
        raise UsageError(f"no notebook {name!r}; the notebooks are: {', '.join(names)}")
    return matches[0]


def notebook_parameters(name: str) -> dict[str, str]:
    """The parameters of notebook ``name`` (its papermill ``parameters`` cell) with the comment
    that describes each, in order."""
    source = _parameters_source(_read_notebook(find_notebook(name)))
    comments = dict(re.findall(r"^(\w+)\s*=.*?#\s*(.*)$", source, flags=re.MULTILINE))
    return {
        target.id: comments.get(target.id, "")
        for statement in ast.parse(source).body
        if isinstance(statement, ast.Assign)
        for target in statement.targets
        if isinstance(target, ast.Name)
    }


def _read_notebook(name: str) -> dict[str, Any]:
    return json.loads(_notebooks()[name].read_text(encoding="utf-8"))


def _parameters_source(notebook: Mapping[str, Any]) -> str:
    for cell in notebook["cells"]:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            return "".join(cell["source"])
    return ""


def parameter_value(text: str) -> Any:
    """A ``-p KEY VALUE`` value as papermill's own ``-p`` reads it: ``True``, ``False``,
    ``None``, an int or a float, else the text (the notebooks parse JSON text themselves)."""
    constants = {"True": True, "False": False, "None": None}
    if text in constants:
        return constants[text]
    for number in (int, float):
        try:
            return number(text)
        except ValueError:
            pass
    return text


def copy_notebooks(directory: str | Path, *, overwrite: bool = False) -> list[Path]:
    """Copy every shipped notebook into ``directory`` (made if missing); an existing file of
    the same name is an :class:`OutputExistsError` unless ``overwrite``. Returns the copies."""
    folder = Path(directory)
    notebooks = _notebooks()
    targets = {name: folder / f"{name}.ipynb" for name in notebooks}
    existing = [str(path) for path in targets.values() if path.exists()]
    if existing and not overwrite:
        raise OutputExistsError(f"already there (pass overwrite): {', '.join(existing)}")
    folder.mkdir(parents=True, exist_ok=True)
    for name, path in targets.items():
        path.write_bytes(notebooks[name].read_bytes())
    return list(targets.values())


def run_notebook(
    name: str,
    checkpoint: str | None = None,
    *,
    parameters: Mapping[str, Any] | None = None,
    output: str | Path | None = None,
    html: bool = False,
    overwrite: bool = False,
    kernel: str = "python3",
    progress: bool = False,
) -> list[Path]:
    """Execute notebook ``name`` with papermill on ``checkpoint`` (its ``checkpoint`` parameter,
    or its first one: ``run_path`` for 09), with ``parameters`` set in its parameters cell.

    The executed notebook goes to ``output`` (default ``NAME.out.ipynb`` here), and with
    ``html`` a page of it beside it (``.html``); the kernel runs in ``output``'s folder. A cell
    that raises stops the run with papermill's ``PapermillExecutionError``, the executed part
    written to ``output``. Needs the ``[notebooks]`` extra.

    Returns:
        The files written: the notebook, then the page.
    """
    papermill = require("papermill", "running a notebook")
    if html:
        require("nbconvert", "writing a notebook as HTML")
    name = find_notebook(name)
    values = _parameter_values(name, checkpoint, parameters or {})
    notebook = Path(output) if output is not None else Path(f"{name}.out.ipynb")
    page = notebook.with_suffix(".html")
    written = [notebook, page] if html else [notebook]
    existing = [str(path) for path in written if path.exists()]
    if existing and not overwrite:
        raise OutputExistsError(f"already there (pass overwrite): {', '.join(existing)}")
    notebook.parent.mkdir(parents=True, exist_ok=True)
    with resources.as_file(_notebooks()[name]) as source:
        papermill.execute_notebook(
            str(source),
            str(notebook),
            parameters=values,
            kernel_name=kernel,
            cwd=str(notebook.parent.resolve()),
            progress_bar=progress,
        )
    if html:
        from nbconvert import HTMLExporter

        body, _ = HTMLExporter().from_filename(str(notebook))
        page.write_text(body, encoding="utf-8")
    return written


def _parameter_values(
    name: str, checkpoint: str | None, parameters: Mapping[str, Any]
) -> dict[str, Any]:
    """``parameters`` with ``checkpoint`` under the notebook's checkpoint parameter, every
    name checked against the notebook's parameters cell."""
    known = list(notebook_parameters(name))
    values = dict(parameters)
    if checkpoint is not None:
        target = CHECKPOINT_PARAMETER if CHECKPOINT_PARAMETER in known else known[0]
        if target in values:
            raise UsageError(f"{target!r} given twice: as CHECKPOINT and with -p")
        values[target] = checkpoint
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise UsageError(
            f"notebook {name} has no parameter {', '.join(map(repr, unknown))}; "
            f"its parameters: {', '.join(known)}"
        )
    return values


# -- the two commands -------------------------------------------------------------------------

CommandMaker = Callable[[Any, str, str, str], argparse.ArgumentParser]


def add_commands(commands: Any, make_command: CommandMaker) -> None:
    """Add ``notebooks`` and ``notebook`` to the CLI's sub-commands (``make_command(commands,
    name, help, examples)`` is the CLI's own builder)."""
    try:
        listing = f"notebooks: {', '.join(notebook_names())}"
    except MissingFileError as exc:
        listing = str(exc)
    copy = make_command(
        commands,
        "notebooks",
        "copy the notebooks that come with ckptkit into a folder",
        "  ckptkit notebooks ckptkit-notebooks/\n  jupyter lab ckptkit-notebooks/",
    )
    copy.add_argument("directory", help="folder to copy them into (made if missing)")
    copy.add_argument("--overwrite", action="store_true", help="replace existing copies")
    copy.set_defaults(run=_copy_command)

    run = make_command(
        commands,
        "notebook",
        "run a notebook on your checkpoint with papermill (needs the [notebooks] extra)",
        "  ckptkit notebook 03 run/step1000 -p other run/step2000 --html\n"
        "  ckptkit notebook 07_audit s3://bucket/run/step3 -p storage_options '{\"anon\": true}'\n"
        "  ckptkit notebook 09 run/ -o audit.ipynb   # 09: CHECKPOINT is the run folder\n"
        + listing,
    )
    run.add_argument("name", metavar="NAME", help="notebook: its number (03) or name")
    run.add_argument(
        "checkpoint",
        nargs="?",
        metavar="CHECKPOINT",
        help="sets the notebook's `checkpoint` parameter (08: `first`, 09: `run_path`); "
        "omitted: the notebook's own sample",
    )
    run.add_argument(
        "-p",
        "--parameter",
        nargs=2,
        action="append",
        default=[],
        metavar=("KEY", "VALUE"),
        help="set a parameter (repeatable); values read as papermill's -p reads them",
    )
    run.add_argument(
        "-o", "--output", metavar="OUT.ipynb", help="executed notebook (default: NAME.out.ipynb)"
    )
    run.add_argument("--html", action="store_true", help="also write OUT.html")
    run.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    run.add_argument("--kernel", default="python3", help="Jupyter kernel name (python3)")
    run.set_defaults(run=_run_command)


def _copy_command(args: argparse.Namespace) -> int:
    for path in copy_notebooks(args.directory, overwrite=args.overwrite):
        print(path)
    return 0


def _run_command(args: argparse.Namespace) -> int:
    papermill = require("papermill", "running a notebook")
    parameters = {key: parameter_value(value) for key, value in args.parameter}
    output = args.output or f"{find_notebook(args.name)}.out.ipynb"
    try:
        written = run_notebook(
            args.name,
            args.checkpoint,
            parameters=parameters,
            output=output,
            html=args.html,
            overwrite=args.overwrite,
            kernel=args.kernel,
            progress=sys.stderr.isatty(),
        )
    except papermill.PapermillExecutionError as exc:
        failure = f"{exc.ename}: {exc.evalue}"
        print(
            f"ckptkit: notebook {find_notebook(args.name)} failed in cell {exc.exec_count}: "
            f"{printable(failure)} (the executed part is in {printable(output)})",
            file=sys.stderr,
        )
        return EXIT_FAILED
    for path in written:
        print(path)
    return 0
