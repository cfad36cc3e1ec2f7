"""The one place where names read from a checkpoint become names of output files and keys.

A checkpoint's top-level keys (groups) become file stems (``model`` → ``model.pt``), and its
nested paths become safetensors keys (``("blocks", 0, "w")`` → ``blocks.0.w``). Both come from
an untrusted file, so a group is percent-encoded into a stem that cannot leave the destination
folder (no separators, no ``.``/``..``, no control characters, no Windows device names, bounded
length) and that :func:`decode_stem` turns back into the same group; every collision (two
groups on one file, two paths on one safetensors key, a tensor where another entry needs a
sub-tree) is an :class:`~ckptkit.errors.OutputNameError` naming both, raised before any byte is
written.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable, Mapping

from ..errors import OutputNameError

__all__ = [
    "MAX_STEM_BYTES",
    "encode_stem",
    "decode_stem",
    "group_of_file",
    "check_distinct_files",
    "safetensors_names",
]

#: Bytes of a stem's encoding at most: the longest suffix ckptkit appends
#: (``-00001-of-00002.safetensors.index.json`` ≈ 40 bytes) still fits a 255-byte file name.
MAX_STEM_BYTES = 200
#: Characters kept as they are (besides letters, digits and ``_.-~``, which quote never encodes).
_KEEP = "+=,@"
#: Names Windows reserves for devices, with or without an extension.
_RESERVED = re.compile(r"^(con|prn|aux|nul|com[0-9]|lpt[0-9])(\..*)?$", re.IGNORECASE)
#: Endings that the readers of ckptkit's own outputs strip from a stem (side files, HF shards).
_TAIL = re.compile(r"(\.objects|-\d+-of-\d+)$")
#: Safetensors keys that its header reserves.
_RESERVED_KEYS = frozenset({"__metadata__"})


def encode_stem(group: object) -> str:
    """``group`` as a file-name stem that stays in its folder and decodes back to ``group``.

    Everything outside ``[A-Za-z0-9_.~+=,@-]`` is percent-encoded (``/`` → ``%2F``), and so are
    a leading dot (``..`` → ``%2E.``), trailing dots, Windows device names and endings that
    ckptkit's readers would strip (``.objects``, ``-1-of-2``).
    """
    name = str(group)
    if not name:
        raise OutputNameError("an empty top-level key cannot name an output file")
    try:
        stem = urllib.parse.quote(name, safe=_KEEP, errors="strict")
    except UnicodeEncodeError as exc:
        raise OutputNameError(f"top-level key {name!r} is not valid Unicode text") from exc
    if stem.startswith("."):
        stem = "%2E" + stem[1:]
    if stem.endswith("."):
        stem = stem[:-1] + "%2E"
    if _RESERVED.match(stem):
        stem = f"%{ord(stem[0]):02X}{stem[1:]}"
    tail = _TAIL.search(stem)
    if tail is not None:  # ".objects" → "%2Eobjects", "-1-of-2" → "%2D1-of-2"
        at = tail.start()
        stem = f"{stem[:at]}%{ord(stem[at]):02X}{stem[at + 1 :]}"
    if len(stem.encode()) > MAX_STEM_BYTES:
        raise OutputNameError(
            f"top-level key {_shown(name)} is too long for a file name "
            f"({len(stem.encode())} bytes encoded, at most {MAX_STEM_BYTES})"
        )
    return stem


def decode_stem(stem: str) -> str:
    """The group a stem written by :func:`encode_stem` stands for (a stem whose ``%XX`` do not
    decode to text is taken as it is)."""
    try:
        return urllib.parse.unquote(stem, errors="strict")
    except UnicodeDecodeError:
        return stem


#: ``model.pt``, ``model.objects.pt`` (ckptkit's side file), ``model-00001-of-00002.bin``,
#: ``model.pth.tar``, ``model.safetensors`` → model
_CHECKPOINT_FILE = re.compile(
    r"^(.+?)(?:-\d+-of-\d+)?(?:\.objects)?\.(?:pth\.tar|pt|pth|bin|ckpt|tar|jit|safetensors)$"
)


def group_of_file(name: str) -> str | None:
    """The group a checkpoint file holds: its name without checkpoint suffix, side-file tag or
    shard number, percent-decoded as :func:`encode_stem` wrote it; None for other names."""
    match = _CHECKPOINT_FILE.match(name)
    return decode_stem(match.group(1)) if match else None


def check_distinct_files(names_by_group: Mapping[str, Iterable[str]]) -> None:
    """Refuse two groups that would write the same output file."""
    owner: dict[str, str] = {}
    for group, names in names_by_group.items():
        for name in names:
            other = owner.setdefault(name, group)
            if other != group:
                raise OutputNameError(
                    f"top-level keys {_shown(other)} and {_shown(group)} would both be written "
                    f"to {name!r}; select one of them with groups="
                )


def safetensors_names(paths: Mapping[str, tuple]) -> dict[str, str]:
    """Dotted safetensors keys for entries (``key → path below the group``), refusing keys that
    two entries would share or that the format reserves."""
    names: dict[str, str] = {}
    owner: dict[str, str] = {}
    for key, path in paths.items():
        name = ".".join(map(str, path))
        if name in _RESERVED_KEYS:
            raise OutputNameError(f"{_shown(key)}: {name!r} is reserved in a safetensors header")
        other = owner.setdefault(name, key)
        if other != key:
            raise OutputNameError(
                f"{_shown(other)} and {_shown(key)} would both be safetensors key {name!r}; "
                'write them with to="torch", or leave one out with keys='
            )
        names[key] = name
    return names


def _shown(name: str) -> str:
    """A name for a message: quoted, control characters escaped, long names cut."""
    text = repr(name)
    return text if len(text) <= 120 else f"{text[:100]}…' ({len(name)} characters)"
