"""Placeholders for globals a pickle names outside the allowlist: :class:`Opaque` instances of
one class per global, which record what the pickle did with them and never run anything.

The classes are shared while in use and collected with the values that use them (see
:func:`opaque_class`): a long-lived process (a notebook kernel) opening checkpoint after
checkpoint keeps only those of the values still alive. How many one pickle may name is bounded
by :class:`~ckptkit.decoding.pickle_limits.Limits` (``max_globals``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["Opaque", "is_opaque", "opaque_class"]


class _OpaqueGlobal(type):
    """The type of placeholder classes: a global a pickle names shows as that name (an object's
    type column says ``class``, as for a class it refers to)."""

    global_name = "class"

    def __repr__(cls) -> str:
        return f"<class {cls.global_name}>"


class Opaque(metaclass=_OpaqueGlobal):
    """A value whose class the allowlist does not know: kept by name and arguments, never run.

    It records exactly what the pickle did, so a writer can replay it without the class:
    ``called`` tells ``cls(*args)`` (REDUCE) from ``cls.__new__(cls, *args)`` (NEWOBJ),
    ``state`` is what BUILD set, ``listitems`` / ``dictitems`` what APPENDS / SETITEMS added.
    The class itself (a subclass per global) spells the global as ``module`` and ``qualname``.
    """

    global_name = "?"
    module = "?"
    qualname = "?"

    def __new__(cls, *args, **kwargs):  # NEWOBJ lands here only; REDUCE then calls __init__
        obj = object.__new__(cls)
        obj.args, obj.kwargs, obj.state, obj.called = args, kwargs, None, False
        obj.listitems, obj.dictitems = [], []
        return obj

    def __init__(self, *args, **kwargs) -> None:
        self.called = True

    def __setstate__(self, state) -> None:
        self.state = state

    def append(self, item) -> None:
        self.listitems.append(item)

    def extend(self, items) -> None:
        self.listitems.extend(items)

    def __setitem__(self, key, value) -> None:
        self.dictitems.append((key, value))

    @property
    def items(self) -> list:
        """Appended items, then ``(key, value)`` pairs set, as one list (for comparisons)."""
        return [*self.listitems, *self.dictitems]

    def __repr__(self) -> str:
        return f"<{self.global_name}{self.args!r}>" if self.args else f"<{self.global_name}>"

    def __bounded_repr__(self, render: Callable[[Any], str]) -> str:
        """:meth:`__repr__` within :func:`bounded_repr`'s budget (for values not yet checked)."""
        return f"<{self.global_name}{render(self.args)}>" if self.args else f"<{self.global_name}>"


#: Placeholder classes by ``(module, qualname)``, held weakly: one class per global while any
#: decoded value (of any open checkpoint) uses it, so placeholders of one global compare alike
#: across checkpoints (``diff``), and none outlives the values that use it (a notebook kernel
#: opening checkpoint after checkpoint keeps only the classes of those still open).
_PLACEHOLDER_CLASSES: weakref.WeakValueDictionary[tuple[str, str], type[Opaque]] = (
    weakref.WeakValueDictionary()
)
_PLACEHOLDER_LOCK = threading.Lock()


def opaque_class(module: str, qualname: str) -> type[Opaque]:
    """The placeholder class of the global ``module.qualname`` (made when none is alive)."""
    with _PLACEHOLDER_LOCK:
        cls = _PLACEHOLDER_CLASSES.get((module, qualname))
        if cls is None:
            cls = _PLACEHOLDER_CLASSES[(module, qualname)] = type(
                "Opaque",
                (Opaque,),
                {"global_name": f"{module}.{qualname}", "module": module, "qualname": qualname},
            )
        return cls


def is_opaque(value: Any) -> bool:
    """True for placeholders of globals the allowlist refused (see :class:`Opaque`)."""
    return isinstance(value, Opaque)
