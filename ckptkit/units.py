"""Counts for people: ``1.2 MB`` out, ``5GB`` / ``512MiB`` in, and ``1 file`` / ``2 files``."""

from __future__ import annotations

import re

from .errors import UsageError

__all__ = ["human_bytes", "parse_size", "plural"]


def human_bytes(n: float) -> str:
    """``1234567`` → ``'1.2 MB'`` (decimal units, as disk sizes are quoted)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)


def parse_size(value: int | str) -> int:
    """``5GB`` → 5·10⁹, ``512MiB`` → 512·2²⁰, ints unchanged (the HF ``max_shard_size`` style)."""
    if isinstance(value, int):
        return value
    match = _SIZE.match(value)
    if not match:
        raise UsageError(f"cannot read size {value!r} (try 5GB, 500MB, 2GiB)")
    number, unit = float(match.group(1)), match.group(2).upper()
    base = 1024 if "I" in unit else 1000
    power = "BKMGT".index(unit[0]) if unit else 0
    return int(number * base**power)


def plural(
    count: int, noun: str, plural_noun: str | None = None, *, thousands: bool = False
) -> str:
    """``count`` with ``noun`` in the number it takes: ``1 file``, ``2 files``, ``0 files``
    (``plural_noun`` for the irregular ones: ``plural(n, "entry", "entries")``; ``thousands``
    groups the digits: ``12,700 elements``)."""
    number = f"{count:,}" if thousands else f"{count}"
    return f"{number} {noun if count == 1 else plural_noun or noun + 's'}"
