"""What a format adapter reports when it recognises a location."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..storage import Storage


@dataclass
class Detection:
    """``format`` found at ``storage`` (possibly a sub-directory of what the user named)."""

    format: str
    storage: Storage
    evidence: list[str] = field(default_factory=list)
