"""Bytes on disk of several checkpoints side by side: by group, by dtype, and framing overhead.

Built from each catalog and one size lookup per file; no tensor bytes are read.
"""

from __future__ import annotations

import posixpath
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import MissingFileError, UsageError
from .source import Source, open_source

if TYPE_CHECKING:
    import pandas as pd

    from ..catalog.model import Catalog

__all__ = ["CATEGORIES", "GROUP_CATEGORIES", "category", "compare_sizes"]

#: The columns group bytes are summed into, in display order.
CATEGORIES = ("model", "optim", "train", "other")
#: Top-level group name (lower-cased) → category; unlisted names starting with ``model`` or
#: ``optim`` go to model / optim, anything else to ``other``. Categories carry the commonest
#: group names (a DCP's ``optim`` and ``train``), so sizes and inspect say the same words.
GROUP_CATEGORIES: dict[str, str] = {
    **dict.fromkeys(
        ["model", "module", "model_state_dict", "state_dict", "pytorch_model", "weights"], "model"
    ),
    **dict.fromkeys(
        ["optim", "optimizer", "optimizer_state_dict", "optim_state", "opt", "opt_state"],
        "optim",
    ),
    **dict.fromkeys(
        [
            "train",
            "trainer",
            "trainer_state",
            "other",  # OLMo's older name for train.pt
            "scheduler",
            "lr_scheduler",
            "rng",
            "rng_state",
            "rng_states",
            "step",
            "epoch",
            "iteration",
            "global_step",
            "args",
            "config",
            "dataloader",
            "data_loader",
        ],
        "train",
    ),
}


def category(group: str, extra: Mapping[str, str] | None = None) -> str:
    """The category (model / optim / train / other) a top-level group's bytes count in."""
    name = group.lower()
    if extra and group in extra:
        return extra[group]
    if name in GROUP_CATEGORIES:
        return GROUP_CATEGORIES[name]
    if name.startswith("model"):
        return "model"
    if name.startswith("optim"):
        return "optim"
    return "other"


def compare_sizes(
    *sources: str | Source,
    labels: Sequence[str] | None = None,
    categories: Mapping[str, str] | None = None,
    storage_options: dict | None = None,
) -> pd.DataFrame:
    """One row per checkpoint: bytes on disk, split by category and by dtype, and overhead.

    ``size`` is every file the checkpoint consists of (data files plus DCP ``.metadata``)
    and equals ``model + optim + train + other + overhead_bytes + metadata_bytes``: group
    columns hold stored tensor bytes plus object records (a pickle shared by groups of several
    categories counts as ``other``), ``overhead_bytes`` is framing in data files (zip headers,
    pickles around tensors, safetensors headers), ``metadata_bytes`` the index files. Dtype
    columns (``float32``…) hold stored tensor bytes; ``ratio`` is ``size`` over the first row's.
    Group names map to categories by :data:`GROUP_CATEGORIES`; ``categories`` adds
    ``{group: category}`` entries.
    """
    import pandas as pd

    if not sources:
        raise UsageError("compare_sizes needs at least one checkpoint")
    ckpts = [open_source(source, storage_options) for source in sources]
    if labels is None:
        labels = _labels(sources, ckpts)
    elif len(labels) != len(ckpts):
        raise UsageError(f"{len(labels)} labels for {len(ckpts)} checkpoints")
    rows = [_sizes(ckpt, categories) for ckpt in ckpts]
    dtype_columns = sorted(
        {k for row in rows for k in row["dtypes"]},
        key=lambda name: -sum(row["dtypes"].get(name, 0) for row in rows),
    )
    records = []
    for row in rows:
        by_dtype = row.pop("dtypes")
        records.append({**row, **{name: by_dtype.get(name, 0) for name in dtype_columns}})
    frame = pd.DataFrame(records, index=pd.Index(list(labels), name="checkpoint"))
    frame.insert(4, "ratio", frame["size"] / frame["size"].iloc[0] if frame["size"].iloc[0] else 0)
    frame.attrs["dtype_columns"] = dtype_columns
    return frame


def _sizes(source: Source, extra: Mapping[str, str] | None) -> dict[str, Any]:
    from ..catalog.tables import files_table

    catalog, storage = source.catalog, source.storage
    files = files_table(catalog, storage.sizes(catalog.files))
    missing = files.loc[files["size"].isna(), "file"].tolist()
    if missing:
        raise MissingFileError(f"{storage.describe(missing[0])}: no such file")
    metadata_names = list(catalog.facts.metadata_files)
    metadata_sizes = storage.sizes(metadata_names) if metadata_names else {}
    metadata_bytes = sum(size or 0 for size in metadata_sizes.values())
    by_category, by_dtype, tensor_bytes, object_bytes = _stored_bytes(catalog, extra)
    data_bytes = int(files["size"].sum())
    return {
        "format": catalog.format,
        "files": len(files) + len(metadata_names),
        "records": int(files["records"].sum()),
        "size": data_bytes + metadata_bytes,
        **by_category,
        "tensor_bytes": tensor_bytes,
        "object_bytes": object_bytes,
        "overhead_bytes": data_bytes - tensor_bytes - object_bytes,
        "metadata_bytes": metadata_bytes,
        "dtypes": by_dtype,
    }


def _stored_bytes(
    catalog: Catalog, extra: Mapping[str, str] | None
) -> tuple[dict[str, int], dict[str, int], int, int]:
    """``(bytes by category, tensor bytes by dtype, tensor bytes, object bytes)`` the records
    of ``catalog`` hold."""
    by_category: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
    by_dtype: dict[str, int] = defaultdict(int)
    tensor_bytes = 0
    # Object records may be shared by many leaves (one data.pkl per torch.save file): count
    # each once, under the category of every entry that shares it if they agree.
    shared: dict[tuple[str, int, int], set[str]] = {}
    for entry in catalog.entries.values():
        cat = category(entry.group, extra)
        for chunk in entry.chunks:
            record = chunk.record
            if record is None:
                continue
            if entry.kind == "tensor":
                nbytes = chunk.numel * entry.dtype.itemsize
                by_category[cat] += nbytes
                by_dtype[entry.dtype.name] += nbytes
                tensor_bytes += nbytes
            else:
                shared.setdefault((record.file, record.offset, record.length), set()).add(cat)
    object_bytes = 0
    for (_, _, length), cats in shared.items():
        by_category[cats.pop() if len(cats) == 1 else "other"] += length
        object_bytes += length
    return by_category, dict(by_dtype), tensor_bytes, object_bytes


def _labels(sources: Sequence[Any], ckpts: list[Source]) -> list[str]:
    """Short unique names: the last path component, more of the path when that repeats."""
    paths = []
    for source, ckpt in zip(sources, ckpts, strict=True):
        path = source if isinstance(source, str) else ckpt.url
        if not isinstance(source, str) and ckpt.detection.files and len(ckpt.detection.files) == 1:
            path = posixpath.join(path, ckpt.detection.files[0])
        paths.append(str(path).rstrip("/").split("://")[-1])
    for depth in range(1, 1 + max(p.count("/") + 1 for p in paths)):
        labels = ["/".join(p.split("/")[-depth:]) for p in paths]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{p} #{i}" for i, p in enumerate(paths)]
