"""Keys and paths: wrapper segments dropped and keys renamed for comparing checkpoints
(:func:`map_key`), and the nested dict/list structure torch rebuilds from DCP paths (:func:`nest`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import LimitExceededError, OutputNameError

__all__ = ["WRAPPERS", "KeyMap", "map_key", "nest"]

#: Module-wrapper path segments that are never part of a parameter's identity.
WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")

KeyMap = Mapping[str, str] | Callable[[str], str] | None


def map_key(key: str, key_map: KeyMap = None) -> str:
    """``key`` with wrapper segments dropped, then renamed by ``key_map``.

    A dict maps prefixes (the longest matching one wins: ``{"pytorch_model.": "model."}``); a
    callable gets the key and returns its new name.
    """
    for wrapper in WRAPPERS:
        key = key.replace(wrapper, "")
    if key_map is None:
        return key
    if callable(key_map):
        return key_map(key)
    for prefix in sorted(key_map, key=len, reverse=True):
        if key.startswith(prefix):
            return key_map[prefix] + key[len(prefix) :]
    return key


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
