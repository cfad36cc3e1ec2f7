"""State dicts rebuilt from a checkpoint: nesting by each entry's path, loading into modules."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import FormatError, LimitExceededError, OutputNameError
from .source import Source, open_source

if TYPE_CHECKING:
    import torch


def nest(items: Iterable[tuple[tuple[str | int, ...], Any]]) -> dict:
    """Build the nested dict/list structure torch rebuilds from DCP paths.

    String parts are dict keys, int parts list indices (lists grow with ``None``), exactly as
    ``torch.distributed.checkpoint`` does when it loads without a template. Paths come from the
    checkpoint, so two leaves on one path, a leaf where another path needs a sub-tree, or a
    string part inside a list are :class:`OutputNameError`; a list index beyond the number of
    leaves (only ``None`` could fill it) is :class:`LimitExceededError`.
    """
    items = list(items)
    root: dict = {}
    leaves: dict[tuple, tuple] = {}  # where each leaf sits → its full path, for messages
    for path, value in items:
        if not path:
            raise OutputNameError("an entry has an empty path")
        node: Any = root
        for depth, part in enumerate(path):
            _check_part(node, part, path, len(items))
            last = depth == len(path) - 1
            if isinstance(node, list):
                _grow(node, part)
            present = node[part] if isinstance(node, list) else node.get(part)
            here = tuple(path[: depth + 1])
            if here in leaves:  # a leaf already sits where this path goes on or ends
                raise _clash(path, leaves[here])
            if last:
                if present is not None:
                    raise _clash(path, "a sub-tree of other entries")
                node[part] = value
                leaves[here] = path
            else:
                if present is None:
                    present = [] if type(path[depth + 1]) is int else {}
                    node[part] = present
                node = present
    return root


def _check_part(node: Any, part: Any, path: tuple, n_leaves: int) -> None:
    """Refuse a path part that cannot index ``node`` (see :func:`nest`)."""
    if isinstance(node, list):
        if type(part) is not int:
            raise OutputNameError(f"path {path!r}: {part!r} indexes a list other paths built")
        if not 0 <= part <= n_leaves:
            raise LimitExceededError(
                f"path {path!r}: list index {part} with only {n_leaves} entries to fill it"
            )
    elif type(part) not in (str, int):
        raise OutputNameError(f"path {path!r}: part {part!r} is neither a name nor an index")


def _clash(path: tuple, other: Any) -> OutputNameError:
    return OutputNameError(
        f"path {path!r} clashes with {other!r}: one would overwrite the other in the output"
    )


def _grow(items: list, index: int) -> None:
    if len(items) <= index:
        items.extend([None] * (index + 1 - len(items)))


def load_state_dict(
    src: str | Source,
    *,
    keys: Sequence[str] | str | None = None,
    groups: Sequence[str] | str | None = None,
    storage_options: dict | None = None,
) -> dict:
    """The (selected part of the) checkpoint as the nested dict torch would build, in memory.

    Tensors come back as ``torch.Tensor``; objects decoded safely. For whole large checkpoints
    prefer :func:`ckptkit.unshard`, which streams to disk.
    """
    ckpt = open_source(src, storage_options)
    entries = ckpt.catalog.select(keys, groups)
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
    mismatch, raises before anything is copied; otherwise they are reported in the result.
    """
    import torch

    ckpt = open_source(src, storage_options)
    targets = module.state_dict(keep_vars=True)
    available = {
        e.key[len(prefix) :]: e for e in ckpt.catalog.tensors() if e.key.startswith(prefix)
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
