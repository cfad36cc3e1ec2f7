"""The package as users install it: the wheel and sdist built from this checkout, installed into
fresh virtualenvs, exactly as the README's "Install" section says.

* The wheel holds the package and the notebooks (``ckptkit/notebooks/*.ipynb``), no tests or
  fixtures; its metadata passes ``twine check`` and names the base dependencies and extras.
* The base install (no extras) has no torch, and its ``ckptkit`` inspects, verifies, unshards
  (to safetensors and torch.save), diffs, sizes and computes statistics of a DeepSpeed and a
  DCP fixture; ``read_numpy`` gives the writing projects' bytes; whatever needs an extra
  (``read()``, ``s3://``, ``convert --to dcp``, a notebook run) is a ``MissingExtraError``
  naming the ``pip install 'torch-ckptkit[…]'`` line. The same smoke runs on every other
  CPython 3.12 / 3.13 found on the machine.
* The ``[torch]`` install loads those outputs with torch and safetensors, and ``read()`` works.

Slow (a build and three or four virtualenvs): tests/conftest.py marks the file ``slow``. pip's
cache and find-links (``/opt/wheels`` here) make the installs fast after the first.
"""

from __future__ import annotations

import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import ckptkit

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
#: name → (checkpoint, {output file stem: reference file in reference/tensors.sha256.json})
CHECKPOINTS = {
    "deepspeed": (
        FIXTURES / "deepspeed_zero2_ws2" / "checkpoint",
        {"model": "reference/zero_to_fp32_out/pytorch_model.bin"},
    ),
    "dcp": (
        FIXTURES / "dcp_torch22_fsdp1_ws2" / "checkpoint",
        {"model": "model.pt", "optim": "optim.pt", "train": "train.pt"},
    ),
}
BASE_REQUIREMENTS = {"numpy", "pandas", "fsspec", "safetensors", "pyyaml", "zstandard", "tqdm"}
#: What only extras may bring: the packages behind MissingExtraError (ckptkit/extras.py).
EXTRA_ONLY = {"torch", "s3fs", "gcsfs", "pyarrow", "matplotlib", "ipywidgets", "papermill"}
EXTRAS = {"torch", "s3", "gcs", "runs", "notebooks", "all", "test", "dev"}
#: The torch the [torch] install gets first (a CPU build; see the README and the Makefile).
TORCH_SPEC = "torch==2.13.0"
#: Other interpreters the base install is smoke-tested on, when the machine has them.
OTHER_PYTHONS = ("3.12", "3.13")


def _env() -> dict[str, str]:
    """The environment for commands in the new virtualenvs: nothing pointing at this checkout
    or at the test's own virtualenv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(command: list[str], cwd: Path, *, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def _ok(command: list[str], cwd: Path, *, timeout: float = 900) -> str:
    result = _run(command, cwd, timeout=timeout)
    assert result.returncode == 0, f"{command}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


class Venv:
    """A fresh virtualenv (``python -m venv``) with its interpreter and ``ckptkit`` command."""

    def __init__(self, path: Path, python: str) -> None:
        _ok([python, "-m", "venv", str(path)], path.parent, timeout=300)
        self.path = path
        self.python = str(path / "bin" / "python")
        self.work = path.parent / f"{path.name}-work"  # cwd of every command: not the checkout
        self.work.mkdir()

    def pip_install(self, *requirements: str) -> None:
        _ok([self.python, "-m", "pip", "install", "-q", *requirements], self.work)

    def ckptkit(self, *args: object) -> subprocess.CompletedProcess:
        return _run([str(self.path / "bin" / "ckptkit"), *map(str, args)], self.work)

    def script(self, source: str, *args: object) -> str:
        return _ok([self.python, "-c", source, *map(str, args)], self.work)


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    """``python -m build`` (the README's line) into a folder of the test's: sdist, then the
    wheel built from that sdist."""
    out = tmp_path_factory.mktemp("dist")
    _ok([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], out)
    (wheel,) = out.glob("torch_ckptkit-*.whl")
    (sdist,) = out.glob("torch_ckptkit-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


@pytest.fixture(scope="module")
def base(tmp_path_factory, dist) -> Venv:
    """The base install, with this interpreter's version: the wheel and no extra."""
    venv = Venv(tmp_path_factory.mktemp("base") / "venv", sys.executable)
    venv.pip_install(str(dist["wheel"]))
    return venv


@pytest.fixture(scope="module")
def unsharded(base) -> dict[str, dict[str, Path]]:
    """Each checkpoint unsharded by the base install, to safetensors and to torch.save."""
    outputs: dict[str, dict[str, Path]] = {}
    for name, (checkpoint, _) in CHECKPOINTS.items():
        outputs[name] = {}
        for to in ("safetensors", "torch"):
            destination = base.work / f"{name}-{to}"
            result = base.ckptkit("unshard", checkpoint, destination, "--to", to, "--quiet")
            assert result.returncode == 0, result.stderr
            assert "wrote " in result.stdout, result.stdout
            outputs[name][to] = destination
    return outputs


def _reference(checkpoint: Path) -> dict[str, dict[str, dict]]:
    return json.loads((checkpoint.parent / "reference" / "tensors.sha256.json").read_text())


def _expected_numpy_hashes(name: str) -> dict[str, str]:
    """``{ckptkit key: sha256}`` of every reference tensor of the checkpoint."""
    checkpoint, _ = CHECKPOINTS[name]
    reference = _reference(checkpoint)
    if name == "deepspeed":  # model.* = the fp32 master weights, as zero_to_fp32 writes them
        files = {"model": reference["reference/zero_to_fp32_out/pytorch_model.bin"]}
    else:
        files = {file.removesuffix(".pt"): specs for file, specs in reference.items()}
    return {
        f"{g}.{key}": spec["sha256"] for g, specs in files.items() for key, spec in specs.items()
    }


# -- the wheel and the sdist -------------------------------------------------------------------


def test_wheel_holds_the_package_and_notebooks_and_no_tests(dist):
    with zipfile.ZipFile(dist["wheel"]) as wheel:
        names = wheel.namelist()
        notebooks = {
            Path(n).name: wheel.read(n) for n in names if n.startswith("ckptkit/notebooks/")
        }
        info = f"torch_ckptkit-{ckptkit.__version__}.dist-info"
        metadata = email.parser.Parser().parsestr(wheel.read(f"{info}/METADATA").decode())
        entry_points = wheel.read(f"{info}/entry_points.txt").decode()
    shipped = {p.name: p.read_bytes() for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert len(shipped) >= 9 and notebooks == shipped
    assert "ckptkit/__init__.py" in names and "ckptkit/notebook_runs.py" in names
    unwanted = [n for n in names if re.search(r"(^|/)(tests|fixtures|__pycache__)/|conftest", n)]
    assert not unwanted, unwanted
    top = {n.split("/")[0] for n in names}
    assert top == {"ckptkit", info}, top

    assert metadata["Name"] == "torch-ckptkit"
    assert metadata["Version"] == ckptkit.__version__
    requires = metadata.get_all("Requires-Dist")
    base = {re.split(r"[\[<>=;\s]", r)[0].lower() for r in requires if "extra ==" not in r}
    assert base >= BASE_REQUIREMENTS and not base & EXTRA_ONLY, base
    assert set(metadata.get_all("Provides-Extra")) == EXTRAS
    torch_extra = [r for r in requires if r.endswith("extra == 'torch'")]
    assert [r.split(";")[0] for r in torch_extra] == ["torch>=2.4"]
    assert "ckptkit = ckptkit.cli:main" in entry_points


def test_sdist_builds_the_same_package_and_metadata_checks(dist):
    with tarfile.open(dist["sdist"]) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "CHANGELOG.md", "ckptkit/__init__.py"} <= names
    assert {f"notebooks/{p.name}" for p in (ROOT / "notebooks").glob("*.ipynb")} <= names
    _ok([sys.executable, "-m", "twine", "check", "--strict", *map(str, dist.values())], ROOT)


# -- the base install: no torch ---------------------------------------------------------------

BASE_API = r"""
import hashlib, json, sys
import ckptkit

result = {"file": ckptkit.__file__, "hashes": {}, "errors": {}}
for path in sys.argv[1:]:
    ckpt = ckptkit.open(path)
    for entry in ckpt.catalog.tensors():
        result["hashes"][f"{path}|{entry.key}"] = hashlib.sha256(
            ckpt.read_numpy(entry.key).tobytes()
        ).hexdigest()
    try:
        ckpt.read(ckpt.catalog.tensors()[0].key)
    except ckptkit.MissingExtraError as exc:
        result["errors"]["read"] = [str(exc), exc.extra, isinstance(exc, ImportError)]
for name, call in {
    "s3": lambda: ckptkit.open("s3://bucket/run/step1"),
    "gcs": lambda: ckptkit.open("gs://bucket/run/step1"),
    "browse": lambda: ckptkit.browse(sys.argv[1]),
    "runs": lambda: ckptkit.run(sys.argv[1]).stats(),  # DeepSpeed's folder holds global_step2/
}.items():
    try:
        call()
    except ckptkit.MissingExtraError as exc:
        result["errors"][name] = [str(exc), exc.extra, isinstance(exc, ImportError)]
result["torch_imported"] = "torch" in sys.modules
print(json.dumps(result))
"""


def test_base_install_has_no_torch(base):
    result = _run([base.python, "-c", "import torch"], base.work)
    assert result.returncode == 1 and "No module named 'torch'" in result.stderr
    assert base.ckptkit("--version").stdout.strip() == f"ckptkit {ckptkit.__version__}"


def test_base_install_inspects_verifies_and_diffs_without_torch(base, unsharded):
    formats = {"deepspeed": "deepspeed_zero", "dcp": "dcp"}
    for name, (checkpoint, _) in CHECKPOINTS.items():
        shown = base.ckptkit("inspect", checkpoint, "--json")
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["format"] == formats[name]
        assert base.ckptkit("inspect", checkpoint).returncode == 0
        verified = base.ckptkit("verify", checkpoint, "--json")
        assert verified.returncode == 0, verified.stdout + verified.stderr
        for to, output in unsharded[name].items():
            compared = base.ckptkit("diff", checkpoint, output)
            assert compared.returncode == 0, (to, compared.stdout, compared.stderr)
            assert "equal" in compared.stdout
            assert base.ckptkit("verify", output).returncode == 0, to
        sizes = base.ckptkit("sizes", checkpoint, unsharded[name]["safetensors"], "--json")
        assert sizes.returncode == 0, sizes.stderr
        stats = base.ckptkit("stats", checkpoint, "--json", "--quiet")
        assert stats.returncode == 0, stats.stderr
        rows = json.loads(stats.stdout)["tensors"]
        assert [row["key"] for row in rows] == _all_keys(base, checkpoint), name
        converted = base.ckptkit(
            "convert", unsharded[name]["torch"], base.work / f"{name}-converted",
            "--to", "safetensors", "--quiet",
        )  # fmt: skip
        assert converted.returncode == 0, converted.stderr


def _all_keys(venv: Venv, checkpoint: Path) -> list[str]:
    shown = venv.ckptkit("inspect", checkpoint, "--json")
    return [t["key"] for t in json.loads(shown.stdout)["tensors"]]


def test_base_install_reads_numpy_and_names_the_extras_it_lacks(base):
    paths = [str(checkpoint) for checkpoint, _ in CHECKPOINTS.values()]
    result = json.loads(base.script(BASE_API, *paths))
    assert Path(result["file"]).is_relative_to(base.path), result["file"]  # not the checkout
    assert not result["torch_imported"]
    for name in CHECKPOINTS:
        checkpoint = str(CHECKPOINTS[name][0])
        seen = {k.split("|")[1]: v for k, v in result["hashes"].items() if k.startswith(checkpoint)}
        expected = _expected_numpy_hashes(name)
        assert {key: seen[key] for key in expected} == expected, name
    wanted = {"read": "torch", "s3": "s3", "gcs": "gcs", "browse": "notebooks", "runs": "runs"}
    assert set(result["errors"]) == set(wanted)
    for call, extra in wanted.items():
        message, named, is_import_error = result["errors"][call]
        assert named == extra and is_import_error
        assert f"pip install 'torch-ckptkit[{extra}]'" in message, message


def test_base_install_commands_that_need_an_extra_say_which(base):
    checkpoint = CHECKPOINTS["dcp"][0]
    needs = {
        "torch": ["convert", checkpoint, base.work / "to-dcp", "--to", "dcp", "--quiet"],
        "s3": ["inspect", "s3://bucket/run/step1"],
        "notebooks": ["notebook", "03", checkpoint],
    }
    for extra, command in needs.items():
        result = base.ckptkit(*command)
        assert result.returncode == 2, (command, result.stdout, result.stderr)
        line = f"pip install 'torch-ckptkit[{extra}]'"
        assert result.stderr.startswith("ckptkit: error: ") and line in result.stderr, command
        assert result.stderr.count("\n") == 1, result.stderr  # one line, no traceback
    assert not (base.work / "to-dcp").exists()
    copied = base.ckptkit("notebooks", base.work / "notebooks")
    assert copied.returncode == 0, copied.stderr
    shipped = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert sorted(p.name for p in (base.work / "notebooks").iterdir()) == shipped
    for name in shipped:
        assert (base.work / "notebooks" / name).read_bytes() == (
            ROOT / "notebooks" / name
        ).read_bytes()


def _python(version: str) -> str | None:
    """A working CPython ``version`` on this machine (on PATH, Debian's, or pyenv's), if any."""
    home = Path.home()
    candidates = [
        shutil.which(f"python{version}"),
        f"/usr/bin/python{version}",
        f"/usr/local/bin/python{version}",
        *sorted(map(str, home.glob(f".pyenv/versions/{version}.*/bin/python{version}"))),
    ]
    for candidate in candidates:
        if candidate is None or not os.access(candidate, os.X_OK):
            continue
        result = subprocess.run(
            [candidate, "-c", "import sys, venv; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
        )
        if result.returncode == 0 and result.stdout.strip() == version:
            return candidate
    return None


@pytest.mark.parametrize("version", OTHER_PYTHONS)
def test_base_install_on_other_pythons(version, dist, tmp_path):
    python = _python(version)
    if python is None:
        pytest.skip(f"no CPython {version} on this machine")
    venv = Venv(tmp_path / "venv", python)
    venv.pip_install(str(dist["wheel"]))
    assert _run([venv.python, "-c", "import torch"], venv.work).returncode == 1
    for name, (checkpoint, _) in CHECKPOINTS.items():
        for command in (["inspect", checkpoint], ["verify", checkpoint]):
            result = venv.ckptkit(*command)
            assert result.returncode == 0, (version, command, result.stderr)
        out = venv.work / name
        result = venv.ckptkit("unshard", checkpoint, out, "--to", "safetensors", "--quiet")
        assert result.returncode == 0, (version, result.stderr)
        assert venv.ckptkit("diff", checkpoint, out).returncode == 0, version
        assert venv.ckptkit("stats", checkpoint, "--csv", "--quiet").returncode == 0, version
    result = json.loads(venv.script(BASE_API, *(c for c, _ in CHECKPOINTS.values())))
    for name, (checkpoint, _) in CHECKPOINTS.items():
        seen = {k.split("|")[1]: v for k, v in result["hashes"].items() if str(checkpoint) in k}
        expected = _expected_numpy_hashes(name)
        assert {key: seen[key] for key in expected} == expected, (version, name)
    assert len(result["errors"]) == 5 and not result["torch_imported"]


# -- the [torch] install ------------------------------------------------------------------------

TORCH_LOAD = r"""
import hashlib, json, sys
import torch
from safetensors.torch import load_file
import ckptkit

def sha(tensor):
    return hashlib.sha256(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                          .tobytes()).hexdigest()

safetensors_dir, torch_dir, checkpoint, key = sys.argv[1:5]
seen = {}
for stem in sys.argv[5:]:
    seen[stem] = {k: sha(v) for k, v in load_file(f"{safetensors_dir}/{stem}.safetensors").items()}
model = torch.load(f"{torch_dir}/model.pt", weights_only=True, map_location="cpu")
flat = {}
def walk(prefix, value):
    if isinstance(value, dict):
        for k, v in value.items():
            walk(f"{prefix}{k}.", v)
    elif isinstance(value, torch.Tensor):
        flat[prefix[:-1]] = sha(value)
walk("", model)
tensor = ckptkit.open(checkpoint).read(key)
print(json.dumps({"safetensors": seen, "torch_model": flat, "read": [type(tensor).__name__,
      sha(tensor)], "torch": torch.__version__}))
"""


def test_torch_extra_loads_what_the_base_install_wrote(tmp_path, dist, unsharded):
    venv = Venv(tmp_path / "venv", sys.executable)
    venv.pip_install(TORCH_SPEC, f"{dist['wheel']}[torch]")
    for name, (checkpoint, files) in CHECKPOINTS.items():
        reference = _reference(checkpoint)
        expected = _expected_numpy_hashes(name)
        key = sorted(expected)[0]
        out = json.loads(
            venv.script(
                TORCH_LOAD,
                unsharded[name]["safetensors"],
                unsharded[name]["torch"],
                checkpoint,
                key,
                *files,
            )
        )
        assert out["torch"].startswith(TORCH_SPEC.split("==")[1])
        for stem, reference_file in files.items():
            want = {k: spec["sha256"] for k, spec in reference[reference_file].items()}
            got = out["safetensors"][stem]
            assert {k: got.get(k) for k in want} == want, (name, stem)
        model = {k.removeprefix("model."): v for k, v in expected.items() if k.startswith("model.")}
        assert {k: out["torch_model"].get(k) for k in model} == model, name
        assert out["read"] == ["Tensor", expected[key]], (name, key)


# -- the README's Install section -------------------------------------------------------------


def _install_commands() -> list[str]:
    """The commands of the README's "Install" section's code blocks (comments dropped)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = re.search(r"^## Install\n(.*?)^## ", text, re.MULTILINE | re.DOTALL)
    assert section, "README.md has no '## Install' section"
    commands = []
    for block in re.findall(r"^```(?:bash|sh)\n(.*?)^```", section.group(1), re.M | re.DOTALL):
        for line in block.splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            if line:
                commands.append(re.sub(r"\s+", " ", line))
    return commands


def test_readme_install_lines_are_what_this_test_runs(dist):
    commands = _install_commands()
    wheel = f"dist/{dist['wheel'].name}"
    assert "python -m build" in commands  # the dist fixture, into a folder of its own
    assert f"pip install {wheel}" in commands  # the base fixture
    assert f"pip install {TORCH_SPEC} '{wheel}[torch]'" in commands  # the [torch] test
    assert "conda env create -f environment.yml" in commands
    # make demo / make test come first (the checkout's two commands), then the pip lines
    assert commands[:2] == ["make demo", "make test"]
    assert not [c for c in commands[2:] if c.startswith("make ")]
