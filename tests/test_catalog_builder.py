"""The catalog builder's checks (every entry well-formed, checked once, for all entries at
once): a real DCP's entries build; one malformed entry anywhere among them is refused with a
FormatError naming its key, as the entry-by-entry check names it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptkit
from ckptkit.catalog.model import CatalogBuilder, Chunk, Record
from ckptkit.errors import FormatError


@pytest.fixture(scope="module")
def entries(tmp_path_factory):
    """The entries of a DCP written by torch's own writer: tensors of 0 to 3 dimensions and
    objects."""
    path = tmp_path_factory.mktemp("builder") / "ckpt"
    generator = torch.Generator().manual_seed(11)
    state = {
        "model": {f"layer{i}.w": torch.randn(4, 3, generator=generator) for i in range(40)},
        "train": {"step": 7, "scalar": torch.tensor(2.5), "cube": torch.zeros(2, 2, 2)},
    }
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, checkpoint_id=str(path))
    return list(ckptkit.open(str(path)).catalog.entries.values())


def _build(entries):
    builder = CatalogBuilder("dcp")
    builder.add_all(entries)
    return builder.build()


def test_well_formed_entries_build_unchanged(entries):
    catalog = _build(entries)
    assert list(catalog.entries.values()) == entries
    assert catalog.files == ("__0_0.distcp",)


def _tensor_chunk(entry, **changes):
    return dataclasses.replace(entry, chunks=(dataclasses.replace(entry.chunks[0], **changes),))


def _record(entry, **changes):
    chunk = entry.chunks[0]
    return dataclasses.replace(
        entry,
        chunks=(dataclasses.replace(chunk, record=dataclasses.replace(chunk.record, **changes)),),
    )


MALFORMED = {
    "path part not a name or index": (
        lambda e: dataclasses.replace(e, path=(*e.path[:-1], -1)),
        "has a part that is not a name or index",
    ),
    "path part a float": (
        lambda e: dataclasses.replace(e, path=(*e.path[:-1], 1.5)),
        "has a part that is not a name or index",
    ),
    "no dtype": (lambda e: dataclasses.replace(e, dtype=None), "needs a dtype and a shape"),
    "negative dimension": (
        lambda e: dataclasses.replace(e, shape=(4, -3)),
        "needs a dtype and a shape",
    ),
    "shape a list": (lambda e: dataclasses.replace(e, shape=[4, 3]), "needs a dtype and a shape"),
    "chunk of other rank": (lambda e: _tensor_chunk(e, offsets=(0,)), "malformed chunk"),
    "chunk offset negative": (lambda e: _tensor_chunk(e, offsets=(0, -1)), "malformed chunk"),
    "chunk size a float": (lambda e: _tensor_chunk(e, sizes=(4, 3.0)), "malformed chunk"),
    "record without file": (lambda e: _record(e, file=""), "malformed record"),
    "record offset negative": (lambda e: _record(e, offset=-8), "malformed record"),
    "record length a str": (lambda e: _record(e, length="48"), "malformed record"),
    "unknown kind": (lambda e: dataclasses.replace(e, kind="blob"), "unknown kind"),
    "object with a dtype": (
        lambda e: dataclasses.replace(e, kind="object"),
        "an object needs a record and no dtype",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_one_malformed_entry_among_many_is_named(entries, case):
    damage, message = MALFORMED[case]
    at = next(i for i, e in enumerate(entries) if e.key == "model.layer17.w")
    bad = damage(entries[at])
    with pytest.raises(FormatError, match=message) as raised:
        _build([*entries[:at], bad, *entries[at + 1 :]])
    assert "'model.layer17.w'" in str(raised.value)


def test_an_object_without_a_record_is_named(entries):
    step = next(e for e in entries if e.key == "train.step")
    bad = dataclasses.replace(step, chunks=(Chunk((), (), None),))
    with pytest.raises(FormatError, match="'train.step': an object needs a record"):
        _build([bad if e is step else e for e in entries])
    assert isinstance(step.chunks[0].record, Record)
