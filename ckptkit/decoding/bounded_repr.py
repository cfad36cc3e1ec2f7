"""A ``repr`` that stays small and fast for anything a checkpoint's pickle built.

A pickle of a few hundred bytes can build a list whose two items are the same list, 80 levels
deep: ``repr`` would print 2**80 leaves, and a stand-in that formats its argument into an error
message while unpickling would hang with memory growing. :func:`bounded_repr` caps nesting
depth, items per container and characters, prints a container met a second time (shared or in
a cycle) as ``<same list>``, shortens long strings, bytes and integers, and calls the ``repr``
of no object it does not know to be small, so its work is bounded by its budget whatever the
value. Within the budget, builtin values print as ``repr`` prints them.

A class may say how it is shown by defining ``__bounded_repr__(self, render)``, returning its
text with ``render(part)`` giving the bounded text of each decoded part it holds.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..dtypes import DType

__all__ = ["bounded_repr"]

#: Types whose own ``repr`` is short whatever a pickle put in them (classes too: a pickle names
#: only allowlisted ones and placeholders, which print their name).
_SMALL_REPRS = (float, complex, type(None), type(Ellipsis), range, slice, DType, np.dtype, type)


class _Full(Exception):
    """The character budget is spent: stop walking."""


def bounded_repr(value: Any, *, depth: int = 6, items: int = 16, chars: int = 200) -> str:
    """``repr(value)`` for an untrusted decoded value, at most ``chars`` characters long:
    containers are followed ``depth`` levels down and show their first ``items`` elements,
    a container met again prints as ``<same list>``; the work done is O(``chars``)."""
    renderer = _Renderer(depth, items, chars)
    with contextlib.suppress(_Full):
        renderer.render(value, 0)
    text = "".join(renderer.parts)
    return text if len(text) <= chars else text[: max(chars - 3, 0)] + "..."[:chars]


class _Renderer:
    """One rendering: the text so far, and the containers already printed (by id)."""

    def __init__(self, depth: int, items: int, chars: int) -> None:
        self.depth, self.items, self.chars = depth, max(items, 0), max(chars, 0)
        self.parts: list[str] = []
        self.length = 0
        self.seen: set[int] = set()
        self.keep: list[Any] = []  # ids stay unique while their objects live

    def emit(self, text: str) -> None:
        self.parts.append(text)
        self.length += len(text)
        if self.length > self.chars:
            raise _Full

    def render(self, value: Any, level: int) -> None:
        if isinstance(value, str | bytes | bytearray):
            self.emit(repr(value[: self.chars + 1]))  # the cut is past the budget
        elif isinstance(value, int):
            self.emit(_int(value, self.chars))
        elif isinstance(value, _SMALL_REPRS) or (
            isinstance(value, np.generic) and not isinstance(value, np.void)
        ):
            self.emit(repr(value)[: self.chars + 1])
        elif isinstance(value, dict | list | tuple | set | frozenset):
            self.container(value, level)
        else:
            self.other(value, level)

    def first_time(self, value: Any) -> bool:
        """True the first time ``value`` is met; after that its ``<same …>`` is printed."""
        if id(value) in self.seen:
            self.emit(f"<same {type(value).__name__}>")
            return False
        self.seen.add(id(value))
        self.keep.append(value)
        return True

    def container(self, value: Any, level: int) -> None:
        opening, closing = _brackets(value)
        if not value:
            self.emit(opening + closing)
            return
        if not self.first_time(value):
            return
        if level >= self.depth:
            self.emit(f"{opening}...{closing}")
            return
        self.emit(opening)
        pairs = isinstance(value, dict)
        shown = itertools.islice(value.items() if pairs else value, self.items)
        for index, item in enumerate(shown):
            if index:
                self.emit(", ")
            if pairs:
                self.render(item[0], level + 1)
                self.emit(": ")
                self.render(item[1], level + 1)
            else:
                self.render(item, level + 1)
        if len(value) > self.items:
            self.emit(", ..." if self.items else "...")
        elif type(value) is tuple and len(value) == 1:
            self.emit(",")
        self.emit(closing)

    def other(self, value: Any, level: int) -> None:
        """An object: as its class says (``__bounded_repr__``), else named by its type."""
        custom: Callable[[Callable[[Any], str]], str] | None = getattr(
            type(value), "__bounded_repr__", None
        )
        if custom is not None:
            if self.first_time(value):
                self.emit(custom(value, lambda part: self.nested(part, level + 1)))
        elif isinstance(value, np.ndarray):
            self.emit(f"<ndarray {value.dtype} {list(value.shape)}>")
        elif callable(value) and hasattr(value, "__qualname__"):
            self.emit(f"<function {str(value.__qualname__)[: self.chars]}>")
        else:
            self.emit(f"<{type(value).__qualname__} object>")

    def nested(self, value: Any, level: int) -> str:
        """The text of ``value`` as part of an object's text (same budget, one level down)."""
        parts, self.parts = self.parts, []
        try:
            self.render(value, level)
            return "".join(self.parts)
        finally:
            spent, self.parts = self.parts, parts
            self.length -= sum(map(len, spent))  # counted again when the caller emits it


_BRACKETS = {dict: "{}", list: "[]", tuple: "()", set: "{}", frozenset: "{}"}


def _brackets(value: Any) -> tuple[str, str]:
    """Opening and closing text of a builtin container, as ``repr`` has them (a subclass, a
    frozenset and an empty set named around them)."""
    base = next(t for t in _BRACKETS if isinstance(value, t))
    name = type(value).__name__
    if not value and (type(value) is not base or base in (set, frozenset)):
        return f"{name}(", ")"
    opening, closing = _BRACKETS[base]
    if type(value) is base and base is not frozenset:
        return opening, closing
    return f"{name}({opening}", f"{closing})"


def _int(value: int, chars: int) -> str:
    """An int's digits, or its size when they would not fit (``repr`` of a huge int is slow,
    and refused past 4300 digits)."""
    bits = value.bit_length()
    if bits > min(3 * chars + 64, 14_000):
        return f"<int of {bits} bits>"
    return repr(value)
