"""Bytes on disk of several checkpoints side by side: by group, by dtype, and framing overhead.

Built from each catalog and one size lookup per file (:func:`byte_account`, the one count of
files and bytes every report shares); no tensor bytes are read.
"""

from __future__ import annotations

import contextlib
import posixpath
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, MissingFileError, UnsafePathError, UsageError
from .source import Source, open_source

if TYPE_CHECKING:
    import pandas as pd

    from ..catalog.accounting import ByteAccount

__all__ = [
    "CATEGORIES",
    "GROUP_CATEGORIES",
    "category",
    "byte_account",
    "compare_sizes",
    "skipped_bytes",
]

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


def byte_account(source: Source) -> ByteAccount:
    """The files and bytes of an opened checkpoint (one size look-up for all its files): the
    numbers ``inspect``, ``summary()``, the reprs and :func:`compare_sizes` all report."""
    from ..catalog.accounting import account_bytes, counted_files

    data_files, metadata_files = counted_files(source.catalog)
    sizes = source.storage.sizes([*data_files, *metadata_files])
    return account_bytes(source.catalog, sizes)


def compare_sizes(
    *sources: str | Source,
    labels: Sequence[str] | None = None,
    categories: Mapping[str, str] | None = None,
    storage_options: dict | None = None,
) -> pd.DataFrame:
    """One row per checkpoint: bytes on disk, split by category and by dtype, and overhead.

    ``size`` is every file the checkpoint consists of (data files plus metadata such as DCP
    ``.metadata``) and equals ``model + optim + train + other + overhead_bytes +
    metadata_bytes``. Bytes are counted per stored record, each once however many entries view
    it (shared storages, tied weights, tensor views): group columns hold those tensor and object
    records (one viewed by groups of several categories counts as ``other``), ``tensor_bytes``
    and ``object_bytes`` their totals, ``overhead_bytes`` the framing in data files (zip
    headers, pickles around tensors, safetensors headers; never negative), ``metadata_bytes``
    the index files. ``alternate_bytes`` names what alternate views (Megatron's ``stacked.*``)
    re-expose: bytes other groups hold, not added again. ``skipped_bytes`` is the files in the
    checkpoint folder ckptkit does not read (``facts.skipped_files``), outside ``size``. Dtype columns (``float32``…) hold
    stored tensor bytes; ``ratio`` is ``size`` over the first row's. Group names map to
    categories by :data:`GROUP_CATEGORIES`; ``categories`` adds ``{group: category}`` entries.

    Args:
        *sources: one or more checkpoints: paths or URLs, or opened checkpoints
            (:class:`Source`); the first is the ``ratio`` baseline.
        labels: row labels, one per checkpoint; None (default) uses the last path components
            (more of the path where they repeat).
        categories: extra ``{group: category}`` entries (category one of ``"model"``,
            ``"optim"``, ``"train"``, ``"other"``), taking precedence over the built-in names.
        storage_options: fsspec options for every source given as a URL.

    Returns:
        A DataFrame indexed by ``checkpoint`` label: ``format``, ``files``, ``records``,
        ``size``, ``ratio``, the category and byte columns, then one column per dtype (listed in
        ``attrs["dtype_columns"]``).

    Example:
        >>> sizes = ckptkit.compare_sizes("ckpt/step_1000", "release/", labels=["dcp", "hf"])
        >>> sizes[["size", "ratio", "model", "optim"]]
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
    account = byte_account(source)
    missing = [name for name in account.missing if name in account.data_files]
    if missing:
        raise MissingFileError(f"{source.storage.describe(missing[0])}: no such file")
    return {
        "format": source.catalog.format,
        "files": len(account.files),
        "records": account.records,
        "size": account.size,
        **_by_category(account, extra),
        "tensor_bytes": account.tensor_bytes,
        "object_bytes": account.object_bytes,
        "overhead_bytes": account.overhead_bytes,
        "metadata_bytes": account.metadata_bytes,
        "alternate_bytes": account.alternate_bytes,
        "skipped_bytes": skipped_bytes(source),
        "dtypes": dict(account.by_dtype),
    }


def skipped_bytes(source: Source) -> int:
    """Bytes on disk of the files in the checkpoint folder ckptkit does not read
    (:attr:`~ckptkit.catalog.model.Facts.skipped_files`; not in ``size``). A folder named
    ``name/`` counts its files one level down, when local; a name ckptkit refuses counts 0."""
    storage = source.storage
    files, folders = [], []
    for name in source.catalog.facts.skipped_files:
        try:
            storage.path(name.rstrip("/"))
        except UnsafePathError:
            continue
        (folders if name.endswith("/") else files).append(name)
    total = sum(size or 0 for size in storage.sizes(files).values()) if files else 0
    for folder in folders if storage.local else ():
        with contextlib.suppress(CheckpointError):
            total += sum(size for size in storage.listdir(folder.rstrip("/")).values() if size > 0)
    return total


def _by_category(account: ByteAccount, extra: Mapping[str, str] | None) -> dict[str, int]:
    """Stored bytes per category: a record every viewer of which is in one category counts
    there, one viewed from groups of several categories counts as ``other``."""
    by_category: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
    for (groups, _kind), nbytes in account.shares.items():
        cats = {category(group, extra) for group in groups}
        by_category[cats.pop() if len(cats) == 1 else "other"] += nbytes
    return by_category


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
