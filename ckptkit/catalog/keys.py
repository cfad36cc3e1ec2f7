"""Keys and paths: wrapper segments dropped and keys renamed for comparing checkpoints
(:func:`map_key`), the nested dict/list structure torch rebuilds from DCP paths (:func:`nest`),
and where a layout keeps its model's state dict (:func:`model_root`), which names the group
``model`` whatever the top-level key is."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import LimitExceededError, OutputNameError

__all__ = ["WRAPPERS", "MODEL_GROUP", "MODEL_ALIASES", "KeyMap", "map_key", "model_root", "nest"]

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


#: The group name users look for: what reports count parameters in, what ``groups=["model"]``
#: selects, the stem of ``model.safetensors``.
MODEL_GROUP = "model"
#: Top-level keys that are a model's whole state dict under another name: HF's torch.save
#: shards ``pytorch_model-0000i-of-0000n.bin`` (group ``pytorch_model``), diffusers' weights.
MODEL_ALIASES = ("pytorch_model", "diffusion_pytorch_model")
#: A key only Lightning's ``Trainer.save_checkpoint`` writes beside its ``state_dict``.
_LIGHTNING_MARKER = "pytorch-lightning_version"
#: Keys of Composer's ``State.state_dict()`` beside its ``model``: it is Composer's only when
#: they are there too.
_COMPOSER_MARKERS = ("rank_zero_seed", "run_name")


def model_root(entries: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The path prefix below which ``entries`` (a catalog's entries by key, untyped: this module
    sits below :mod:`.model`) are the model's own state dict, when the layout puts it elsewhere
    than under a top-level ``model`` key; None when nothing says so, or when a ``model`` group
    exists already. The entries below it form the group ``model`` (see
    :attr:`~ckptkit.catalog.model.Entry.group`), their keys unchanged:

    * a DCP whose top-level keys are all leaves with dotted names (torchtitan's model-only
      save: ``tok_embeddings.weight``, ``layers.0.attention.wq.weight``): ``()``, all of them;
    * HF's ``pytorch_model`` (``.bin`` shards) and diffusers' ``diffusion_pytorch_model``:
      ``("pytorch_model",)``;
    * Lightning's ``.ckpt`` (``G.state_dict`` beside ``G.pytorch-lightning_version``):
      ``(G, "state_dict")``;
    * Composer's ``State.state_dict()`` (``state.model`` beside ``state.rank_zero_seed`` and
      ``state.run_name``), at the top (sharded) or in a file's group ``G`` (monolithic):
      ``("state", "model")`` or ``(G, "state", "model")``.

    Two candidates (two Lightning files in one folder) name none: each keeps its own group.
    Only the top-level keys and a few marker keys are looked at, so this stays cheap on
    catalogs of 500k entries."""
    tops: dict[str, bool] = {}  # top-level key → whether it is a leaf
    for entry in entries.values():
        top = entry.path[0]
        if isinstance(top, str):
            tops[top] = tops.get(top, True) and len(entry.path) == 1
    if MODEL_GROUP in tops or not tops:
        return None
    if all(tops.values()):  # only top-level leaves
        return () if any("." in top for top in tops) else None
    found: list[tuple[str, ...]] = [(alias,) for alias in MODEL_ALIASES if alias in tops]
    for top in tops:
        if f"{top}.{_LIGHTNING_MARKER}" in entries:
            found.append((top, "state_dict"))
    for base in [(), *((top,) for top in tops)]:
        state = ".".join((*base, "state"))
        if all(f"{state}.{marker}" in entries for marker in _COMPOSER_MARKERS):
            found.append((*base, "state", "model"))
    return found[0] if len(found) == 1 else None
