"""Name safety: whether a file name read from a checkpoint (or given for an output) is a safe
relative name. Pure functions; :meth:`Storage._resolve <ckptkit.storage.Storage>` applies them."""

from __future__ import annotations

import re
import urllib.parse

import fsspec

__all__ = ["is_http", "name_problem"]

#: Characters no file name from a checkpoint may hold: C0/C1 controls (NUL included) and lone
#: surrogates (not encodable as a file name).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def name_problem(name: object, *, url: bool = False) -> str | None:
    """Why ``name`` is not a safe relative file name, or None: a non-empty ``str``, relative,
    without empty, ``.`` or ``..`` components, control characters or backslashes; for HTTP
    stores (``url``) also no ``?`` / ``#`` and still safe once percent-decoded."""
    if not isinstance(name, str):
        return f"not a string but {type(name).__name__}"
    if not name:
        return "empty"
    if name.startswith("/"):
        return "an absolute path"
    if "\\" in name:
        return "a backslash in it"
    if (bad := _CONTROL.search(name)) is not None:
        return f"character U+{ord(bad.group()):04X} (a control character or lone surrogate) in it"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "an empty, '.' or '..' component"
    if url:
        if "?" in name or "#" in name:
            return "a URL query or fragment in it"
        decoded = urllib.parse.unquote(name)
        if decoded != name and (problem := name_problem(decoded)) is not None:
            return f"{problem}, once percent-decoded"
    return None


def is_http(url: str) -> bool:
    """Whether ``url`` (possibly chained, ``simplecache::https://…``) is served over HTTP."""
    return any(fsspec.utils.get_protocol(part) in ("http", "https") for part in url.split("::"))
