"""Consistency checks between pyproject.toml, environment.yml and README.md.

pyproject.toml is the source of truth for dependencies; environment.yml (conda-forge)
must list the same runtime and test dependencies, with compatible lower bounds; the
README's quick start must be `make demo` then `make test`.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]

# conda-forge package name -> pip distribution name (None: not a Python distribution).
CONDA_TO_PIP: dict[str, str | None] = {
    "pytorch": "torch",
    "python-isal": "isal",
    "python-build": "build",
    "python": None,
    "pip": None,
}

_CONDA_SPEC = re.compile(r"^\s*(?P<name>[A-Za-z0-9][A-Za-z0-9_.\-]*)\s*(?P<spec>.*?)\s*$")


def _lower_bound(spec: str) -> Version | None:
    """The highest `>=` (or `==`/`>`) version in a pip or conda version spec, if any."""
    bounds = [
        Version(m.group(2))
        for m in re.finditer(r"(>=|==|>|=)\s*([0-9][0-9A-Za-z.]*)", spec)
        if not m.group(2).endswith(".")
    ]
    return max(bounds) if bounds else None


def _load_pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _load_env() -> dict:
    with open(ROOT / "environment.yml", encoding="utf-8") as f:
        return yaml.safe_load(f)


def _pip_reqs(strings: list[str]) -> dict[str, Requirement]:
    reqs = {}
    for s in strings:
        r = Requirement(s)
        if canonicalize_name(r.name) == "torch-ckptkit":  # self-reference, e.g. [all]
            continue
        reqs[canonicalize_name(r.name)] = r
    return reqs


def _conda_deps(env: dict) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(pip-name -> version spec, conda-only name -> spec, pip: section entries)."""
    mapped: dict[str, str] = {}
    skipped: dict[str, str] = {}
    pip_section: list[str] = []
    for dep in env.get("dependencies") or []:
        if isinstance(dep, dict):
            assert set(dep) == {"pip"}, f"unexpected mapping in environment.yml dependencies: {dep}"
            pip_section.extend(dep["pip"] or [])
            continue
        m = _CONDA_SPEC.match(str(dep))
        assert m, f"cannot parse conda dependency {dep!r}"
        name, spec = m.group("name").lower(), m.group("spec")
        if "::" in name:  # channel::package
            name = name.split("::", 1)[1]
        pip_name = CONDA_TO_PIP.get(name, name)
        if pip_name is None:
            skipped[name] = spec
        else:
            key = canonicalize_name(pip_name)
            assert key not in mapped, f"{dep!r} listed twice in environment.yml"
            mapped[key] = spec
    return mapped, skipped, pip_section


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return _load_pyproject()


@pytest.fixture(scope="module")
def env() -> dict:
    return _load_env()


def test_environment_yml_header(env):
    assert env.get("name") == "ckptkit", (
        f"environment.yml name should be 'ckptkit': {env.get('name')!r}"
    )
    assert env.get("channels") == ["conda-forge"], (
        f"environment.yml should use conda-forge only, got channels={env.get('channels')!r}"
    )


def test_env_covers_pyproject_runtime_and_test_deps(pyproject, env):
    project = pyproject["project"]
    runtime = _pip_reqs(project["dependencies"])
    test_extra = _pip_reqs(project["optional-dependencies"]["test"])
    conda, _, _ = _conda_deps(env)

    for label, reqs in (("runtime dependency", runtime), ("`test` extra", test_extra)):
        for name, req in reqs.items():
            assert name in conda, (
                f"pyproject {label} {str(req)!r} is missing from environment.yml "
                f"(conda names are mapped via {CONDA_TO_PIP}; add it there)"
            )
            want = _lower_bound(str(req.specifier))
            if want is None:
                continue
            have = _lower_bound(conda[name])
            assert have is not None, (
                f"pyproject requires {str(req)!r} but environment.yml has no lower bound for "
                f"{name!r} (spec {conda[name]!r}); add e.g. '>={want}'"
            )
            assert have >= want, (
                f"environment.yml allows {name} {conda[name]!r}, older than pyproject's {str(req)!r}"
            )


def test_env_has_nothing_pyproject_lacks(pyproject, env):
    project = pyproject["project"]
    known = set(_pip_reqs(project["dependencies"]))
    for extra in project.get("optional-dependencies", {}).values():
        known |= set(_pip_reqs(extra))
    conda, _, _ = _conda_deps(env)
    extra_in_env = sorted(set(conda) - known)
    assert not extra_in_env, (
        f"environment.yml lists {extra_in_env}, which pyproject.toml declares neither as a "
        "dependency nor in an extra; add them to pyproject.toml or drop them"
    )


def test_env_python_and_pip_section(pyproject, env):
    _, skipped, pip_section = _conda_deps(env)
    assert "python" in skipped, "environment.yml should pin python"
    want = _lower_bound(pyproject["project"]["requires-python"])
    have = _lower_bound(skipped["python"])
    assert want is not None and have is not None and have >= want, (
        f"environment.yml python{skipped['python']} does not match requires-python "
        f"{pyproject['project']['requires-python']!r}"
    )
    assert SpecifierSet(pyproject["project"]["requires-python"]).contains(str(have))
    assert "pip" in skipped, "environment.yml needs `pip` for its pip: section"
    assert any(re.fullmatch(r"-e\s+\.(\[[\w,\s-]+\])?", e.strip()) for e in pip_section), (
        f"environment.yml pip: section should install the project editable (-e .), got {pip_section}"
    )


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every ``` fenced code block."""
    return [
        (m.group(1).strip().lower(), m.group(2))
        for m in re.finditer(r"^```([^\n`]*)\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    ]


def _commands(body: str) -> list[str]:
    cmds = []
    for line in body.splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:].strip()
        line = re.sub(r"(^|\s)#.*$", "", line).strip()  # drop comments
        if line:
            cmds.append(re.sub(r"\s+", " ", line))
    return cmds


def test_readme_quick_start_is_make_demo_then_make_test():
    readme = ROOT / "README.md"
    assert readme.is_file(), "README.md is missing (it should start with `make demo` / `make test`)"
    blocks = [
        _commands(body)
        for info, body in _fenced_blocks(readme.read_text(encoding="utf-8"))
        if info.split()[:1] in (["bash"], ["sh"], ["shell"], ["console"])
    ]
    assert blocks, "README.md has no ```bash fenced code block"
    for cmds in blocks:
        if "make demo" in cmds and "make test" in cmds:
            assert cmds.index("make demo") < cmds.index("make test"), (
                f"README.md: `make demo` should come before `make test` in {cmds}"
            )
            break
    else:
        raise AssertionError(
            f"README.md needs a ```bash block with `make demo` then `make test`; bash blocks: {blocks}"
        )
    first_make = [c for cmds in blocks for c in cmds if c.startswith("make ")][:2]
    assert first_make == ["make demo", "make test"], (
        f"README.md's first two make commands should be `make demo`, `make test`, got {first_make}"
    )
