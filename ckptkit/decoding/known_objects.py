"""Common, benign classes decoded from their :class:`~ckptkit.unpickler.Opaque` placeholders.

The unpickler keeps every class outside its allowlist as a placeholder recording what the
pickle did (so a writer can replay it losslessly). For reading, :func:`decoded` turns the
placeholders of well-known harmless classes into real values built from their recorded
arguments and state, never by calling anything the pickle names: ``argparse.Namespace``,
``types.SimpleNamespace``, ``torch.device`` (as :class:`Device`), ``collections`` types and
OmegaConf ``DictConfig`` / ``ListConfig`` (their contents, as dicts and lists). Everything else
stays a placeholder. Reference cycles (OmegaConf nodes point back to their parents) become
:class:`CycleRef` markers, so the decoded value is a tree that any code may walk.

A decoder drops what it does not show (a ``Counter``'s BUILD state, a ``DictConfig``'s
``_metadata``); it decodes only when what it drops names nothing harmful, so the decoded view
never hides a global that loading the pickle would run. :data:`BENIGN_GLOBALS` is that
judgement: the explicit set of globals whose pickled form is harmless when all of its parts
are (:func:`benign_placeholder`, :func:`harmful_globals`). Writing a value back judges the
globals its pickle names with the same set (``ops.writers.torch_save.pickled_globals``).
"""

from __future__ import annotations

import argparse
import collections
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import PickleLimitError
from .pickle_limits import OBJECT_LIMITS
from .unpickler import Opaque

__all__ = [
    "BENIGN_GLOBALS",
    "MAX_DEPTH",
    "Benign",
    "CycleRef",
    "Decode",
    "Device",
    "benign_placeholder",
    "decoded",
    "harmful_globals",
    "opaque_names",
]

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


def harmful_globals(value: Any, *, budget: int = OBJECT_LIMITS.max_items) -> list[str]:
    """The globals named anywhere in ``value`` (as the unpickler returned it: placeholders, not
    decoded) that are not known to be harmless, sorted: placeholders :func:`benign_placeholder`
    does not accept, and classes named as values outside :data:`BENIGN_GLOBALS`. Walks every part
    a pickle of ``value`` holds (arguments, BUILD state, items, attributes of dicts, default
    factories), each object once; more than ``budget`` objects raise :class:`PickleLimitError`."""
    names: set[str] = set()
    for item in _walk(value, budget=budget):
        if isinstance(item, Opaque):
            benign = benign_placeholder(item)
        elif isinstance(item, type) and issubclass(item, Opaque):
            benign = item.global_name in BENIGN_GLOBALS
        else:
            continue
        if not benign:
            names.add(item.global_name)
    return sorted(names)


def _walk(value: Any, budget: int | None = None) -> Iterator[Any]:
    """Every object reachable from ``value`` through containers and placeholders, once (a
    reference back is not followed again: cycles end); more than ``budget`` objects raise."""
    seen: set[int] = set()
    keep: list[Any] = []  # ids stay valid while their objects live
    stack = [value]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        keep.append(item)
        if budget is not None and len(seen) > budget:
            raise PickleLimitError(f"object of more than {budget} parts")
        yield item
        stack.extend(_parts(item))


def _parts(item: Any) -> list[Any]:
    """What a pickle of ``item`` holds besides ``item`` itself: a dict's keys, values, default
    factory and attributes, a sequence's items, a placeholder's arguments, state and items."""
    if isinstance(item, dict):
        parts = [*item.keys(), *item.values()]
        if isinstance(item, collections.defaultdict):
            parts.append(item.default_factory)
        if hasattr(item, "__dict__"):  # an OrderedDict's attributes (torch's ``_metadata``)
            parts.extend(vars(item).values())
        return parts
    if isinstance(item, (list, tuple, set, frozenset)):
        return list(item)
    if isinstance(item, Opaque):
        return [*item.args, *item.kwargs.values(), item.state, *item.listitems, *item.dictitems]
    if isinstance(item, (argparse.Namespace, types.SimpleNamespace)):
        return list(vars(item).values())
    return []


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
        if obj.args or obj.kwargs or obj.items or not isinstance(state, dict):
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
    if obj.state is not None or obj.kwargs or obj.items or not args or not isinstance(args[0], str):
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
    if obj.state is not None or obj.kwargs:  # a deque shows neither: it stays a placeholder
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
    if obj.state is not None or obj.kwargs:  # a Counter shows neither: it stays a placeholder
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
        if not benign_placeholder(obj) or not _drops_nothing_harmful(state, "_content"):
            return _UNKNOWN  # what the decoded value leaves out must name nothing harmful
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
    """A value node's ``_val`` (decoded), a nested container decoded as a whole; a node whose
    other parts name anything harmful stays a placeholder."""
    if (
        isinstance(node, Opaque)
        and node.module == "omegaconf.nodes"
        and isinstance(node.state, dict)
        and "_val" in node.state
        and benign_placeholder(node)
        and _drops_nothing_harmful(node.state, "_val")
    ):
        return part(node.state["_val"])
    return part(node)


#: Objects the parts an OmegaConf decoder leaves out may hold (its metadata: a dozen); more,
#: and the object stays a placeholder (each check stays small, however many nodes there are).
_DROPPED_BUDGET = 256


def _drops_nothing_harmful(state: dict, shown: str) -> bool:
    """Whether the parts of an OmegaConf object's state its decoded value leaves out (all but
    ``shown``, and a ``_parent`` that is an OmegaConf container, decoded in its own right) name
    only benign globals, within :data:`_DROPPED_BUDGET` objects."""
    parent = state.get("_parent")
    container = isinstance(parent, Opaque) and parent.global_name in _OMEGACONF_CONTAINERS
    dropped = [
        (key, value)
        for key, value in state.items()
        if key != shown and not (key == "_parent" and (parent is None or container))
    ]
    try:
        return not harmful_globals(dropped, budget=_DROPPED_BUDGET)
    except PickleLimitError:
        return False


_DECODERS: dict[str, Callable[[Opaque, Decode], Any]] = {
    "argparse.Namespace": _namespace(argparse.Namespace),
    "types.SimpleNamespace": _namespace(types.SimpleNamespace),
    "torch.device": _device,
    "collections.deque": _deque,
    "collections.Counter": _counter,
    "omegaconf.dictconfig.DictConfig": _omegaconf_container(dict),
    "omegaconf.listconfig.ListConfig": _omegaconf_container(list),
}


# --------------------------------------------------------------------------------------------
# Benign globals: a pickle naming only these, built the way the classes' own pickling builds
# them, runs nothing of its author's choosing when loaded (with ``weights_only=False``).


def _no_parts(obj: Opaque) -> bool:
    return False


def _attributes(obj: Opaque) -> bool:
    """Built bare, then given attributes: no arguments or items, a dict state (or none)."""
    state = obj.state
    if obj.args or obj.items:
        return False
    return state is None or isinstance(state, dict) and all(isinstance(k, str) for k in state)


def _counter_shape(obj: Opaque) -> bool:
    """``Counter(mapping)`` then items: counting a mapping iterates nothing a pickle sized."""
    args = obj.args
    if obj.listitems or len(args) > 1 or (args and type(args[0]) is not dict):
        return False
    return obj.state is None or isinstance(obj.state, dict)


def _deque_shape(obj: Opaque) -> bool:
    """``deque(list, maxlen)`` then items."""
    args = obj.args
    if obj.dictitems or len(args) > 2 or (args and type(args[0]) not in (list, tuple)):
        return False
    if len(args) == 2 and not (args[1] is None or type(args[1]) is int and args[1] >= 0):
        return False
    return obj.state is None or isinstance(obj.state, dict)


def _device_shape(obj: Opaque) -> bool:
    """``torch.device("cuda", 1)`` / ``torch.device("cuda:1")``, as torch pickles one."""
    args = obj.args
    if obj.state is not None or obj.items or not 1 <= len(args) <= 2 or type(args[0]) is not str:
        return False
    return len(args) == 1 or args[1] is None or type(args[1]) is int


@dataclass(frozen=True)
class Benign:
    """How a pickle may build a benign global harmlessly: called (REDUCE ``cls(*args)``),
    created bare (NEWOBJ ``cls.__new__(cls, *args)``), and with parts of the shape ``shape``
    accepts (the shape the class's own pickling gives). Neither: only named, as a value."""

    call: bool = False
    new: bool = False
    shape: Callable[[Opaque], bool] = _no_parts


_NAMED = Benign()
_OMEGACONF_CONTAINERS = ("omegaconf.dictconfig.DictConfig", "omegaconf.listconfig.ListConfig")
_OMEGACONF_NODES = (
    "AnyNode",
    "BooleanNode",
    "BytesNode",
    "EnumNode",
    "FloatNode",
    "IntegerNode",
    "InterpolationResultNode",
    "PathNode",
    "StringNode",
)

#: Globals whose pickled form is harmless when every part of it is: importing them imports
#: only the standard library, torch or OmegaConf, and building them as :class:`Benign` says
#: runs none of the pickle's code (``__setstate__`` of OmegaConf sets attributes). Everything
#: else a pickle names is harmful until shown otherwise: ``objects=`` acts on it.
BENIGN_GLOBALS: dict[str, Benign] = {
    **{
        f"builtins.{t.__name__}": _NAMED
        for t in (list, dict, set, frozenset, tuple, int, float, complex, str, bytes, bool, object)
    },
    **{f"typing.{name}": _NAMED for name in ("Any", "Dict", "List", "Tuple")},
    "argparse.Namespace": Benign(call=True, new=True, shape=_attributes),
    "types.SimpleNamespace": Benign(call=True, new=True, shape=_attributes),
    "collections.Counter": Benign(call=True, shape=_counter_shape),
    "collections.deque": Benign(call=True, shape=_deque_shape),
    "torch.device": Benign(call=True, shape=_device_shape),
    **{name: Benign(new=True, shape=_attributes) for name in _OMEGACONF_CONTAINERS},
    "omegaconf.base.Metadata": Benign(new=True, shape=_attributes),
    "omegaconf.base.ContainerMetadata": Benign(new=True, shape=_attributes),
    **{f"omegaconf.nodes.{n}": Benign(new=True, shape=_attributes) for n in _OMEGACONF_NODES},
}


def benign_placeholder(obj: Opaque) -> bool:
    """Whether the placeholder ``obj`` is built harmlessly: its global is benign and built the
    way :data:`BENIGN_GLOBALS` allows (its parts are judged on their own)."""
    spec = BENIGN_GLOBALS.get(obj.global_name)
    if spec is None or obj.kwargs or not (spec.call if obj.called else spec.new):
        return False
    return spec.shape(obj)
