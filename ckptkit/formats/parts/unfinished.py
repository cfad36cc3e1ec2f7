"""Saves that did not finish: OLMo and OLMo-core write into ``stepN-tmp`` and rename it when
done, and write a completion marker (``config.yaml``, ``.metadata.json``) last. Such a
checkpoint still opens; its facts say why it looks unfinished and a warning names it."""

from __future__ import annotations

import posixpath
import warnings

from ...storage import Store

__all__ = ["name_reason", "check_unfinished", "OLMO_CONFIG", "check_olmo_config"]


def name_reason(storage: Store) -> str | None:
    """Why the directory's name says the save did not finish (``stepN-tmp``), or None."""
    name = posixpath.basename(storage.root.rstrip("/"))
    if name.endswith("-tmp"):
        return f"the directory is named {name!r}: a save still in progress or interrupted"
    return None


def check_unfinished(storage: Store, *reasons: str | None) -> str | None:
    """Why the save at ``storage`` looks unfinished (its ``-tmp`` name, then ``reasons``), with
    a warning naming the directory; None when nothing says so."""
    found = [r for r in (name_reason(storage), *reasons) if r]
    if not found:
        return None
    text = "; ".join(found)
    warnings.warn(
        f"{storage.describe()}: unfinished checkpoint ({text}); opened what is there",
        stacklevel=4,
    )
    return text


#: OLMo writes its run config last: a step directory without it did not finish saving.
OLMO_CONFIG = "config.yaml"


def check_olmo_config(storage: Store) -> str | None:
    """:func:`check_unfinished` for OLMo layouts whose completion marker is ``config.yaml``."""
    missing = None if storage.exists(OLMO_CONFIG) else f"no {OLMO_CONFIG} (OLMo writes it last)"
    return check_unfinished(storage, missing)
