"""Machine-readable renderings of what the ``ckptkit`` command reports: the ``--json``
documents of ``inspect``, ``diff``, ``sizes``, ``verify`` and ``stats``, and ``stats --csv``.
Plain data in, plain data out; the documents' shapes are part of the CLI's interface."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

    from ..checkpoint import Checkpoint

__all__ = ["diff_json", "inspect_json", "sizes_json", "stats_csv", "stats_json", "verify_json"]


def inspect_json(ckpt: Checkpoint, *, top: int | None = None) -> dict:
    """The ``inspect --json`` document, built from the catalog alone (no pandas, no torch):
    the summary the text output shows (files and bytes from
    :func:`~ckptkit.ops.sizes.byte_account`, as every rendering counts them), then the ``top``
    largest stored tensors (all tensors, alternate views included, when None)."""
    from ..catalog.model import left_as_objects_warning
    from ..ops.sizes import byte_account

    catalog = ckpt.catalog
    account = byte_account(ckpt)
    alternates = set(account.alternate_groups)
    tensors = catalog.tensors()
    model = [e for e in tensors if e.group == "model"]
    groups: dict[str, dict[str, int]] = {}
    for entry in catalog.entries.values():
        totals = groups.setdefault(
            entry.group,
            {"tensors": 0, "objects": 0, "nbytes": 0, "stored_bytes": 0, "object_bytes": 0},
        )
        totals["tensors" if entry.kind == "tensor" else "objects"] += 1
        totals["nbytes"] += entry.nbytes if entry.kind == "tensor" else 0
    for group, owned in account.by_group.items():
        groups[group]["stored_bytes"] = owned.tensor_bytes
        groups[group]["object_bytes"] = owned.object_bytes
    if top is not None:
        stored = [e for e in tensors if e.group not in alternates]
        tensors = sorted(stored, key=lambda e: e.nbytes, reverse=True)[: max(top, 0)]
    return {
        "format": catalog.format,
        "url": ckpt.url,
        "warning": left_as_objects_warning(catalog.objects()),
        "notes": list(catalog.facts.notes),  # how it was found (the only checkpoint in a folder)
        "summary": {
            "tensors": len(catalog.tensors()),
            "objects": len(catalog.objects()),
            "files": len(account.files),
            "bytes_on_disk": account.size,
            "tensor_bytes": account.tensor_bytes,
            "object_bytes": account.object_bytes,
            "overhead_bytes": account.overhead_bytes,
            "metadata_bytes": account.metadata_bytes,
            "alternate_groups": list(account.alternate_groups),
            "parameters": sum(e.numel for e in model or catalog.tensors()),
            "parameters_counted": "model" if model else "all tensors",
            "groups": groups,
            # counted files not there (``verify`` says what each held), and files not read
            "missing_files": list(account.missing),
            "skipped_files": dict(catalog.facts.skipped_files),
        },
        "tensors": [
            {
                "key": e.key,
                "dtype": e.dtype.name,
                "shape": list(e.shape),
                "nbytes": e.nbytes,
                "n_chunks": e.n_chunks,
            }
            for e in tensors
        ],
        "objects": [{"key": e.key, "nbytes": e.nbytes} for e in catalog.objects()],
        "files": [
            {"file": name, "kind": kind, "size": account.sizes.get(name)}
            for kind, names in (("data", account.data_files), ("metadata", account.metadata_files))
            for name in names
        ],
    }


def diff_json(frame: pd.DataFrame, same: bool) -> dict:
    """The ``diff --json`` document: settings, verdict, counts per status and every row."""
    return {
        "a": frame.attrs.get("a"),
        "b": frame.attrs.get("b"),
        "rtol": frame.attrs.get("rtol"),
        "atol": frame.attrs.get("atol"),
        "same": same,
        "counts": {k: int(v) for k, v in frame["status"].value_counts().items()},
        "notes": list(frame.attrs.get("notes", [])),
        "keys": _json_rows(frame),
    }


def sizes_json(frame: pd.DataFrame) -> dict:
    """The ``sizes --json`` document: one row per checkpoint, its label first."""
    rows = [
        {"label": label, **{k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}}
        for label, row in frame.to_dict("index").items()
    ]
    return {"checkpoints": rows}


def verify_json(path: str, frame: pd.DataFrame) -> dict:
    """The ``verify --json`` document: the path, the verdict and every problem found."""
    rows = frame.astype(object).where(frame.notna(), None).to_dict("records")
    return {"path": path, "ok": frame.empty, "problems": rows}


def stats_json(frame: pd.DataFrame) -> dict:
    """The ``stats --json`` document: where, the checkpoint fingerprint if computed, the rows."""
    return {
        "url": frame.attrs.get("url"),
        "format": frame.attrs.get("format"),
        "fingerprint": frame.attrs.get("fingerprint"),
        "tensors": _json_rows(frame),
    }


def stats_csv(frame: pd.DataFrame) -> str:
    """``stats --csv``: one row per tensor, shapes as lists (``[4, 8]``)."""
    return frame.assign(shape=[list(shape) for shape in frame["shape"]]).to_csv(index=False)


def _json_value(value):
    """A table cell as JSON has it: NaN and missing → null, ±Inf → "inf" / "-inf" (JSON has
    neither), tuples (shapes) → lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, tuple):
        return list(value)
    return None if value is None or value != value else value


def _json_rows(frame: pd.DataFrame) -> list[dict]:
    """The rows of ``frame`` as JSON-ready dicts."""
    return [
        {column: _json_value(value) for column, value in row.items()}
        for row in frame.astype(object).to_dict("records")
    ]
