"""TorchScript archives (``torch.jit.save``): the parameters and buffers of the saved module, keyed
as ``torch.jit.load(f).state_dict()`` names them under the file's group (its stem, as for
torch.save files: ``model.pt`` → ``model.lin.weight``), found without running the archive's code.

A TorchScript archive is a torch.save-like zip: ``data.pkl`` pickles the module object tree
(``__torch__.<class>`` objects whose BUILD state is a dict of attributes, tensors by persistent
id over ``data/<key>`` members), and ``code/__torch__/….py`` holds each class's TorchScript
source, whose ``__parameters__`` / ``__buffers__`` lists say which attributes are parameters and
which are buffers. Those code members are usually DEFLATE-compressed: the ones needed are inflated
(bounded by :func:`ckptkit.records.read_members`) and their class bodies read with :mod:`ast`,
never executed. Tensor constants (``constants.pkl``) and non-tensor attributes are not in
``state_dict()`` and are left out.

Parsing costs up to a kilobyte of memory per syntax token, so code is parsed only within bounds
(:data:`MAX_CODE_BYTES` declared per member, checked before it is read; :data:`MAX_CODE_TOKENS`
per member and :data:`MAX_ARCHIVE_CODE_TOKENS` per archive, counted before it is parsed):
beyond them the archive is refused with a :class:`LimitExceededError` naming the member.
"""

from __future__ import annotations

import ast
import itertools
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..catalog.model import Catalog, CatalogBuilder, Entry
from ..decoding.records import ZipIndex, read_members, read_zip_indexes
from ..decoding.unpickler import OBJECT_GLOBALS, TensorRef, is_opaque, safe_loads
from ..errors import (
    CorruptRecordError,
    FormatError,
    LimitExceededError,
    MissingFileError,
    UnsafePickleError,
)
from ..storage import Store
from .detection import Detection, file_location
from .parts.torch_save_files import directory_files, group_of, probe, tensor_entry

NAME = "torchscript"

#: Module nesting deeper than this is refused (torch's own recursion would fail long before).
MAX_DEPTH = 200
#: At most this many parameters, buffers and module visits in all (a module reached twice, e.g.
#: tied, is walked twice as ``state_dict`` does: this bounds a hostile fan-out of shared modules).
MAX_STEPS = 1 << 22
#: A code member declaring more bytes than this is refused before it is read (TorchScript
#: writes one member per Python module: kilobytes, a few hundred at most).
MAX_CODE_BYTES = 1 << 20
#: Syntax tokens (names, numbers, operators, newlines) a code member may have to be parsed:
#: :mod:`ast` holds up to ~1 KB per token, so about 120 MB at most (real code: ~500 KB of it).
MAX_CODE_TOKENS = 1 << 17
#: Syntax tokens the code members of one archive may have in all (parsing stays within seconds).
MAX_ARCHIVE_CODE_TOKENS = 1 << 20
#: What :func:`code_tokens` counts: a word, any other visible character, a line break (at least
#: one per syntax tree node, so the count bounds what parsing builds).
_TOKEN = re.compile(rb"\w+|[^\w\s]|\n")

__all__ = [
    "NAME",
    "MAX_DEPTH",
    "MAX_STEPS",
    "MAX_CODE_BYTES",
    "MAX_CODE_TOKENS",
    "MAX_ARCHIVE_CODE_TOKENS",
    "ScriptObject",
    "ScriptGlobals",
    "ClassInfo",
    "code_member",
    "code_tokens",
    "class_declarations",
    "detect",
    "describe",
]


# --------------------------------------------------------------------------------------------
# Detection.


def _script_evidence(name: str, index: ZipIndex) -> str | None:
    """Why the zip ``name`` is a TorchScript archive (its ``constants.pkl`` / ``code/`` members
    beside ``data.pkl``), or None when it is a plain torch.save zip."""
    code = [m for m in index.members if m.startswith(f"{index.prefix}code/")]
    constants = f"{index.prefix}constants.pkl" in index.members
    if not code and not constants:
        return None
    found = [f"{index.prefix}data.pkl"]
    if constants:
        found.append(f"{index.prefix}constants.pkl")
    if code:
        found.append(f"{len(code)} {index.prefix}code/ members")
    return f"{name} is a TorchScript archive (torch.jit.save): {', '.join(found)}"


def _script_zips(storage: Store, sizes: Mapping[str, int]) -> dict[str, str] | None:
    """Evidence per file when every zip in ``sizes`` is a TorchScript archive, else None."""
    try:
        indexes = read_zip_indexes(storage, list(sizes), sizes)
    except CorruptRecordError:  # not a torch zip at all: torch_save reports what is wrong
        return None
    evidence = {name: _script_evidence(name, index) for name, index in indexes.items()}
    if not all(evidence.values()):
        return None
    return {name: line for name, line in evidence.items() if line}


def detect(storage: Store) -> Detection | None:
    """TorchScript when the location is a zip holding ``constants.pkl`` or ``code/`` beside
    ``data.pkl``, or a directory whose torch zips (``*.pt``…) all are."""
    located = file_location(storage)
    if located is not None:
        parent, name = located
        size = parent.size(name)
        if probe(parent, {name: size})[name] != "zip":
            return None
        found = _script_zips(parent, {name: size})
        return Detection(NAME, parent, list(found.values()), files=[name]) if found else None
    try:
        files = directory_files(storage)
    except MissingFileError:
        return None
    found = _script_zips(storage, files) if files else None
    if not found:
        return None
    return Detection(NAME, storage, [*list(found.values())[:4], *(["…"] if len(found) > 4 else [])])


# --------------------------------------------------------------------------------------------
# The pickled object tree: ``__torch__.*`` classes become plain records of their state.


class ScriptObject:
    """An object of a TorchScript class (``__torch__.…``) as its pickle describes it: the
    class's qualified name and the BUILD state; nothing of the class is ever run."""

    qualified_name = "?"

    def __new__(cls, *args: Any) -> ScriptObject:
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualified_name}>"


def _typed_list(items: Any) -> list:
    """``torch.jit._pickle.build_intlist`` and its kin: the list itself."""
    if not isinstance(items, list):
        raise UnsafePickleError("torch.jit._pickle.build_*list of something not a list")
    return items


def _restore_type_tag(value: Any, type_str: Any) -> Any:
    """``torch.jit._pickle.restore_type_tag``: the container itself (a static type tag only
    matters to torch's own loader)."""
    if not isinstance(value, list | dict) or not isinstance(type_str, str):
        raise UnsafePickleError("torch.jit._pickle.restore_type_tag with unexpected arguments")
    return value


_JIT_PICKLE = {
    **{
        f"torch.jit._pickle.build_{kind}list": _typed_list
        for kind in ("int", "tensor", "double", "bool")
    },
    "torch.jit._pickle.restore_type_tag": _restore_type_tag,
}


class ScriptGlobals(Mapping[str, Any]):
    """The allowlist of a TorchScript ``data.pkl``: torch's harmless globals, the
    ``torch.jit._pickle`` identity helpers, and any well-formed ``__torch__.`` class name
    (a :class:`ScriptObject` subclass per name, made for this one load)."""

    def __init__(self) -> None:
        self._static: dict[str, Any] = {**OBJECT_GLOBALS, **_JIT_PICKLE}
        self._classes: dict[str, type[ScriptObject]] = {}

    def __getitem__(self, name: str) -> Any:
        found = self._static.get(name)
        if found is not None:
            return found
        if not _is_script_class(name):
            raise KeyError(name)
        cls = self._classes.get(name)
        if cls is None:
            cls = self._classes[name] = type("ScriptObject", (ScriptObject,), {})
            cls.qualified_name = name
        return cls

    def __iter__(self) -> Iterator[str]:
        return iter(self._static)

    def __len__(self) -> int:
        return len(self._static)


def _is_script_class(name: str) -> bool:
    """``__torch__.a.b.Class``: a dotted name under ``__torch__``, as torch qualifies the classes
    it compiled (the name only ever becomes a label and a code member to look up)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[0] == "__torch__" and all(parts)


# --------------------------------------------------------------------------------------------
# What each class's code declares.


@dataclass(frozen=True, slots=True)
class ClassInfo:
    """What a TorchScript class's source declares: whether it is a module, and which of its
    attributes are parameters and buffers."""

    is_module: bool
    parameters: frozenset[str]
    buffers: frozenset[str]


#: TorchScript custom classes (``torch.classes.…``, C++-defined) have no code member and are
#: never modules.
_CUSTOM_CLASSES = "__torch__.torch.classes."
_NOT_A_MODULE = ClassInfo(False, frozenset(), frozenset())


def code_member(qualified_name: str) -> str:
    """The code member (relative to the archive prefix) defining a class:
    ``__torch__.torch.nn.modules.linear.Linear`` → ``code/__torch__/torch/nn/modules/linear.py``."""
    module = qualified_name.rpartition(".")[0]
    return f"code/{module.replace('.', '/')}.py"


def code_tokens(source_code: bytes, limit: int) -> int:
    """The syntax tokens in ``source_code``, counted up to ``limit + 1`` (so the count costs
    no more than the bound allows)."""
    return sum(1 for _ in itertools.islice(_TOKEN.finditer(source_code), limit + 1))


def class_declarations(source_code: bytes, source: str) -> dict[str, ClassInfo]:
    """The classes a code member defines, read from its syntax tree (never executed); code
    past :data:`MAX_CODE_BYTES` or :data:`MAX_CODE_TOKENS` is refused unparsed."""
    if len(source_code) > MAX_CODE_BYTES:
        raise LimitExceededError(
            f"{source}: {len(source_code)} bytes of TorchScript code, more than the "
            f"{MAX_CODE_BYTES} ckptkit parses"
        )
    if code_tokens(source_code, MAX_CODE_TOKENS) > MAX_CODE_TOKENS:
        raise LimitExceededError(
            f"{source}: TorchScript code of more than {MAX_CODE_TOKENS} tokens, more than "
            "ckptkit parses"
        )
    try:
        tree = ast.parse(source_code.decode("utf-8"), mode="exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise FormatError(f"{source}: TorchScript code that ckptkit cannot parse: {exc}") from None
    classes = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            declared = {"__parameters__": frozenset[str](), "__buffers__": frozenset[str]()}
            for statement in node.body:
                name = _declaration(statement)
                if name is not None:
                    declared[name] = _names(statement.value, f"{source} {node.name}.{name}")
            bases = {base.id for base in node.bases if isinstance(base, ast.Name)}
            classes[node.name] = ClassInfo(
                "Module" in bases, declared["__parameters__"], declared["__buffers__"]
            )
    return classes


def _declaration(statement: ast.stmt) -> str | None:
    """``__parameters__`` / ``__buffers__`` when ``statement`` assigns one of them."""
    if (
        isinstance(statement, ast.Assign)
        and len(statement.targets) == 1
        and isinstance(statement.targets[0], ast.Name)
        and statement.targets[0].id in ("__parameters__", "__buffers__")
    ):
        return statement.targets[0].id
    return None


def _names(value: ast.expr, source: str) -> frozenset[str]:
    """The attribute names of a ``["weight", "bias", ]`` list literal."""
    if isinstance(value, ast.List | ast.Tuple) and all(
        isinstance(item, ast.Constant) and isinstance(item.value, str) for item in value.elts
    ):
        return frozenset(item.value for item in value.elts)  # type: ignore[attr-defined]
    raise FormatError(f"{source} is not a list of attribute names")


# --------------------------------------------------------------------------------------------
# Describing.


@dataclass(frozen=True, slots=True)
class _Archive:
    """One TorchScript file: its zip index, decoded module tree and the classes it uses."""

    file: str
    source: str
    index: ZipIndex
    root: ScriptObject
    classes: dict[str, ClassInfo]


def _load_archives(storage: Store, files: list[str]) -> list[_Archive]:
    """Each file's module tree and class declarations: zip directories, then ``data.pkl`` and
    ``byteorder`` (stored members), then the code members of the classes in the tree."""
    indexes = read_zip_indexes(storage, files)
    wanted = []
    for file in files:
        index, source = indexes[file], storage.describe(file)
        data_pkl = index.member("data.pkl", source)
        order = index.members.get(f"{index.prefix}byteorder")
        order = index.member("byteorder", source) if order is not None else data_pkl
        wanted += [
            (file, data_pkl.offset, data_pkl.offset + data_pkl.size),
            (file, order.offset, order.offset + (order.size if order is not data_pkl else 0)),
        ]
    blobs = iter(storage.read_ranges(wanted))
    archives = []
    for file in files:
        index, source = indexes[file], storage.describe(file)
        data, order = next(blobs), next(blobs)
        if order not in (b"", b"little"):
            raise CorruptRecordError(f"{source}: big-endian TorchScript archives are not supported")
        # other globals (a quantized tensor's rebuild, anything hostile) stay placeholders
        root = safe_loads(data, allow=ScriptGlobals(), source=source, unknown="opaque")
        if not isinstance(root, ScriptObject):
            raise FormatError(f"{source}: data.pkl holds {_kind(root)}, not a TorchScript module")
        archives.append(_Archive(file, source, index, root, _classes(storage, index, root)))
    return archives


def _classes(storage: Store, index: ZipIndex, root: ScriptObject) -> dict[str, ClassInfo]:
    """The declarations of every class in ``root``'s tree, from their (inflated) code members."""
    source = storage.describe(index.file)
    names = {obj.qualified_name for obj in _objects(root)}
    declared = {name: _NOT_A_MODULE for name in names if name.startswith(_CUSTOM_CLASSES)}
    names -= set(declared)
    members = sorted({code_member(name) for name in names})
    missing = [m for m in members if index.prefix + m not in index.members]
    if missing:
        raise FormatError(f"{source}: no code member {index.prefix + missing[0]!r}")
    for member in members:
        size = index.any_member(member, source).size
        if size > MAX_CODE_BYTES:
            raise LimitExceededError(
                f"{source}: code member {index.prefix + member!r} declares {size} bytes, "
                f"more than the {MAX_CODE_BYTES} ckptkit parses"
            )
    texts = read_members(storage, index, members)
    # each member's own bound is checked as it is parsed; a count past it is past it already
    tokens = sum(code_tokens(text, MAX_CODE_TOKENS) for text in texts.values())
    if tokens > MAX_ARCHIVE_CODE_TOKENS:
        raise LimitExceededError(
            f"{source}: its code members hold more than {MAX_ARCHIVE_CODE_TOKENS} syntax tokens "
            "in all, more than ckptkit parses"
        )
    parsed = {
        member: class_declarations(text, f"{source} member {index.prefix + member!r}")
        for member, text in texts.items()
    }
    for name in names:
        member = code_member(name)
        info = parsed[member].get(name.rpartition(".")[2])
        if info is None:
            raise FormatError(f"{source}: class {name} is not defined in {index.prefix + member}")
        declared[name] = info
    return declared


def _objects(root: ScriptObject) -> Iterator[ScriptObject]:
    """Each distinct script object reachable from ``root`` through attributes."""
    seen = {id(root)}
    pending = [root]
    while pending:
        obj = pending.pop()
        yield obj
        if isinstance(obj.state, dict):
            for value in obj.state.values():
                if isinstance(value, ScriptObject) and id(value) not in seen:
                    seen.add(id(value))
                    pending.append(value)


def _state_dict(archive: _Archive) -> Iterator[tuple[tuple[str, ...], TensorRef]]:
    """``(path, tensor)`` of every parameter and buffer, in ``state_dict()`` order: a module's
    parameters, then its buffers (attribute order, ``None`` skipped), then its submodules."""
    steps = 0
    active: set[int] = set()

    def step() -> None:
        nonlocal steps
        steps += 1
        if steps > MAX_STEPS:
            raise LimitExceededError(
                f"{archive.source}: more than {MAX_STEPS} modules, parameters and buffers"
            )

    def visit(obj: ScriptObject, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
        step()
        if id(obj) in active or len(path) > MAX_DEPTH:
            raise LimitExceededError(
                f"{archive.source}: module {'.'.join(path)!r} is nested too deep or in itself"
            )
        info = archive.classes[obj.qualified_name]
        state = obj.state
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise FormatError(
                f"{archive.source}: module {'.'.join(path) or '<root>'!r} "
                f"({obj.qualified_name}) restores itself with __setstate__, which is TorchScript "
                "code ckptkit does not run: its parameters cannot be listed"
            )
        active.add(id(obj))
        for kind in (info.parameters, info.buffers):
            for name, value in state.items():
                if name in kind and value is not None:
                    if not isinstance(value, TensorRef):
                        raise FormatError(
                            f"{archive.source}: {'.'.join((*path, name))!r} is "
                            f"{_kind(value)}, not a tensor ckptkit reads"
                        )
                    step()
                    yield (*path, name), value
        for name, value in state.items():
            if isinstance(value, ScriptObject) and archive.classes[value.qualified_name].is_module:
                yield from visit(value, (*path, name))
        active.discard(id(obj))

    yield from visit(archive.root, ())


def _kind(value: Any) -> str:
    """What a decoded value is, for errors: the global an unread placeholder stands for."""
    return value.global_name if is_opaque(value) else type(value).__name__


def _entries(archive: _Archive, group: tuple[str, ...]) -> Iterator[Entry]:
    """The archive's parameters and buffers as tensor entries (RAW records over ``data/``)."""
    for inner, ref in _state_dict(archive):
        path = (*group, *inner)
        yield tensor_entry(".".join(path), path, ref, archive.index, archive.source)


def describe(storage: Store, files: list[str] | None = None) -> Catalog:
    """The catalog of the named TorchScript ``files`` or of a directory of them: each file's
    ``state_dict()`` names under its group, the file's stem (``model.pt``'s ``lin.weight`` is
    ``model.lin.weight``, as for torch.save files). Reads zip directories, ``data.pkl`` and the
    needed code members only."""
    located = file_location(storage) if files is None else None
    if located is not None:  # a file forced with format= that detection did not recognise
        storage, name = located
        files = [name]
    if files is None:
        files = list(directory_files(storage))
        if not files:
            raise FormatError(f"{storage.describe()}: no TorchScript archives (*.pt, *.pth, *.bin)")
    builder = CatalogBuilder(NAME)
    builder.add_files(files)
    for archive in _load_archives(storage, files):
        builder.add_all(_entries(archive, (group_of(archive.file),)), source=archive.source)
    return builder.build()
