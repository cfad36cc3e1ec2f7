"""Which value of one checkpoint :func:`~ckptkit.ops.diff.diff` compares with which of the other.

Keys are matched after dropping wrapper segments and applying a ``key_map``. Two sides may spell
one state differently and still hold the same values: an object entry on one side (DCP's
``optim.param_groups``, a pickled tuple) is split into its leaves at the paths where the other
side keeps entries of its own (``optim.param_groups.0.lr`` …), so the values at the same paths
are compared; a side whose keys all sit under one group (a single file, named by its stem:
``torch_ref.model.…``) is lined up with the other side's groups when that pairs all its keys.
"""

from __future__ import annotations

import bisect
import fnmatch
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..catalog.keys import KeyMap, map_key
from ..catalog.model import Entry
from ..errors import KeyNotFoundError, UsageError
from .source import Source

__all__ = ["Leaf", "Load", "Match", "aligned_key_map", "match_keys"]

#: Reads the decoded values of object entries, in one batch.
Load = Callable[[list[Entry]], list[Any]]


@dataclass(frozen=True)
class Leaf:
    """A value inside an object entry, at ``inner`` (a dotted path below the entry's key):
    where the other side keeps that path as an entry of its own."""

    entry: Entry
    inner: str
    value: Any

    @property
    def key(self) -> str:
        return f"{self.entry.key}.{self.inner}"


class Match(NamedTuple):
    """What is compared at one mapped key ``name``: an entry or a leaf of an object per side,
    and the mapped names of the entries they come from (``keys`` globs may name an object)."""

    name: str
    a: Entry | Leaf | None
    b: Entry | Leaf | None
    owners: tuple[str, ...] = ()


def match_keys(
    ckpt_a: Source,
    ckpt_b: Source,
    key_map: KeyMap,
    keys: Sequence[str] | str | None,
    loads: tuple[Load, Load],
    notes: list[str],
) -> list[Match]:
    """What to compare per mapped key: a's keys in order, then those only in b. An object on
    one side whose key the other side has entries below is split into leaves at those paths."""
    patterns = [keys] if isinstance(keys, str) else list(keys) if keys is not None else None
    side_a, clashes_a = _mapped(ckpt_a, key_map, skip_alternates=patterns is None)
    side_b, clashes_b = _mapped(ckpt_b, key_map, skip_alternates=patterns is None)
    flat_a = _flattened(side_a, _expanded(side_a, side_b, loads[0], "a", patterns, notes))
    flat_b = _flattened(side_b, _expanded(side_b, side_a, loads[1], "b", patterns, notes))
    matches = []
    for name, (item, owner) in flat_a.items():
        other, other_owner = flat_b.get(name, (None, None))
        matches.append(Match(name, item, other, tuple(filter(None, (owner, other_owner)))))
    matches += [
        Match(n, None, item, (owner,)) for n, (item, owner) in flat_b.items() if n not in flat_a
    ]
    if patterns is not None:
        matches = [m for m in matches if _selected(m, patterns)]
        if not matches:  # a mistyped glob must not "pass"
            raise KeyNotFoundError(
                f"{ckpt_a.url}, {ckpt_b.url}: no key matches {keys!r} ({ckpt_a.catalog.hint(keys)})"
            )
        for label, ckpt, present in (
            ("a", ckpt_a, any(m.a is not None for m in matches)),
            ("b", ckpt_b, any(m.b is not None for m in matches)),
        ):
            if not present:
                globs = ", ".join(map(repr, patterns))
                notes.append(f"no key of {label} matches {globs} ({ckpt.catalog.hint(patterns)})")
    for clashes in (clashes_a, clashes_b):
        for match in matches:
            clash = clashes.get(match.name) or next(
                filter(None, map(clashes.get, match.owners)), None
            )
            if clash:
                raise UsageError(clash)
    paired = any(m.a is not None and m.b is not None for m in matches)
    if patterns is None and flat_a and flat_b and not paired:
        notes.append(
            f"no key of a pairs with a key of b (a's groups: {_groups_text(side_a)}; b's: "
            f"{_groups_text(side_b)}); --key-map OLD=NEW renames a key prefix on both sides"
        )
    return matches


def _selected(match: Match, patterns: list[str]) -> bool:
    """Whether a glob names the match's key, an object holding it, or either side's own key
    (``last.state_dict.w``, which pairs as ``model.w``)."""
    own = (item.key for item in (match.a, match.b) if item is not None)
    return any(
        fnmatch.fnmatchcase(name, pattern)
        for name in (match.name, *match.owners, *own)
        for pattern in patterns
    )


def _groups_text(side: Mapping[str, Entry]) -> str:
    groups = list(dict.fromkeys(name.split(".", 1)[0] for name in side))
    return ", ".join(groups[:8]) + (" …" if len(groups) > 8 else "")


def _mapped(
    ckpt: Source, key_map: KeyMap, *, skip_alternates: bool
) -> tuple[dict[str, Entry], dict[str, str]]:
    """Mapped key → entry of ``ckpt`` (alternate groups left out unless globs were given), and
    mapped key → the error to raise should that key be compared: two keys map to it."""
    skipped = set(ckpt.catalog.facts.alternate_groups) if skip_alternates else set()
    out: dict[str, Entry] = {}
    clashes: dict[str, str] = {}
    for entry in ckpt.catalog.entries.values():
        if entry.group in skipped:  # views of bytes other keys hold: compared there
            continue
        name = map_key(_paired_key(entry), key_map)
        if name in out:
            clashes.setdefault(
                name, f"{ckpt.url}: keys {out[name].key!r} and {entry.key!r} both map to {name!r}"
            )
            continue
        out[name] = entry
    return out, clashes


def _paired_key(entry: Entry) -> str:
    """The key ``entry`` pairs by: its own, or for a model a layout keeps under another key
    (Lightning's ``last.state_dict.w``, a flat DCP's ``w``) the key unshard gives it in
    ``model.safetensors`` (``model.w``), so a checkpoint lines up with its unsharded output."""
    if entry.model_depth is None:
        return entry.key
    return ".".join(map(str, (entry.group, *entry.inner_path)))


def _expanded(
    side: Mapping[str, Entry],
    other: Mapping[str, Entry],
    load: Load,
    label: str,
    patterns: list[str] | None,
    notes: list[str],
) -> dict[str, list[tuple[str, Leaf]]]:
    """Mapped key of each object of ``side`` that ``other`` holds as entries below that key →
    the object's leaves at those paths, as ``(mapped key, leaf)``. A leaf where ``side`` has an
    entry of its own (a writer's hole for a tensor it stored apart) is left to that entry."""
    objects = [(n, e) for n, e in side.items() if e.kind == "object" and n not in other]
    if not objects:
        return {}
    ordered = sorted(other)
    below: dict[str, tuple[Entry, list[str]]] = {}
    for name, entry in objects:
        start = bisect.bisect_left(ordered, name + ".")
        names = ordered[start : bisect.bisect_left(ordered, name + "/", start)]  # "/" follows "."
        if names and (
            patterns is None or _selected(Match(name, None, None, tuple(names)), patterns)
        ):
            below[name] = entry, names
    out: dict[str, list[tuple[str, Leaf]]] = {}
    loaded = load([entry for entry, _ in below.values()])
    for (name, (entry, names)), value in zip(below.items(), loaded, strict=True):
        leaves = _split(value, {n[len(name) + 1 :] for n in names})
        if leaves is None:  # not a container: compared whole (one side each)
            continue
        out[name] = []
        for inner, leaf in leaves:
            full = f"{name}.{inner}"
            if full in side:
                if leaf is not None:
                    notes.append(
                        f"{label}: {side[full].key!r} is also a value inside object "
                        f"{entry.key!r}; the entry is compared"
                    )
                continue
            out[name].append((full, Leaf(entry, inner, leaf)))
    return out


def _flattened(
    side: Mapping[str, Entry], expanded: Mapping[str, list[tuple[str, Leaf]]]
) -> dict[str, tuple[Entry | Leaf, str]]:
    """Mapped key → (entry or leaf, the mapped key of the entry it comes from)."""
    out: dict[str, tuple[Entry | Leaf, str]] = {}
    for name, entry in side.items():
        if name in expanded:
            out.update((full, (leaf, name)) for full, leaf in expanded[name])
        else:
            out[name] = entry, name
    return out


def _split(value: Any, wanted: set[str]) -> list[tuple[str, Any]] | None:
    """``(dotted path, value)`` leaves of ``value``, descending through mappings, lists and
    tuples only where a path of ``wanted`` goes deeper (as torch's flattening names them);
    None when ``value`` itself is no such container, or an empty one."""
    inner = {prefix for path in wanted for prefix in _dotted_prefixes(path)}
    found: list[tuple[str, Any]] = []
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, node = stack.pop()
        children = _children(node) if not path or (path in inner and path not in wanted) else None
        if children is None:
            found.append((path, node))
        else:
            prefix = f"{path}." if path else ""
            stack.extend((prefix + segment, child) for segment, child in reversed(children))
    return None if not found or found[0][0] == "" else found


def _children(node: Any) -> list[tuple[str, Any]] | None:
    """A container's children by the key segment torch's flattening gives them."""
    if isinstance(node, Mapping):
        if not all(isinstance(k, (str, int)) for k in node):
            return None
        return [(str(k), v) for k, v in node.items()]
    if isinstance(node, (list, tuple)):
        return [(str(i), v) for i, v in enumerate(node)]
    return None


def _dotted_prefixes(name: str) -> Iterator[str]:
    """``a``, ``a.b`` for ``a.b.c``."""
    at = name.find(".")
    while at > 0:
        yield name[:at]
        at = name.find(".", at + 1)


def aligned_key_map(ckpt_a: Source, ckpt_b: Source, notes: list[str]) -> dict[str, str] | None:
    """The prefix map that lines up a side whose keys all sit under one group (a single file,
    named by its stem: ``torch_ref.model.…``) with the other side, when it pairs every one of
    that side's keys and fewer paired before; else None (with a hint when one pairs more)."""
    if _groups(ckpt_a) == _groups(ckpt_b):  # the usual case, decided without mapping keys
        return None
    names = (_names(ckpt_a), _names(ckpt_b))
    groups = [{n.split(".", 1)[0] for n in side} for side in names]
    if groups[0] == groups[1] or not (names[0] and names[1]):
        return None
    one_file = [len(ckpt.detection.files or ()) == 1 for ckpt in (ckpt_a, ckpt_b)]
    best: tuple[int, dict[str, str], str] | None = None
    hint: tuple[int, str] | None = None
    for one in sorted((0, 1), key=lambda i: not one_file[i]):  # a side that is one file first
        label, other, n = "ab"[one], "ab"[1 - one], len(names[one])
        for candidate, paired, score in _stem_maps(names[one], names[1 - one], groups[one]):
            ((old, new),) = candidate.items()
            if paired == n and (best is None or score > best[0]):
                note = (
                    f"{label} is one file, whose keys ckptkit names under its stem {old[:-1]!r}: "
                    f"matched as with --key-map {old}={new}, which pairs all {n} of them "
                    "(pass --key-map to choose another map)"
                )
                best = score, candidate, note
            elif paired < n and (hint is None or paired > hint[0]):
                note = (
                    f"{label}'s keys all sit under {old!r}: --key-map {old}={new} would pair "
                    f"{paired} of its {n} keys with {other}'s"
                )
                hint = paired, note
    if best is None:
        notes.extend([hint[1]] if hint is not None else [])
        return None
    notes.append(best[2])
    return best[1]


def _stem_maps(
    mine: list[str], theirs: list[str], my_groups: set[str]
) -> Iterator[tuple[dict[str, str], int, int]]:
    """``(key map, keys of mine it pairs, keys of both it pairs)`` per rename of my one group's
    prefix (dropped, or another group of theirs) that pairs more of mine than no map does."""
    if len(my_groups) != 1:
        return
    (stem,) = my_groups
    before = _paired_count(mine, theirs)
    if before == len(mine):
        return
    for new in ["", *sorted({n.split(".", 1)[0] for n in theirs} - my_groups)]:
        candidate = {f"{stem}.": f"{new}." if new else ""}
        mapped_mine = [map_key(n, candidate) for n in mine]
        mapped_theirs = [map_key(n, candidate) for n in theirs]
        paired = _paired_count(mapped_mine, mapped_theirs)
        if paired > before:
            yield candidate, paired, paired + _paired_count(mapped_theirs, mapped_mine)


def _groups(ckpt: Source) -> set[str]:
    """The groups of the keys diff compares, as stored (wrapper segments not dropped)."""
    skipped = set(ckpt.catalog.facts.alternate_groups)
    return {e.group for e in ckpt.catalog.entries.values()} - skipped


def _names(ckpt: Source) -> list[str]:
    """The keys diff compares, wrapper segments dropped (alternate groups left out)."""
    skipped = set(ckpt.catalog.facts.alternate_groups)
    return [map_key(e.key) for e in ckpt.catalog.entries.values() if e.group not in skipped]


def _paired_count(mine: Iterable[str], theirs: Iterable[str]) -> int:
    """How many of ``mine`` have a partner in ``theirs``: the same key, a key below it (it is
    an object split there) or a key above it (an object holding it)."""
    exact = set(theirs)
    inner = {prefix for name in exact for prefix in _dotted_prefixes(name)}
    return sum(
        name in exact or name in inner or any(p in exact for p in _dotted_prefixes(name))
        for name in mine
    )
