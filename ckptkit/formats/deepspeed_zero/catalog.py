"""The catalog of a ZeRO tag directory (or of the tag its run directory's ``latest`` names):
the tag's pickles decoded and turned into entries, in ``zero_to_fp32``'s order (a
pipeline-parallel tag: in :mod:`.pipeline`'s).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...catalog.model import Catalog, CatalogBuilder, Entry, Facts
from ...errors import FormatError, MissingFileError
from ...storage import Store
from ..parts.torch_save_files import load_pickles
from .detection import (
    LATEST,
    NAME,
    SCRIPTS,
    latest_tag,
    list_tag_files,
    tag_evidence,
    tags_below,
    tags_text,
)
from .model_states import ModelStateEntries
from .optimizer import OptimizerEntries
from .pickles import ZERO_GLOBALS
from .pipeline import PipelineTag


def _latest_tag_dir(storage: Store, listing: dict[str, int]) -> str:
    """The tag directory ``latest`` names; an error naming ``latest`` and the tag directories
    there are when it names none (DeepSpeed's loader would fail too: never another step)."""
    try:
        tag = latest_tag(storage)
    except FormatError as exc:
        raise FormatError(f"{exc}{_tags_there(storage, listing)}") from None
    if listing.get(tag) != -1:
        raise MissingFileError(
            f"{storage.describe(tag)}: missing ({LATEST} names it){_tags_there(storage, listing)}"
        )
    if not tag_evidence(storage.listdir(tag)):
        raise FormatError(
            f"{storage.describe(tag)}: not a ZeRO tag directory ({LATEST} names it)"
            f"{_tags_there(storage, listing)}"
        )
    return tag


def _tags_there(storage: Store, listing: dict[str, int]) -> str:
    """For an error on ``latest``: the tag directories the run directory holds, if any."""
    tags = tags_below(storage, listing)
    if not tags:
        return ""
    last = storage.describe(tags[-1])
    return f"; tag directories here: {tags_text(tags)} (open one: ckptkit inspect {last})"


def describe(storage: Store, files: list[str] | None = None) -> Catalog:
    """The catalog of a ZeRO tag directory, or of the tag its run directory's ``latest`` names."""
    listing = storage.listdir()
    prefix, metadata, skipped = "", (), {}
    if not tag_evidence(listing) and LATEST in listing:
        tag = _latest_tag_dir(storage, listing)
        prefix, metadata = f"{tag}/", (LATEST,)
        skipped = {n: "DeepSpeed's converter script, not read" for n in SCRIPTS if n in listing}
    tag_files = list_tag_files(storage, prefix)
    skipped.update(tag_files.skipped)
    names = [*tag_files.model, *tag_files.optim, *tag_files.layers.values()]
    pickled = load_pickles(storage, names, tag_files.sizes, allow=ZERO_GLOBALS)
    zero: _Zero | PipelineTag
    if tag_files.layers:
        zero = PipelineTag(tag_files, pickled)
    else:
        zero = _Zero([pickled[f] for f in tag_files.model], [pickled[f] for f in tag_files.optim])
    builder = CatalogBuilder(NAME, object_globals=ZERO_GLOBALS)
    builder.add_files(names)
    source = storage.describe(prefix.rstrip("/"))
    try:
        entries = list(zero.entries())
    except (AttributeError, TypeError, KeyError, ValueError, IndexError) as exc:
        raise FormatError(
            f"{source}: unexpected DeepSpeed ZeRO state ({type(exc).__name__}: {exc})"
        ) from exc
    builder.add_all(entries, source=source)
    return builder.build(
        Facts(
            metadata_files=metadata,
            world_size=zero.world,
            version=_text(zero.model0.value.get("ds_version")),
            checkpoint_id=prefix.rstrip("/") or None,
            layout=zero.layout_name,
            skipped_files=skipped,
            bookkeeping_keys=tuple(f"optimizer_state_dict.{k}" for k in zero.geometry_keys),
        )
    )


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


class _Zero(ModelStateEntries, OptimizerEntries):
    """The decoded model-state and optimizer-state pickles of one tag, turned into entries."""

    def entries(self) -> Iterable[Entry]:
        """``model``, ``module``, ``optim`` and ``train`` entries, ``model`` in zero_to_fp32's
        order (buffers, frozen, trainable, tied)."""
        shapes = self._param_shapes()
        layout = self._layout(shapes)
        params = {name: shape for group in shapes for name, shape in group}
        model: dict[str, Entry] = {}
        for entry in [*self._buffers(), *self._frozen()]:
            model[entry.key] = entry
        for name, shape in params.items():
            key = f"model.{name}"
            if key in model:
                raise FormatError(
                    f"{self.model0.source}: {name!r} is both a trainable parameter and a buffer "
                    "or frozen parameter"
                )
            label = f"{self.flat_key}.{{group}}"
            chunks = self._chunks(key, shape, layout.pieces[name], label, self.flats, self.optims)
            model[key] = Entry(key, ("model", name), "tensor", chunks, self.dtype, shape)
        model.update(self._shared(model))
        yield from model.values()
        yield from self._module(params)
        yield from self._optim(params, layout)
        yield from self._train()


__all__ = ["describe"]
