"""State dicts rebuilt from a checkpoint: nesting by each entry's path, loading into modules."""

from __future__ import annotations

import glob
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from ..catalog.keys import nest
from ..errors import FormatError
from .source import Source, open_source, select_entries

if TYPE_CHECKING:
    import torch


__all__ = ["load_state_dict", "LoadResult", "from_checkpoint"]


def load_state_dict(
    src: str | Source,
    *,
    keys: Sequence[str] | str | None = None,
    groups: Sequence[str] | str | None = None,
    storage_options: dict | None = None,
) -> dict:
    """The (selected part of the) checkpoint as the nested dict torch would build, in memory.

    Tensors come back as ``torch.Tensor``; objects decoded safely. For whole large checkpoints
    prefer :func:`ckptkit.unshard`, which streams to disk. A group or glob that matches nothing
    raises :class:`~ckptkit.errors.KeyNotFoundError` with a suggestion.

    Args:
        src: the checkpoint: a path or URL, or an opened checkpoint (:class:`Source`).
        keys: globs selecting entries by dotted key; None takes every entry.
        groups: top-level groups to take (``"model"``, ``"optim"``…).
        storage_options: fsspec options for ``src`` (when a URL).

    Returns:
        A nested dict of the selected entries (nested by each entry's path, as torch saved
        it), tensors as ``torch.Tensor`` and objects as decoded values.

    Example:
        >>> state = ckptkit.load_state_dict("ckpt/step_1000", groups="model")
        >>> state["model"]["embed.weight"].shape
    """
    ckpt = open_source(src, storage_options)
    entries = select_entries(ckpt, keys, groups)
    objects = [e for e in entries if e.kind == "object"]
    values = dict(zip((e.key for e in objects), ckpt.reader.read_objects(objects), strict=True))
    return nest(
        (e.path, values[e.key] if e.kind == "object" else ckpt.reader.read_tensor(e))
        for e in entries
    )


class LoadResult(NamedTuple):
    """What :func:`from_checkpoint` could not match, as ``Module.load_state_dict`` reports it."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def from_checkpoint(
    module: torch.nn.Module,
    src: str | Source,
    *,
    prefix: str = "model.",
    strict: bool = True,
    storage_options: dict | None = None,
) -> LoadResult:
    """Load ``module``'s parameters and buffers from a checkpoint, one tensor at a time.

    Checkpoint key ``prefix + name`` feeds ``module.state_dict()[name]`` (copied in place, so
    memory stays at one tensor). With ``strict`` a missing or unexpected key, or a shape/dtype
    mismatch, raises before anything is copied; otherwise they are reported in the result. A
    ``prefix`` no key starts with raises :class:`~ckptkit.errors.KeyNotFoundError` with a
    suggestion (it would load nothing).

    Args:
        module: the ``torch.nn.Module`` whose parameters and buffers are filled in place.
        src: the checkpoint: a path or URL, or an opened checkpoint (:class:`Source`).
        prefix: prepended to each name of ``module.state_dict()`` to find its checkpoint key
            (default ``"model."``; ``""`` matches keys as they are).
        strict: raise on a missing or unexpected key (default True); a shape mismatch always
            raises :class:`~ckptkit.errors.FormatError`.
        storage_options: fsspec options for ``src`` (when a URL).

    Returns:
        A :class:`LoadResult`: ``missing_keys`` (module names the checkpoint lacks) and
        ``unexpected_keys`` (checkpoint keys under ``prefix`` the module lacks).

    Example:
        >>> model = MyModel()
        >>> result = ckptkit.from_checkpoint(model, "ckpt/step_1000", strict=False)
        >>> result.missing_keys
        []
    """
    import torch

    ckpt = open_source(src, storage_options)
    targets = module.state_dict(keep_vars=True)
    # a prefix no key has fails here, naming the groups there are (not a list of missing keys)
    entries = (
        select_entries(ckpt, keys=glob.escape(prefix) + "*") if prefix else ckpt.catalog.tensors()
    )
    available = {
        e.key[len(prefix) :]: e for e in entries if e.kind == "tensor" and e.key.startswith(prefix)
    }
    missing = [name for name in targets if name not in available]
    unexpected = [prefix + name for name in available if name not in targets]
    mismatched = [
        f"{prefix}{name}: checkpoint {available[name].dtype.name}{list(available[name].shape)}, "
        f"module {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
        for name, t in targets.items()
        if name in available and tuple(t.shape) != available[name].shape
    ]
    if mismatched or (strict and (missing or unexpected)):
        problems = (
            mismatched + [f"missing {k}" for k in missing] + [f"unexpected {k}" for k in unexpected]
        )
        raise FormatError(
            f"{ckpt.url}: cannot load into {type(module).__name__}: " + "; ".join(problems)
        )
    with torch.no_grad():
        for name, target in targets.items():
            if name in available:
                target.copy_(ckpt.reader.read_tensor(available[name]))
    return LoadResult(missing, unexpected)
