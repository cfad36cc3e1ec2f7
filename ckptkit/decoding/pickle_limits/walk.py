"""The value walk: a loaded value checked once, iteratively, for nesting depth, container sizes,
sharing and cycles, before any recursive code (``repr``, flattening, ``nest``) touches it."""

from __future__ import annotations

from collections.abc import Callable
from itertools import repeat
from typing import Any

import numpy as np

from ...errors import CorruptRecordError, PickleLimitError
from .limits import Limits, limit_error

__all__ = ["check_value"]


_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), range, np.generic)


def check_value(
    value: Any, limits: Limits, source: str, children: Callable[[Any], Any] | None = None
) -> None:
    """Walk ``value`` once, without recursion, refusing cycles (but those through an object when
    ``limits.object_cycles``), nesting deeper than ``limits.max_depth``, containers or tree sizes
    beyond ``limits.max_items``, huge ints and numpy object arrays. ``children(obj)`` lists what
    else to descend into (placeholders). A reference back to a node on the current path counts
    as a leaf, so the walk and its sizes stay bounded with cycles too."""
    done = _Finished(limits, source)
    path = _Path()
    stack: list[tuple[Any, list[Any] | None]] = [(value, None)]
    while stack:
        obj, kids = stack[-1]
        if kids is None:
            if id(obj) in done.heights:
                stack.pop()
                continue
            kids = _children(obj, limits, source, children)
            if kids:
                pending = path.descend(obj, kids, done.heights, limits, source)
                if pending is None:  # obj is on the path already: a cycle, allowed
                    stack.pop()
                    continue
                stack[-1] = (obj, kids)
                if pending:
                    stack.extend(zip(pending, repeat(None)))
                    continue
        stack.pop()
        if kids:
            path.leave(id(obj))
        done.add(obj, kids)
    _check_sharing(done.sizes.get(id(value), 1), len(done.sizes), source)


class _Finished:
    """Measures of the nodes :func:`check_value` has finished, by id; a kid not among them is
    a reference back up the path and counts as a leaf."""

    def __init__(self, limits: Limits, source: str) -> None:
        self.limits, self.source = limits, source
        self.heights: dict[int, int] = {}  # id → height
        self.tuple_heights: dict[int, int] = {}  # id → tuples nested in tuples (hashing recurses)
        self.sizes: dict[int, int] = {}  # id → nodes of the subtree counted as a tree
        self.keep: list[Any] = []  # ids stay valid while their objects live

    def add(self, obj: Any, kids: list[Any]) -> None:
        key, limits = id(obj), self.limits
        heights, sizes = self.heights, self.sizes
        heights[key] = 1 + max((heights.get(id(k), 0) for k in kids), default=-1) if kids else 0
        if heights[key] > limits.max_depth:  # shared parts can nest deeper than the walk went
            raise limit_error(self.source, f"values nested more than {limits.max_depth} deep")
        if isinstance(obj, tuple):
            depth = 1 + max((self.tuple_heights.get(id(k), 0) for k in kids), default=0)
            self.tuple_heights[key] = depth
            if depth > limits.max_tuple_depth:
                raise limit_error(
                    self.source, f"tuples nested more than {limits.max_tuple_depth} deep"
                )
        size = 1 + sum(sizes.get(id(k), 1) for k in kids) if kids else 1
        if size > limits.max_items:
            raise limit_error(
                self.source, f"a value of over {limits.max_items} nodes (shared parts)"
            )
        sizes[key] = size
        self.keep.append(obj)


_CONTAINERS = (dict, list, tuple, set, frozenset)


class _Path:
    """The nodes from the root to the one being walked, with how many of them are objects
    (not builtin containers) up to each position, to tell a cycle through an object."""

    def __init__(self) -> None:
        self.index: dict[int, int] = {}  # id → position on the path
        self.objects: list[int] = [0]  # objects among the first i nodes
        self.nodes: list[Any] = []

    def descend(
        self, obj: Any, kids: list[Any], finished: dict[int, int], limits: Limits, source: str
    ) -> list[Any] | None:
        """Put ``obj`` on the path and return its kids still to walk (a kid on the path is a
        cycle: checked, not walked); None when ``obj`` itself is on the path already."""
        if id(obj) in self.index:
            self.cycle(id(obj), limits, source)
            return None
        self.enter(obj)
        if len(self.index) > limits.max_depth:
            raise limit_error(source, f"values nested more than {limits.max_depth} deep")
        pending = []
        for kid in kids:
            if id(kid) in self.index:
                self.cycle(id(kid), limits, source, kid)
            elif id(kid) not in finished:
                pending.append(kid)
        return pending

    def enter(self, obj: Any) -> None:
        self.index[id(obj)] = len(self.nodes)
        self.nodes.append(obj)
        self.objects.append(self.objects[-1] + (not isinstance(obj, _CONTAINERS)))

    def leave(self, key: int) -> None:
        del self.index[key]
        self.nodes.pop()
        self.objects.pop()

    def cycle(self, key: int, limits: Limits, source: str, kid: Any = None) -> None:
        """A reference (``kid`` of the last node) back to the node ``key`` on the path: allowed
        when the loop passes through an object and ``limits.object_cycles``, else refused
        naming where it is."""
        start = self.index[key]
        if limits.object_cycles and self.objects[-1] - self.objects[start] > 0:
            return
        raise CorruptRecordError(
            f"{source}: the pickle holds a reference cycle at {self.where(start, kid)}"
        )

    def where(self, start: int, kid: Any) -> str:
        """The loop as a path of keys: ``<value>['a'][0], which refers back to <value>['a']``."""
        steps = ["<value>"]
        for parent, child in zip(self.nodes, [*self.nodes[1:], kid], strict=False):
            steps.append(_step(parent, child))
        return f"{''.join(steps)}, which refers back to {''.join(steps[: start + 1])}"


def _step(parent: Any, child: Any) -> str:
    if isinstance(parent, dict):
        found = next((k for k, v in parent.items() if v is child), "?")
        return f"[{found!r}]"
    if isinstance(parent, list | tuple):
        found = next((i for i, v in enumerate(parent) if v is child), "?")
        return f"[{found}]"
    return f".<{type(parent).__name__}>"


def _check_sharing(tree: int, objects: int, source: str) -> None:
    """Refuse a value of ``objects`` distinct objects that unfolds into ``tree`` nodes.

    Shared parts are walked once by :func:`check_value` but once per reference by recursive
    code (repr, DCP flattening, ``_materialize``): a DAG of lists sharing halves is exponential
    for them."""
    if tree > 16 * objects + (1 << 20):
        raise limit_error(
            source, f"{objects} objects shared so often that they unfold into {tree} nodes"
        )


def _children(
    obj: Any, limits: Limits, source: str, children: Callable[[Any], Any] | None
) -> list[Any]:
    if isinstance(obj, bool) or obj is None:
        return []
    if isinstance(obj, int):
        if obj.bit_length() > 8 * limits.max_int_bytes:
            raise limit_error(source, f"an integer of {obj.bit_length()} bits")
        return []
    if isinstance(obj, (*_ATOMS, type)) or callable(obj):
        return []
    if isinstance(obj, np.ndarray | np.dtype):
        dt = obj.dtype if isinstance(obj, np.ndarray) else obj
        if dt.hasobject:
            raise PickleLimitError(f"{source}: numpy object arrays are not allowed")
        return []
    if isinstance(obj, dict):
        items = [*obj.keys(), *obj.values()]
    elif isinstance(obj, list | tuple | set | frozenset):
        items = list(obj)
    elif isinstance(obj, slice):
        items = [obj.start, obj.stop, obj.step]
    else:
        items = _object_children(obj, children)
    if len(items) > limits.max_items:
        raise limit_error(source, f"a container of {len(items)} items")
    return items


def _object_children(obj: Any, children: Callable[[Any], Any] | None) -> list[Any]:
    """What an object other than a builtin container refers to: ``children(obj)`` when it says,
    else its attributes (``__dict__`` or ``__slots__``)."""
    extra = children(obj) if children is not None else None
    if extra is not None:
        return list(extra)
    if hasattr(obj, "__dict__"):
        return list(vars(obj).values())
    return [getattr(obj, s, None) for s in getattr(type(obj), "__slots__", ())]
