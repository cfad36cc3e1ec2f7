"""The format conformance suite: one contract, run on every format adapter's real checkpoints.

Like fsspec's abstract filesystem tests, every contract item below is parametrised over every
case of ``conformance_cases.CASES`` (checked-in fixtures and checkpoints written by torch in this
session), so a new format gets the whole contract by adding its case there.
``test_every_adapter_has_a_case`` fails when an adapter has none.

Contract items: detection verdict; catalog invariants; tensors bit-equal to the oracle; unshard
round trip to safetensors and torch; diff with itself all equal; verify clean; inspection with
torch blocked. Known failures are listed in ``KNOWN_FAILURES`` as strict xfails.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptkit
from ckptkit.catalog.model import Chunk, Entry, Record

from conformance_cases import CASES, Case, Oracle, Workspace, expected_matches, size_on_disk
from isolated import run_script
from oracle import assert_bit_equal

_TUPLE_KEYS = (
    "DCP pickles the tuple train.tensor_tuple = (tensor, 5) whole: one object entry; the unshard "
    "output keeps it as that tuple (as dcp_to_torch_save does), but the torch_save adapter (also "
    "used for <group>.objects.pt) walks tuples holding tensors, so it reopens as a tensor "
    "train.tensor_tuple.0 plus an object train.tensor_tuple.1: keys change in the round trip "
    "(and diff(src, out) reports only_a/only_b for them)"
)
#: The contract items, as ``KNOWN_FAILURES`` names them.
CONTRACTS = (
    "detect",
    "catalog",
    "oracle",
    "unshard-safetensors",
    "unshard-torch",
    "diff",
    "verify",
    "torch-blocked",
)
#: (case id, contract item) → why it fails today; each becomes a strict xfail of that one test.
KNOWN_FAILURES: dict[tuple[str, str], str] = {
    ("dcp-single-process", "unshard-safetensors"): _TUPLE_KEYS,
    ("dcp-single-process", "unshard-torch"): _TUPLE_KEYS,
}


def cases(contract: str, *extra: str) -> list:
    """Every case as a pytest param of ``contract``, strict-xfailed where ``KNOWN_FAILURES``
    says so (``extra``: further arguments of each param, appended to its id)."""
    assert contract in CONTRACTS, contract
    params = []
    for case in CASES:
        reason = KNOWN_FAILURES.get((case.id, contract))
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        params.append(pytest.param(case, *extra, id="-".join((case.id, *extra)), marks=marks))
    return params


class Subject:
    """One case made concrete: its path, the checkpoint opened once, its oracle, its tensors."""

    def __init__(self, case: Case, path: Path, workspace: Workspace) -> None:
        self.case = case
        self.path = path
        self.ckpt = ckptkit.open(str(path))
        self.oracle: Oracle = case.oracle(workspace, self.path)

    @cached_property
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the checkpoint, read once (the fixtures are small)."""
        return {e.key: self.ckpt.read(e.key) for e in self.ckpt.catalog.tensors()}


class Subjects:
    def __init__(self, workspace: Workspace) -> None:
        self.workspace = workspace
        self._paths: dict[str, Path] = {}
        self._made: dict[str, Subject] = {}

    def path(self, case: Case) -> Path:
        """The case's checkpoint, written first if need be (not opened)."""
        if case.id not in self._paths:
            self._paths[case.id] = Path(case.locate(self.workspace))
        return self._paths[case.id]

    def __getitem__(self, case: Case) -> Subject:
        if case.id not in self._made:
            self._made[case.id] = Subject(case, self.path(case), self.workspace)
        return self._made[case.id]


@pytest.fixture(scope="module")
def subjects(written, tmp_path_factory) -> Subjects:
    return Subjects(Workspace(written, tmp_path_factory.mktemp("conformance")))


# --------------------------------------------------------------------------------------------
# Coverage of the suite itself.


def test_every_adapter_has_a_case():
    formats = {case.format for case in CASES}
    missing = set(ckptkit.formats.ADAPTERS) - formats
    assert not missing, f"format adapters without a conformance case: {sorted(missing)}"
    unknown = formats - set(ckptkit.formats.ADAPTERS)
    assert not unknown, f"cases expecting formats ckptkit does not have: {sorted(unknown)}"
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    stale = [key for key in KNOWN_FAILURES if key[0] not in ids or key[1] not in CONTRACTS]
    assert not stale, f"KNOWN_FAILURES names no case or contract item: {stale}"


# --------------------------------------------------------------------------------------------
# 1. Detection.


@pytest.mark.parametrize("case", cases("detect"))
def test_detect(case, subjects):
    subject = subjects[case]
    found = ckptkit.detect(str(subject.path))
    assert found.format == case.format, found
    assert found.evidence, f"{case.id}: detection gave no evidence"
    assert all(isinstance(line, str) and line for line in found.evidence), found.evidence
    assert subject.ckpt.format == case.format


# --------------------------------------------------------------------------------------------
# 2. Catalog invariants.


def _check_chunk_bounds(entry: Entry, chunk: Chunk) -> None:
    key = entry.key
    assert len(chunk.offsets) == len(chunk.sizes), f"{key}: {chunk}"
    assert all(o >= 0 for o in chunk.offsets), f"{key}: negative offset {chunk}"
    assert all(s >= 0 for s in chunk.sizes), f"{key}: negative size {chunk}"
    if chunk.flat:
        assert len(chunk.offsets) == 1, f"{key}: a flat chunk is 1-D: {chunk}"
        assert chunk.offsets[0] + chunk.sizes[0] <= entry.numel, f"{key}: {chunk} past numel"
    else:
        assert len(chunk.offsets) == len(entry.shape), f"{key}: {chunk} vs shape {entry.shape}"
        for o, s, dim in zip(chunk.offsets, chunk.sizes, entry.shape, strict=True):
            assert o + s <= dim, f"{key}: {chunk} outside shape {entry.shape}"
    if chunk.numel > 0:
        assert chunk.record is not None, f"{key}: a chunk with elements has no record: {chunk}"


def _check_tiling(entry: Entry) -> None:
    """Distinct chunks (a box several ranks saved counts once) cover every element exactly once."""
    distinct = {(c.offsets, c.sizes, c.flat): c for c in entry.chunks}
    assert sum(c.numel for c in distinct.values()) == entry.numel, (
        f"{entry.key}: distinct chunks hold {sum(c.numel for c in distinct.values())} "
        f"elements, the tensor {entry.numel}"
    )
    count = np.zeros(entry.shape, dtype=np.int32)
    flat = count.reshape(-1)  # a view: numpy arrays made by zeros are contiguous
    for chunk in distinct.values():
        if chunk.flat:
            flat[chunk.offsets[0] : chunk.offsets[0] + chunk.sizes[0]] += 1
        else:
            region = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
            count[region] += 1
    assert (count == 1).all(), (
        f"{entry.key}: elements covered 0 or 2+ times: "
        f"{int((count == 0).sum())} holes, {int((count > 1).sum())} overlaps"
    )


def _check_record(entry: Entry, record: Record, sizes: dict[str, int], files: set[str]) -> None:
    key = entry.key
    assert record.file in files, f"{key}: record file {record.file!r} not in catalog.files"
    assert record.offset >= 0 and record.length >= 0, f"{key}: {record}"
    assert record.offset + record.length <= sizes[record.file], (
        f"{key}: {record.file} [{record.offset}, +{record.length}) past its "
        f"{sizes[record.file]} bytes"
    )


@pytest.mark.parametrize("case", cases("catalog"))
def test_catalog_invariants(case, subjects):
    subject = subjects[case]
    ckpt, catalog = subject.ckpt, subject.ckpt.catalog
    assert catalog.format == case.format
    assert catalog.entries, f"{case.id}: empty catalog"

    # files: distinct, on disk, and the files table reports their real sizes
    assert len(catalog.files) == len(set(catalog.files)), catalog.files
    on_disk = {f: size_on_disk(ckpt.url, f) for f in catalog.files}
    assert len(ckpt.files) == len(catalog.files)
    assert dict(zip(ckpt.files["file"], ckpt.files["size"], strict=True)) == on_disk

    # entries: keyed by their own key, distinct paths, kinds well formed
    paths = [entry.path for entry in catalog.entries.values()]
    assert len(paths) == len(set(paths)), f"{case.id}: two entries share a path"
    for key, entry in catalog.entries.items():
        assert entry.key == key, f"entry {entry.key!r} filed under {key!r}"
        assert entry.path, f"{key}: empty path"
        if case.key_is_joined_path:
            assert ".".join(map(str, entry.path)) == key, f"{key}: path {entry.path}"
        assert entry.chunks, f"{key}: no chunks"
        if entry.kind == "tensor":
            assert entry.dtype is not None, f"{key}: tensor without dtype"
            assert isinstance(entry.shape, tuple), f"{key}: tensor shape {entry.shape!r}"
            assert all(isinstance(d, int) and d >= 0 for d in entry.shape), f"{key}: {entry.shape}"
            for chunk in entry.chunks:
                _check_chunk_bounds(entry, chunk)
            _check_tiling(entry)
        else:
            assert entry.kind == "object", f"{key}: kind {entry.kind!r}"
            assert entry.dtype is None, f"{key}: object with dtype {entry.dtype}"
            assert all(c.record is not None for c in entry.chunks), f"{key}: object w/o record"
        for chunk in entry.chunks:
            if chunk.record is not None:
                _check_record(entry, chunk.record, on_disk, set(catalog.files))

    # leaves form a tree: no entry's key is also an inner node of another's (``a.b`` and ``a.b.c``)
    keys = set(catalog.entries)
    clashes = [
        (key[:i], key) for key in keys for i, ch in enumerate(key) if ch == "." and key[:i] in keys
    ]
    assert not clashes, f"{case.id}: keys that are prefixes of other keys: {clashes[:5]}"

    # the tables agree with the catalog
    assert sorted(ckpt.tensors["key"]) == sorted(e.key for e in catalog.tensors())
    assert ckpt.tensors["key"].is_unique
    assert len(ckpt.chunks) == sum(len(e.chunks) for e in catalog.tensors())


# --------------------------------------------------------------------------------------------
# 3. Tensors equal the oracle.


@pytest.mark.parametrize("case", cases("oracle"))
def test_tensors_match_oracle(case, subjects):
    subject = subjects[case]
    oracle = subject.oracle
    assert oracle.tensors, f"{case.id}: empty oracle"
    ours = {
        key
        for key in subject.tensors
        if oracle.groups is None or subject.ckpt.entry(key).group in oracle.groups
    }
    assert ours == set(oracle.tensors), (
        f"{case.id}: only in ckptkit {sorted(ours - set(oracle.tensors))[:10]}, "
        f"only in the oracle {sorted(set(oracle.tensors) - ours)[:10]}"
    )
    bad = {
        key: problem
        for key, expected in oracle.tensors.items()
        if (problem := expected_matches(subject.tensors[key], expected)) is not None
    }
    assert not bad, (
        f"{case.id}: {len(bad)} tensors differ from the oracle: {dict(list(bad.items())[:5])}"
    )


# --------------------------------------------------------------------------------------------
# 4. Unshard round trip.


@pytest.mark.parametrize(
    ("case", "to"),
    [*cases("unshard-safetensors", "safetensors"), *cases("unshard-torch", "torch")],
)
def test_unshard_round_trip(case, to, subjects, tmp_path):
    subject = subjects[case]
    out = tmp_path / "out"
    ckptkit.unshard(str(subject.path), str(out), to=to, progress=False)
    back = ckptkit.open(str(out))
    assert back.format == ("safetensors" if to == "safetensors" else "torch_save")
    keys = {e.key for e in back.catalog.tensors()}
    alternate = set(subject.ckpt.catalog.facts.alternate_groups)  # views, not written again
    expected = {
        _output_key(subject.ckpt.entry(k)): t
        for k, t in subject.tensors.items()
        if k.split(".")[0] not in alternate
    }
    assert keys == set(expected), (
        f"{case.id} → {to}: lost {sorted(set(expected) - keys)[:10]}, "
        f"gained {sorted(keys - set(expected))[:10]}"
    )
    for key, tensor in expected.items():
        assert_bit_equal(back.read(key), tensor, key)


def _output_key(entry: Entry) -> str:
    """The key an entry has once unsharded and reopened: under its group's file, at its path
    inside the group (the same key, unless the layout keeps its model under another key:
    Lightning's ``last.state_dict.w`` is ``model.w`` in ``model.safetensors``)."""
    if entry.model_depth is None and len(entry.path) == 1:  # a group that is itself a leaf
        return entry.group
    return ".".join(map(str, (entry.group, *entry.inner_path)))


# --------------------------------------------------------------------------------------------
# 5. Diff with itself.


@pytest.mark.parametrize("case", cases("diff"))
def test_diff_with_itself(case, subjects):
    subject = subjects[case]
    frame = ckptkit.diff(str(subject.path), str(subject.path))
    assert sorted(frame["key"]) == sorted(e.key for e in subject.ckpt.catalog.select())
    unequal = frame[frame["status"] != "equal"]
    assert unequal.empty, unequal[["key", "status", "note"]].head(10).to_string()


# --------------------------------------------------------------------------------------------
# 6. Verify.


@pytest.mark.parametrize("case", cases("verify"))
def test_verify_clean(case, subjects):
    subject = subjects[case]
    problems = ckptkit.verify(str(subject.path))
    assert list(problems.columns) == ["file", "key", "problem", "detail"]
    assert problems.empty, problems.head(10).to_string()


# --------------------------------------------------------------------------------------------
# 7. Inspection with torch blocked: one fresh interpreter for every case.

TORCH_BLOCKED = r"""
import json
import sys

sys.modules["torch"] = None  # any `import torch` now raises ImportError
import ckptkit

report = {}
for path in sys.argv[1:]:
    try:
        ckpt = ckptkit.open(path)
        report[path] = {
            "format": ckpt.format,
            "tensors": sorted(ckpt.tensors["key"]),
            "objects": sorted(ckpt.objects["key"]),
            "chunks": len(ckpt.chunks),
            "files": len(ckpt.files),
        }
    except Exception as exc:  # reported per case, so one broken case fails only itself
        report[path] = {"error": f"{type(exc).__name__}: {exc}"}
assert sys.modules["torch"] is None
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def torch_blocked(subjects) -> dict[str, dict]:
    """What a torch-free interpreter reports for every case's path (one subprocess)."""
    paths = [str(subjects.path(case)) for case in CASES]
    return json.loads(run_script(TORCH_BLOCKED, *paths, timeout=300))


@pytest.mark.parametrize("case", cases("torch-blocked"))
def test_inspection_without_torch(case, subjects, torch_blocked):
    subject = subjects[case]
    report = torch_blocked[str(subject.path)]
    assert "error" not in report, report.get("error")
    catalog = subject.ckpt.catalog
    assert report["format"] == case.format
    assert len(report["tensors"]) == len(catalog.tensors())
    assert report["tensors"] == sorted(e.key for e in catalog.tensors())
    assert report["objects"] == sorted(e.key for e in catalog.objects())
    assert report["chunks"] == sum(len(e.chunks) for e in catalog.tensors())
    assert report["files"] == len(catalog.files)
