"""Common, benign classes decoded from their :class:`~ckptkit.unpickler.Opaque` placeholders.

The unpickler keeps every class outside its allowlist as a placeholder recording what the
pickle did (so a writer can replay it losslessly). For reading, :func:`decoded` turns the
placeholders of well-known harmless classes into real values built from their recorded
arguments and state, never by calling anything the pickle names: ``argparse.Namespace``,
``types.SimpleNamespace``, ``torch.device`` (as :class:`Device`), ``collections`` types and
OmegaConf ``DictConfig`` / ``ListConfig`` (their contents, as dicts and lists). Everything else
stays a placeholder. Reference cycles (OmegaConf nodes point back to their parents) become
:class:`CycleRef` markers, so the decoded value is a tree that any code may walk.
"""

from __future__ import annotations

import argparse
import collections
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import PickleLimitError
from .unpickler import Opaque

__all__ = ["MAX_DEPTH", "Device", "CycleRef", "decoded", "opaque_names", "Decode"]

#: Nesting the decoded walk follows at most (the value check bounds real values far below).
MAX_DEPTH = 200


@dataclass(frozen=True)
class Device:
    """A ``torch.device`` as a pickle describes it (``str()`` gives ``"cuda:0"``, which
    ``torch.device`` accepts); decoding needs no torch."""

    type: str
    index: int | None = None

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __repr__(self) -> str:
        index = "" if self.index is None else f", index={self.index}"
        return f"device(type={self.type!r}{index})"


@dataclass(frozen=True)
class CycleRef:
    """Where a decoded value refers back to one of its own containers (a reference cycle)."""

    target: str

    def __repr__(self) -> str:
        return f"<cycle to {self.target}>"


def decoded(value: Any) -> Any:
    """``value`` (as :func:`~ckptkit.unpickler.safe_loads` returned it) with known classes
    decoded and cycles marked; a new value, ``value`` itself is left unchanged."""
    return _Decoder().value(value, 0)


def opaque_names(value: Any) -> list[str]:
    """The globals still opaque anywhere in ``value`` (a :func:`decoded` value), sorted."""
    names: set[str] = set()
    for item in _walk(value):
        if isinstance(item, Opaque) or isinstance(item, type) and issubclass(item, Opaque):
            names.add(item.global_name)
    return sorted(names)


def _walk(value: Any) -> Iterator[Any]:
    """Every object reachable from ``value`` through containers and placeholders, once."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif isinstance(item, Opaque):
            stack.extend([*item.args, *item.kwargs.values(), item.state, *item.items])
        elif isinstance(item, (argparse.Namespace, types.SimpleNamespace)):
            stack.extend(vars(item).values())


class _Decoder:
    """One decoding pass: finished results by id (shared parts stay shared), and the ids of
    the containers being decoded (a reference back to one of them is a cycle)."""

    def __init__(self) -> None:
        self.done: dict[int, Any] = {}
        self.open: dict[int, Any] = {}
        self.keep: list[Any] = []  # ids stay valid while their objects live

    def value(self, obj: Any, depth: int) -> Any:
        key = id(obj)
        if key in self.done:
            return self.done[key]
        if key in self.open:
            return CycleRef(_describe(obj))
        if isinstance(obj, type) and issubclass(obj, Opaque):
            return _BUILTIN_TYPES.get(obj.global_name, obj)
        if not isinstance(obj, dict | list | tuple | set | frozenset | Opaque):
            return obj
        if depth > MAX_DEPTH:
            raise PickleLimitError(f"object nested more than {MAX_DEPTH} deep")
        self.open[key] = obj
        try:
            result = self._container(obj, depth + 1)
        finally:
            del self.open[key]
        self.done[key] = result
        self.keep.append(obj)
        return result

    def _container(self, obj: Any, depth: int) -> Any:
        if isinstance(obj, dict):
            out = obj.copy()  # keeps OrderedDict / defaultdict
            for k, v in obj.items():
                out[k] = self.value(v, depth)
            if isinstance(out, collections.defaultdict):
                out.default_factory = self.value(obj.default_factory, depth)
            return out
        if isinstance(obj, list | tuple):
            items = [self.value(v, depth) for v in obj]
            return items if type(obj) is list else tuple(items)
        if isinstance(obj, set | frozenset):
            return obj  # elements are hashable atoms or placeholders: nothing to decode
        decode = _DECODERS.get(obj.global_name)
        if decode is not None:
            found = decode(obj, lambda v: self.value(v, depth))
            if found is not _UNKNOWN:
                return found
        return self._placeholder(obj, depth)

    def _placeholder(self, obj: Opaque, depth: int) -> Opaque:
        """A copy of the placeholder with its parts decoded."""
        copy = Opaque.__new__(type(obj))
        copy.called, copy.kwargs = obj.called, obj.kwargs
        copy.args = tuple(self.value(v, depth) for v in obj.args)
        copy.state = self.value(obj.state, depth)
        copy.listitems = [self.value(v, depth) for v in obj.listitems]
        copy.dictitems = [(k, self.value(v, depth)) for k, v in obj.dictitems]
        return copy


def _describe(obj: Any) -> str:
    return obj.global_name if isinstance(obj, Opaque) else type(obj).__name__


# --------------------------------------------------------------------------------------------
# Decoders: (placeholder, decode-a-part) → a real value, or _UNKNOWN when the recorded shape is
# not the one the class's own pickling produces (then the placeholder stays).

_UNKNOWN = object()

#: Builtin types a pickle may name as values (``defaultdict(list)``'s factory, OmegaConf's
#: ``object_type``): the types themselves, never called here.
_BUILTIN_TYPES: dict[str, type] = {
    f"builtins.{t.__name__}": t
    for t in (list, dict, set, frozenset, tuple, int, float, complex, str, bytes, bool, object)
}
Decode = Callable[[Any], Any]


def _namespace(factory: Callable[..., Any]) -> Callable[[Opaque, Decode], Any]:
    def build(obj: Opaque, part: Decode) -> Any:
        state = obj.state if obj.state is not None else {}
        if obj.args or obj.items or not isinstance(state, dict):
            return _UNKNOWN
        if not all(isinstance(k, str) for k in state):
            return _UNKNOWN
        made = factory()
        vars(made).update(
            {k: part(v) for k, v in state.items()}
        )  # no setattr: "__class__" is a key
        return made

    return build


def _device(obj: Opaque, part: Decode) -> Any:
    args = obj.args
    if obj.state is not None or obj.items or not args or not isinstance(args[0], str):
        return _UNKNOWN
    if len(args) == 1:
        kind, _, index = args[0].partition(":")
        if not index:
            return Device(kind)
        return Device(kind, int(index)) if index.isdigit() else _UNKNOWN
    if len(args) == 2 and (args[1] is None or type(args[1]) is int):
        return Device(args[0], args[1])
    return _UNKNOWN


def _deque(obj: Opaque, part: Decode) -> Any:
    args = obj.args
    if obj.dictitems or len(args) > 2 or (args and not isinstance(args[0], list | tuple)):
        return _UNKNOWN
    maxlen = args[1] if len(args) == 2 else None
    if maxlen is not None and (type(maxlen) is not int or maxlen < 0):
        return _UNKNOWN
    items = [part(v) for v in (*(args[0] if args else ()), *obj.listitems)]
    return collections.deque(items, maxlen)


def _counter(obj: Opaque, part: Decode) -> Any:
    args = obj.args
    if obj.listitems or len(args) > 1 or (args and not isinstance(args[0], dict)):
        return _UNKNOWN
    out: collections.Counter = collections.Counter()
    for k, v in [*(args[0].items() if args else ()), *obj.dictitems]:
        dict.__setitem__(out, k, part(v))
    return out


def _omegaconf_container(kind: type) -> Callable[[Opaque, Decode], Any]:
    """``DictConfig`` → dict and ``ListConfig`` → list of their nodes' values, interpolations
    (``"${a.b}"``) and ``"???"`` kept as the strings they are (like ``to_container(resolve=False)``)."""

    def build(obj: Opaque, part: Decode) -> Any:
        state = obj.state
        if not isinstance(state, dict) or "_content" not in state:
            return _UNKNOWN
        content = state["_content"]
        if isinstance(content, dict) and kind is dict:
            return {k: _omegaconf_node(v, part) for k, v in content.items()}
        if isinstance(content, list) and kind is list:
            return [_omegaconf_node(v, part) for v in content]
        if content is None or isinstance(content, str):
            return content
        return _UNKNOWN

    return build


def _omegaconf_node(node: Any, part: Decode) -> Any:
    """A value node's ``_val`` (decoded), a nested container decoded as a whole."""
    if (
        isinstance(node, Opaque)
        and node.module == "omegaconf.nodes"
        and isinstance(node.state, dict)
        and "_val" in node.state
    ):
        return part(node.state["_val"])
    return part(node)


_DECODERS: dict[str, Callable[[Opaque, Decode], Any]] = {
    "argparse.Namespace": _namespace(argparse.Namespace),
    "types.SimpleNamespace": _namespace(types.SimpleNamespace),
    "torch.device": _device,
    "collections.deque": _deque,
    "collections.Counter": _counter,
    "omegaconf.dictconfig.DictConfig": _omegaconf_container(dict),
    "omegaconf.listconfig.ListConfig": _omegaconf_container(list),
}
