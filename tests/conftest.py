"""Shared fixtures: real checkpoints written once per test session by torch's own DCP code."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # test helpers: oracle.py, writers.py

import s3server  # noqa: E402
import writers  # noqa: E402


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
