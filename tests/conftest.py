"""Shared fixtures (real checkpoints written once per test session by torch's own DCP code), and
the test categories the lanes select on (``make test-fast`` / ``make test``, tests/README.md)."""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path
from typing import NamedTuple

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # test helpers: oracle.py, writers.py

import s3server  # noqa: E402
import writers  # noqa: E402

__all__ = ["CATEGORIES", "Category", "Written", "categories_of"]

# -- test categories ----------------------------------------------------------------------------
#
# Markers come from this one table, not from each test file. A test gets a row's marker when its
# node id matches the row's pattern (``*`` is the only wildcard; the ``[`` of parameter ids is
# literal) and, if the row names a fixture, the test uses that fixture (directly or through
# another). Tests no row matches are fast. ``make test-fast`` deselects
# ``notebooks or ranks or browser or slow``. The rows come from a full ``--durations=0`` run on
# 2 busy cores: the ``slow`` ones took 5-30 s each there, most tests well under a second.
#
# ``ranks``: starts torch.distributed rank processes of its own (torchrun, env://, mp.spawn), or
# needs a checkpoint that spawned ranks write. One exception: the session's shared 2-rank sample
# ``written("fsdp2_ws2")`` (the ``ws2`` fixture; ``mutant`` and ``unsharded`` derive from it in
# this process), one spawn of a few seconds that some 200 fast tests share.

#: Conformance case ids (tests/conformance_cases.py) whose checkpoints spawned ranks write; every
#: test parametrised by one (test_conformance, test_numbers, test_round_trip…) needs that job.
SPAWNED_CASES = (
    "dcp-empty-chunks-ws4",
    "dcp-no-collectives",
    "dcp-zstd",
    "dcp-safetensors-serialization",
    "rank-files-",  # every per-rank-files case: FSDP1/FSDP2/HF, verl, accelerate jobs
    "hf-dcp-sharded",
)
#: ``writers.VARIANTS`` written by spawned ranks, other than the shared ``fsdp2_ws2``.
SPAWNED_VARIANTS = (
    "fsdp2_ws4",
    "column_sharded",
    "empty_chunks",
    "no_collectives",
    "zstd",
    "safetensors_format",
)


class Category(NamedTuple):
    """One row of :data:`CATEGORIES`."""

    marker: str
    pattern: str  # node id, ``*`` the only wildcard
    why: str
    fixture: str | None = None  # and the test uses this fixture (directly or not)


R = Category
CATEGORIES: list[Category] = [
    # -- notebooks: a Jupyter kernel per notebook run
    R("notebooks", "notebooks/*", "nbval: every notebook on the sample (make test)"),
    R(
        "notebooks",
        "tests/test_notebooks.py::test_0*",
        "papermill: on a DCP, OLMo, OLMo-core, DeepSpeed, Megatron",
    ),
    R("notebooks", "tests/test_notebook_runs.py::test_cli_runs_*", "papermill via the CLI"),
    # -- browser
    R("browser", "tests/test_browser.py::*", "Voila server + Chromium driven by Playwright"),
    # -- ranks: jobs the test starts
    R("ranks", "tests/test_distributed.py::test_two_*", "torchrun / c10d 2-rank jobs"),
    R("ranks", "tests/test_distributed.py::test_a_*_rank_*", "failing, killed, hung ranks"),
    R("ranks", "tests/test_scale.py::*torchrun*", "the API under torchrun, 2 and 4 ranks"),
    R("ranks", "tests/test_uploads.py::*torchrun*", "torchrun ranks sharing one S3 upload"),
    R("ranks", "tests/test_scale.py::test_a_rank_killed_*", "torchrun, one rank killed"),
    R("ranks", "tests/test_scale.py::test_cli_on_two_hosts_*", "two torchrun agents, S3"),
    R("ranks", "tests/test_convert.py::*_by_torch_at_two_ranks", "torch loads at 2 ranks"),
    # -- ranks: checkpoints spawned ranks write (conformance cases, variants, fixtures)
    *[R("ranks", f"*[{case}*", "conformance case written by ranks") for case in SPAWNED_CASES],
    *[R("ranks", f"*[{name}]", "writers.VARIANTS written by ranks") for name in SPAWNED_VARIANTS],
    R("ranks", "*", "a torch-free run over every conformance case", fixture="torch_blocked"),
    R("ranks", "*", "ws2 re-saved from 4 spawned ranks", fixture="ws4_resave"),
    R("ranks", "tests/test_notebooks.py::*", "the notebooks' samples", fixture="sample"),
    R("ranks", "tests/test_run.py::*", "a 4-step run trained by ranks", fixture="trained_run"),
    R(
        "ranks",
        "tests/test_errors_and_cache.py::*",
        "a 2-step run trained by ranks",
        fixture="run_folder",
    ),
    R("ranks", "tests/test_many_chunks.py::*", "many chunks from 2 ranks", fixture="many"),
    R("ranks", "tests/test_formats_hf_dcp.py::*", "HF writer, 2 ranks", fixture="hf_written"),
    R("ranks", "tests/test_formats_legacy.py::*", "FSDP1 rank files", fixture="fsdp1"),
    R("ranks", "tests/test_formats_legacy.py::*", "FSDP2 rank files", fixture="fsdp2"),
    R("ranks", "tests/test_formats_per_rank.py::*", "verl, Accelerate files", fixture="root"),
    R("ranks", "tests/test_dcp.py::test_tables_describe_fsdp2_sharding", "fsdp2_ws4"),
    R("ranks", "tests/test_dcp.py::test_column_sharded_chunks", "column_sharded"),
    R("ranks", "tests/test_dcp.py::test_empty_chunks_are_listed_and_read", "empty_chunks"),
    R("ranks", "tests/test_dcp.py::test_rank_local_metadata_*", "no_collectives"),
    R("ranks", "tests/test_dcp.py::test_safetensors_serialization_*", "safetensors_format"),
    R("ranks", "tests/test_convert.py::test_unshard_safetensors_format_*", "safetensors_format"),
    R("ranks", "tests/test_damage.py::test_metadata_of_another_run_*", "fsdp2_ws4"),
    R("ranks", "tests/test_metadata_scale.py::test_catalog_objects_skip_*", "fsdp2_ws4"),
    R("ranks", "tests/test_metadata_scale.py::test_chunks_table_lists_*", "empty_chunks"),
    R("ranks", "tests/test_browse.py::test_chunk_layout_covers_*", "column_sharded"),
    # -- slow: one process, but subprocesses or heavy oracles (5-30 s each on 2 busy cores)
    R("slow", "tests/test_atomic_outputs.py::test_sigkill_*", "a killed CLI run and a rerun"),
    R("slow", "tests/test_crash_consistency.py::test_killed_*", "killed at every file op"),
    R("slow", "tests/test_objects.py::test_lightning_checkpoint_unshards_*", "Lightning"),
    R("slow", "tests/test_objects.py::*_carried_through_unshard_*", "torch.load oracle"),
    R("slow", "tests/test_objects.py::test_safetensors_side_file_*", "torch.load oracle"),
    R("slow", "tests/test_objects.py::test_cli_objects_and_exclude_*", "CLI subprocesses"),
    R("slow", "tests/test_cli.py::test_exit_status_*", "CLI subprocesses"),
    R("slow", "tests/test_cli.py::test_selection_options_*", "CLI subprocesses"),
    R("slow", "tests/test_cli.py::test_bad_values_*", "CLI subprocesses"),
    R("slow", "tests/test_cli.py::test_every_command_has_examples_*", "CLI subprocesses"),
    R("slow", "tests/test_cli.py::test_inspect_says_what_the_parameter_*", "CLI subprocesses"),
    R("slow", "tests/test_cli_convert.py::test_unshard_safetensors_model_*", "CLI, bf16"),
    R("slow", "tests/test_cli_convert.py::test_existing_output_is_refused_*", "CLI"),
    R("slow", "tests/test_cli_convert.py::test_convert_to_dcp_is_read_by_*", "CLI + torch"),
    R("slow", "tests/test_formats_deepspeed.py::test_cli_unshard_diff_verify*", "CLI"),
    R("slow", "tests/test_formats_megatron.py::test_cli_verify_diff_unshard", "CLI"),
    R("slow", "tests/test_remote.py::test_cli_storage_options_*", "CLI subprocesses, S3"),
    R("slow", "tests/test_install.py::*", "builds the wheel, installs it in fresh virtualenvs"),
    # -- s3: the session's moto server (started on first use, about a second): in the fast lane
    R("s3", "*", "talks to the session's S3 server", fixture="s3"),
]
del R


def _pattern(glob: str) -> re.Pattern[str]:
    """``glob`` with ``*`` as the only wildcard (node ids hold ``[``, ``]`` literally)."""
    return re.compile(".*".join(map(re.escape, glob.split("*"))))


_COMPILED = [(c.marker, _pattern(c.pattern), c.fixture) for c in CATEGORIES]


def categories_of(nodeid: str, fixturenames: list[str] | tuple[str, ...] = ()) -> set[str]:
    """The markers :data:`CATEGORIES` gives the test ``nodeid`` using ``fixturenames``."""
    return {
        marker
        for marker, pattern, fixture in _COMPILED
        if pattern.fullmatch(nodeid) and (fixture is None or fixture in fixturenames)
    }


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every collected test (tests/ and notebooks/) with its categories; warn of a row that
    names a test file collected whole but matches none of its tests (a test renamed?)."""
    for item in items:
        for marker in sorted(categories_of(item.nodeid, getattr(item, "fixturenames", ()))):
            item.add_marker(marker)
    _warn_of_stale_rows(config, items)


def _warn_of_stale_rows(config: pytest.Config, items: list[pytest.Item]) -> None:
    whole = [Path(arg).resolve() for arg in config.args if "::" not in arg]
    files = {item.nodeid.split("::")[0] for item in items}
    for category, (_, pattern, _) in zip(CATEGORIES, _COMPILED, strict=True):
        file = category.pattern.split("::")[0]
        path = config.rootpath / file
        if "*" in file or file not in files or not any(p in (path, *path.parents) for p in whole):
            continue
        if not any(pattern.fullmatch(item.nodeid) for item in items):
            message = f"tests/conftest.py: {category} matches no test"
            warnings.warn(pytest.PytestConfigWarning(message), stacklevel=1)


# -- shared checkpoints -------------------------------------------------------------------------


class Written:
    """A checkpoint written by torch in this session, with the live state it was saved from."""

    def __init__(self, name: str, path: Path, reference: Path, torch_readable: bool) -> None:
        self.name, self.path, self.reference_path, self.torch_readable = (
            name,
            path,
            reference,
            torch_readable,
        )

    def reference(self) -> dict:
        import torch

        return torch.load(self.reference_path, weights_only=False)


@pytest.fixture(scope="session")
def written(tmp_path_factory):
    """Factory: ``written("fsdp2_ws2")`` writes that variant once and returns a :class:`Written`."""
    cache: dict[str, Written] = {}

    def get(name: str) -> Written:
        if name not in cache:
            writer, kwargs, readable = writers.VARIANTS[name]
            root = tmp_path_factory.mktemp(name)
            writer(root / "ckpt", reference_path=root / "reference.pt", **kwargs)
            cache[name] = Written(name, root / "ckpt", root / "reference.pt", readable)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def ws2(written) -> Written:
    """The FSDP2 sample at two ranks, ``written("fsdp2_ws2")`` (diff, sizes and plot tests)."""
    return written("fsdp2_ws2")


@pytest.fixture(scope="session")
def mutant(ws2, tmp_path_factory) -> Path:
    """ws2's reference state with one change of each kind (``writers.mutant_state``), saved by
    a single-process ``dcp.save``."""
    return writers.write_mutant(tmp_path_factory.mktemp("mutant") / "ckpt", ws2.reference())


@pytest.fixture(scope="session")
def ws4_resave(ws2, tmp_path_factory) -> Path:
    """ws2's model re-saved from 4 ranks, split by columns where they divide
    (``writers.write_resave``); written once for the diff and stats tests."""
    path = tmp_path_factory.mktemp("resave") / "ws4"
    writers.write_resave(path, ws2.reference_path, 4)
    return path


@pytest.fixture(scope="session")
def unsharded(ws2, tmp_path_factory) -> Path:
    """ws2 unsharded by ckptkit: ``<root>/st`` (safetensors) and ``<root>/pt`` (torch.save)."""
    import ckptkit

    root = tmp_path_factory.mktemp("unsharded")
    ckptkit.unshard(str(ws2.path), str(root / "st"), to="safetensors", progress=False)
    ckptkit.unshard(str(ws2.path), str(root / "pt"), progress=False)
    return root


@pytest.fixture(scope="session")
def s3() -> s3server.Server:
    """A real S3-protocol server (moto) on 127.0.0.1 for the session; ``AWS_ENDPOINT_URL`` and
    dummy credentials are exported, and ``s3.traffic`` logs requests and injects failures."""
    return s3server.shared()


def pytest_collection_finish(session) -> None:
    """Notebooks that use S3 (mention ``AWS_ENDPOINT_URL``) get the session's server: start it
    before their kernels start, so they inherit its address."""
    notebooks = {Path(str(item.fspath)) for item in session.items}
    if any(p.suffix == ".ipynb" and "AWS_ENDPOINT_URL" in p.read_text() for p in notebooks):
        s3server.shared()


def pytest_sessionfinish(session) -> None:
    s3server.stop_shared()
