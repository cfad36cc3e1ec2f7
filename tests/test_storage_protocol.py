"""``Storage`` and ``AtomicOutput`` satisfy the narrow interfaces of ``ckptkit.storage.protocol``
(``Store``, ``Output``): every member present with the same parameters, and working through
them on a real checkpoint (torch 2.2 FSDP1 DCP fixture) and a real output folder."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest

from ckptkit.storage import AtomicOutput, Output, RangedFile, RangedOutput, Storage, Store
from ckptkit.storage.multipart import RangedUpload

FIXTURE = Path(__file__).parent / "fixtures" / "dcp_torch22_fsdp1_ws2" / "checkpoint"


def _methods(protocol: type) -> list[str]:
    """The methods ``protocol`` names (typing adds private helpers, left out)."""
    return [
        name
        for name, value in vars(protocol).items()
        if inspect.isfunction(value) and not name.startswith("_")
    ]


def _parameters(function) -> list[inspect.Parameter]:
    """The parameters after ``self``, with names, kinds, defaults and annotations."""
    return list(inspect.signature(function).parameters.values())[1:]


@pytest.fixture
def storage() -> Storage:
    return Storage(str(FIXTURE))


@pytest.mark.parametrize(
    ("implementation", "protocol"),
    [
        (Storage, Store),
        (AtomicOutput, Output),
        (RangedFile, RangedOutput),
        (RangedUpload, RangedOutput),
    ],
)
def test_every_protocol_method_exists_with_the_same_parameters(implementation, protocol):
    methods = _methods(protocol)
    assert methods, protocol
    for name in methods:
        assert callable(getattr(implementation, name, None)), f"{implementation.__name__}.{name}"
        assert _parameters(getattr(implementation, name)) == _parameters(getattr(protocol, name)), (
            f"{implementation.__name__}.{name}"
        )


def test_storage_is_a_store_on_a_real_checkpoint(storage):
    assert isinstance(storage, Store)
    assert set(Store.__annotations__) == {"url", "root"}
    for attribute in Store.__annotations__:
        assert isinstance(getattr(storage, attribute), str)
    child = storage.child("sub")
    parent, name = storage.parent()
    assert isinstance(child, Store) and isinstance(parent, Store)
    assert name == "checkpoint" and parent.child(name).root == storage.root
    assert not isinstance(object(), Store)


def test_reading_a_real_checkpoint_through_the_store_members(storage):
    store: Store = storage
    files = sorted(p.name for p in FIXTURE.iterdir())
    assert sorted(store.listdir()) == files
    assert store.isdir() and store.exists(".metadata") and not store.exists("missing")
    data = (FIXTURE / "__0_0.distcp").read_bytes()
    assert store.size("__0_0.distcp") == len(data)
    assert store.sizes(["__0_0.distcp", "missing"]) == {"__0_0.distcp": len(data), "missing": None}
    pieces = store.read_ranges([("__0_0.distcp", 0, 64), ("__0_0.distcp", 100, 164)])
    assert [bytes(piece) for piece in pieces] == [data[:64], data[100:164]]
    metadata = (FIXTURE / ".metadata").read_bytes()
    assert store.read_file(".metadata") == metadata
    with store.open_sequential(".metadata") as stream:
        assert stream.read() == metadata
    assert store.path(".metadata") == os.path.join(storage.root, ".metadata")
    assert store.describe(".metadata").endswith("checkpoint/.metadata")


def test_atomic_output_is_an_output_on_a_real_folder(tmp_path):
    output: Output = AtomicOutput(Storage(str(tmp_path / "out")))
    assert isinstance(output, Output)
    try:
        output.refuse_existing(["model.bin"])
        with output.open("model.bin") as stream:
            stream.write(b"weights")
        published = output.publish()
    finally:
        output.discard()
    assert [name for name, _ in published] == ["model.bin"]
    assert sorted(os.listdir(tmp_path / "out")) == ["model.bin"]
    assert (tmp_path / "out" / "model.bin").read_bytes() == b"weights"
