"""The one safe unpickler: every pickle ckptkit reads goes through :func:`safe_loads`.

Each global a pickle names is looked up in an allowlist that maps it to a harmless stand-in
(a plain class, ``tuple``, a validating function); nothing is ever imported from the name.
Outside the allowlist a global either raises :class:`UnsafePickleError` (metadata: strict) or
becomes a visible :class:`Opaque` placeholder (user objects; see
:mod:`~ckptkit.decoding.placeholders`), never called. Stand-ins never allocate or iterate what a
pickle merely announces (``bytearray(10**12)``, ``set(range(…))``, ``numpy.ndarray(shape)``),
nor format one into an error but through
:func:`~ckptkit.decoding.bounded_repr.bounded_repr`; :mod:`~ckptkit.decoding.pickle_limits`
bounds the input before the C unpickler runs it and the value after, and
:mod:`~ckptkit.decoding.pickle_stream` feeds a large one to it in pieces. The one way around
all this is ``Checkpoint.read_object(key, trust=True)``, for objects only, never metadata.
"""

from __future__ import annotations

import _compat_pickle
import collections
import contextlib
import gc
import io
import pathlib
import pickle
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal

import numpy as np

from .. import dtypes
from ..dtypes import DType
from ..errors import CheckpointError, CorruptRecordError, UnsafePickleError
from .bounded_repr import bounded_repr
from .pickle_limits import (
    ATOM,
    OBJECT_LIMITS,
    PASS,
    TUPLE,
    UNKNOWN,
    Limits,
    check_value,
    limit_error,
    nesting_bound,
    run_with_stack,
    scan_pieces,
    simulate,
)
from .pickle_stream import read_pieces, stream_over
from .placeholders import Opaque, is_opaque, opaque_class

__all__ = [
    "COMMON_GLOBALS",
    "OBJECT_GLOBALS",
    "TENSOR_GLOBALS",
    "Opaque",
    "StorageRef",
    "TensorRef",
    "is_opaque",
    "paused_gc",
    "python3_name",
    "safe_loads",
    "unsealed",
]

# --------------------------------------------------------------------------------------------
# Stand-ins for torch.save's tensor encoding (persistent ids + _rebuild_tensor_v2).


@dataclass(frozen=True, slots=True)
class StorageRef:
    """A storage a pickle points to by persistent id; its bytes live in a separate zip member."""

    key: str
    dtype: DType
    numel: int
    location: str


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor as a pickle describes it: a strided view (in elements of ``dtype``) of a storage."""

    storage: StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: DType
    requires_grad: bool = False

    def __repr__(self) -> str:
        return f"Tensor({self.dtype.name}, {list(self.shape)})"

    def __bounded_repr__(self, render: Callable[[Any], str]) -> str:
        return f"Tensor({self.dtype.name}, {render(list(self.shape))})"


class _StorageType:
    """Stand-in for a ``torch.FloatStorage``-like class named in a persistent id."""

    __slots__ = ("dtype",)

    def __init__(self, dt: DType) -> None:
        self.dtype = dt

    def __setstate__(self, state: Any) -> None:
        raise _refuse_build(f"torch storage class {self.dtype.storage}")


class _SealedFunction:
    """An allowlisted function as pickles see it: callable, but BUILD cannot rewrite it (a
    function's ``__defaults__`` are otherwise settable by a pickle, for every later load)."""

    __slots__ = ("function",)

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __call__(self, *args: Any) -> Any:
        return self.function(*args)

    def __bounded_repr__(self, render: Callable[[Any], str]) -> str:
        return f"<function {self.function.__qualname__}>"

    def __setstate__(self, state: Any) -> None:
        raise _refuse_build(self.function.__qualname__)


def _refuse_build(what: str) -> UnsafePickleError:
    return UnsafePickleError(f"the pickle tries to change {what} (BUILD on an allowlisted global)")


_SEALED: dict[Callable[..., Any], _SealedFunction] = {}


def unsealed(value: Any) -> Any:
    """The allowlisted function behind a value the unpickler handed out (for identity checks
    in stand-ins: ``unsealed(func) is _rebuild_wrapper_subclass``)."""
    return value.function if isinstance(value, _SealedFunction) else value


def _sealed(value: Any) -> Any:
    """``value`` safe to hand to the unpickler: plain functions wrapped, everything else as is
    (types and stand-in instances refuse BUILD themselves)."""
    if type(value) is not types.FunctionType:
        return value
    sealed = _SEALED.get(value)
    if sealed is None:
        sealed = _SEALED[value] = _SealedFunction(value)
    return sealed


def _ints(values: Any, what: str) -> tuple[int, ...]:
    """``values`` as a tuple of non-negative ints (a shape or strides), else a clear error."""
    if not isinstance(values, tuple | list) or not all(
        type(v) is int and 0 <= v < 1 << 62 for v in values
    ):
        raise CorruptRecordError(f"tensor {what} is not a list of non-negative ints")
    return tuple(values)


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, *_ignored):
    if not isinstance(storage, StorageRef):
        raise CorruptRecordError(f"tensor rebuilt from {type(storage).__name__}, not a storage")
    shape, strides = _ints(size, "shape"), _ints(stride, "strides")
    if len(shape) != len(strides) or type(storage_offset) is not int or storage_offset < 0:
        raise CorruptRecordError(
            f"tensor shape {bounded_repr(shape)} does not match strides {bounded_repr(strides)}"
        )
    return TensorRef(storage, storage_offset, shape, strides, storage.dtype, bool(requires_grad))


def _rebuild_tensor_v3(
    storage, storage_offset, size, stride, requires_grad, hooks, dtype, *_ignored
):
    """torch's form for dtypes without a typed storage (fp8, uint16…): untyped bytes + dtype."""
    if not isinstance(dtype, DType):
        raise CorruptRecordError(f"tensor rebuilt with dtype {bounded_repr(dtype)}")
    ref = _rebuild_tensor(storage, storage_offset, size, stride, requires_grad)
    return TensorRef(
        ref.storage, ref.storage_offset, ref.shape, ref.stride, dtype, ref.requires_grad
    )


def _rebuild_tensor_v1(storage, storage_offset, size, stride):
    return _rebuild_tensor(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, *_ignored):
    return data


def _torch_layout(name: str) -> str:
    if not isinstance(name, str):
        raise CorruptRecordError(f"layout name must be a string, got {type(name).__name__}")
    return name


# --------------------------------------------------------------------------------------------
# Stand-ins for harmless python / numpy globals.


def _codecs_encode(text, encoding="utf-8", errors="strict"):
    """``_codecs.encode`` as protocol-2 pickles of bytes use it: only str → latin-1 bytes."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1") or errors != "strict":
        raise UnsafePickleError(
            "_codecs.encode called with unexpected arguments", global_name="_codecs.encode"
        )
    return text.encode("latin-1")


def _numpy_dtype(spec, align=False, copy=False):
    if not isinstance(spec, str | bytes):
        raise UnsafePickleError("numpy dtypes are named by a string", global_name="numpy.dtype")
    dt = np.dtype(spec, align=bool(align))
    if dt.hasobject:
        raise UnsafePickleError("numpy object arrays are not allowed", global_name="numpy.dtype")
    return dt


class _NdarrayMarker:
    """``numpy.ndarray`` as a pickle names it (an argument of ``_reconstruct``), never called:
    ``ndarray(shape)`` would allocate whatever size the pickle asks for."""

    __slots__ = ()


_NDARRAY = _NdarrayMarker()


def _numpy_reconstruct(subtype, shape, dtype):
    # numpy pickles an empty array here and fills it in BUILD, whose data must match its shape
    if subtype is not _NDARRAY:
        raise UnsafePickleError("only plain numpy arrays are allowed", global_name="numpy.ndarray")
    if shape not in ((0,), [0]):
        raise CorruptRecordError(
            f"numpy array reconstructed with shape {bounded_repr(shape)}, not (0,)"
        )
    return np.ndarray.__new__(np.ndarray, (0,), _numpy_dtype(dtype))


def _numpy_scalar(dt, data=None):
    if not isinstance(dt, np.dtype) or dt.hasobject or not isinstance(data, bytes):
        raise UnsafePickleError(
            "unexpected numpy scalar", global_name="numpy.core.multiarray.scalar"
        )
    return np.frombuffer(data, dtype=dt, count=1)[0]


def _path(flavour: type[pathlib.PurePath]) -> Callable[..., str]:
    """Paths come back as strings: a WindowsPath cannot be built on Linux, nor 3.13 classes on 3.11."""

    def build(*parts):
        if not all(isinstance(part, str) for part in parts):
            raise CorruptRecordError("path parts must be strings")
        return str(flavour(*parts))

    return build


_posix_path = _path(pathlib.PurePosixPath)
_windows_path = _path(pathlib.PureWindowsPath)
_PATH_GLOBALS = {
    f"{module}.{name}": _windows_path if "Windows" in name else _posix_path
    for module in ("pathlib", "pathlib._local")
    for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
}

_NUMPY_GLOBALS = {
    f"{prefix}.{name}": fn
    for prefix in ("numpy.core.multiarray", "numpy._core.multiarray")
    for name, fn in (("_reconstruct", _numpy_reconstruct), ("scalar", _numpy_scalar))
}
_NUMPY_GLOBALS.update({"numpy.ndarray": _NDARRAY, "numpy.dtype": _numpy_dtype})


# Stand-ins for builtins that would otherwise consume a lazy ``range`` of any length
# (``set(range(10**10))``) or allocate what they are told (``bytearray(10**12)``).


def _sequence(items: Any, what: str) -> Any:
    if not isinstance(items, list | tuple | set | frozenset | dict | str | bytes):
        raise UnsafePickleError(
            f"{what}() of {type(items).__name__} is not allowed", global_name=f"builtins.{what}"
        )
    return items


def _set(items=()):
    return set(_sequence(items, "set"))


def _frozenset(items=()):
    return frozenset(_sequence(items, "frozenset"))


def _size(items=()):
    """``torch.Size``: a tuple of ints."""
    return _ints(_sequence(items, "tuple"), "size")


def _bytearray(source=b"", encoding=None, errors=None):
    if isinstance(source, bytes) and encoding is None:
        return bytearray(source)
    if isinstance(source, str) and encoding in ("latin1", "latin-1", "utf-8", "utf8"):
        return bytearray(source, encoding, errors or "strict")
    raise UnsafePickleError(
        "bytearray() from unexpected arguments", global_name="builtins.bytearray"
    )


def _slice(*args):
    if len(args) > 3 or not all(a is None or type(a) is int for a in args):
        raise UnsafePickleError("slice() of non-ints", global_name="builtins.slice")
    return slice(*args)


# --------------------------------------------------------------------------------------------
# Allowlists. Keys are "module.qualname" as the pickle spells them; values are the stand-ins.

#: What any torch-written pickle may name: dtypes, torch.Size, layouts, paths.
COMMON_GLOBALS: dict[str, Any] = {
    "torch.Size": tuple,
    "torch.serialization._get_layout": _torch_layout,
    **{f"torch.{name}": dt for name, dt in dtypes.BY_NAME.items()},
    **_PATH_GLOBALS,
}

#: A tensor record's ``data.pkl``: one tensor rebuilt from one storage.
TENSOR_GLOBALS: dict[str, Any] = {
    **COMMON_GLOBALS,
    "torch.Size": _size,
    "collections.OrderedDict": collections.OrderedDict,
    "torch._utils._rebuild_tensor": _rebuild_tensor_v1,
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor,
    "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
    **{f"torch.{name}": _StorageType(dt) for name, dt in dtypes.BY_STORAGE.items()},
    "torch.storage.UntypedStorage": _StorageType(dtypes.BY_NAME["uint8"]),
}

#: Non-tensor objects users saved: primitives, containers, numpy values, tensors inside them.
OBJECT_GLOBALS: dict[str, Any] = {
    **TENSOR_GLOBALS,
    "builtins.set": _set,
    "builtins.frozenset": _frozenset,
    "builtins.complex": complex,
    "builtins.slice": _slice,
    "builtins.range": range,
    "builtins.bytearray": _bytearray,
    "collections.defaultdict": collections.defaultdict,
    "_codecs.encode": _codecs_encode,
    **_NUMPY_GLOBALS,
}


def python3_name(module: str, name: str) -> tuple[str, str]:
    """``(module, name)`` as Python 3 spells a global a protocol-2 pickle may give in Python 2
    terms (``__builtin__.long`` → ``builtins.int``), as ``pickle``'s ``fix_imports`` does."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


class _Unpickler(pickle.Unpickler):
    def __init__(self, data, allow, unknown, source, limits):
        super().__init__(data if hasattr(data, "read") else io.BytesIO(data))
        self._allow, self._unknown, self._source = allow, unknown, source
        self._limits = limits
        # the globals this pickle named so far (counted against the limit), with the
        # placeholder class of each one outside the allowlist (None for the others)
        self._named: dict[tuple[str, str], type[Opaque] | None] = {}

    def find_class(self, module: str, name: str) -> Any:
        module, name = python3_name(module, name)
        self._count(module, name)
        full = f"{module}.{name}"
        try:
            return _sealed(self._allow[full])
        except KeyError:
            pass
        if self._unknown == "opaque":
            cls = self._named.get((module, name))
            if cls is None:
                cls = self._named[(module, name)] = opaque_class(module, name)
            return cls
        raise UnsafePickleError(
            f"{self._source}: pickle references {full}, which is not on the allowlist; "
            "nothing was imported or run",
            global_name=full,
        )

    def persistent_load(self, pid: Any) -> Any:
        """Storages by persistent id: ``('storage', type, key, location, numel)`` in zip files;
        pre-1.6 files add a view ``(view_key, offset, numel)`` or None, and a view's key
        becomes ``"<key>@<byte offset>"``. Pre-1.6 ``('module', class, file, source)`` gives
        the class (an :class:`Opaque` placeholder: never imported, never checked)."""
        if (
            isinstance(pid, tuple)
            and len(pid) in (5, 6)
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
            and "torch._utils._rebuild_tensor_v2" in self._allow
        ):
            _, storage_type, key, location, numel, *view = pid
            view = view[0] if view else None
            if isinstance(key, str | int) and type(numel) is int and isinstance(location, str):
                if view is None:
                    return StorageRef(str(key), storage_type.dtype, numel, location)
                if isinstance(view, tuple) and len(view) == 3 and _ints(view[1:], "view"):
                    start = view[1] * storage_type.dtype.itemsize
                    return StorageRef(f"{key}@{start}", storage_type.dtype, view[2], location)
        if (
            isinstance(pid, tuple)
            and len(pid) == 4
            and pid[0] == "module"
            and isinstance(pid[1], type)
            and issubclass(pid[1], Opaque)
        ):
            return pid[1]
        raise UnsafePickleError(f"{self._source}: unexpected persistent id {bounded_repr(pid)}")

    def _count(self, module: str, name: str) -> None:
        """Refuse a global named in more than ``limits.max_global_name`` characters (checked
        before they are joined) or past ``limits.max_globals`` distinct ones: each may become a
        class (a placeholder, a TorchScript class) that costs ~3 KB for 10 bytes of pickle."""
        limits, named = self._limits, self._named
        if len(module) + len(name) > limits.max_global_name:
            raise limit_error(
                self._source,
                f"a global named in {len(module) + len(name)} characters "
                f"(limit {limits.max_global_name})",
            )
        if (module, name) not in named:
            if len(named) >= limits.max_globals:
                raise limit_error(self._source, f"more than {limits.max_globals} distinct globals")
            named[(module, name)] = None


@contextlib.contextmanager
def paused_gc(*, promote: bool = False) -> Iterator[None]:
    """Pause the cyclic GC while building many objects that form no cycles (3x faster).

    With ``promote`` the outermost pause ends by moving every live object to the oldest
    generation unscanned (``gc.freeze()`` then ``gc.unfreeze()``): the ~1M objects of a large
    catalog then skip the young collections, whose first pass over them cost more than a
    second, and are looked at only by Python's rare full collections, like any long-lived
    data. Nothing is left frozen; skipped when the process has frozen objects of its own.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if promote and gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def safe_loads(
    data: bytes | memoryview | BinaryIO,
    *,
    allow: Mapping[str, Any],
    source: str,
    unknown: Literal["raise", "opaque"] = "raise",
    limits: Limits = OBJECT_LIMITS,
) -> Any:
    """Unpickle ``data`` (bytes or a binary file) resolving globals only through ``allow``.

    ``source`` names the input (the file, and the key when known) in every error raised
    while loading, a stand-in's too; ``unknown="opaque"`` keeps refused globals as
    :class:`Opaque` placeholders instead of raising :class:`UnsafePickleError`. ``limits``
    (:data:`~ckptkit.decoding.pickle_limits.METADATA_LIMITS`, ``RECORD_LIMITS``, ``OBJECT_LIMITS``)
    caps input size, memo, container sizes, nesting and the globals named (how many, how
    long); a pickle beyond them raises
    :class:`~ckptkit.errors.LimitExceededError` before it allocates or recurses (see
    :mod:`ckptkit.decoding.pickle_limits`).
    """
    # a stream is read in pieces that are scanned, then fed to the unpickler and dropped one
    # by one as it consumes them: the pickle is never held whole next to what it builds
    pieces = read_pieces(data, limits.max_bytes + 1) if hasattr(data, "read") else [bytes(data)]
    try:
        with paused_gc():
            levels = sum(map(nesting_bound, pieces))
            size = sum(map(len, pieces))
            if levels > 20 and (size <= limits.simulate_bytes or levels <= 4096):
                pieces = [b"".join(pieces)]
                simulate(pieces[0], limits, source, _classifier(allow))
                levels = limits.max_tuple_depth  # the simulation bounded it exactly
            else:  # at most 2**20 steps to hash any tuple; larger inputs get a big stack
                scan_pieces(pieces, limits, source)
            stream = stream_over(pieces)
            del pieces  # the stream holds the only references now
            unpickler = _Unpickler(stream, allow, unknown, source, limits)
            value = run_with_stack(levels, unpickler.load)
            if limits.check_value:
                check_value(value, limits, source)
            return value
    except CheckpointError as exc:  # stand-ins refuse without knowing the source: name it
        _name_source(exc, source)
        raise
    except Exception as exc:  # malformed input raises all sorts of things
        raise CorruptRecordError(
            f"{source}: cannot unpickle: {type(exc).__name__}: {_exception_text(exc)}"
        ) from exc


def _name_source(exc: CheckpointError, source: str) -> None:
    """Put ``source`` (the file, and the key when the caller knows it) at the head of ``exc``'s
    message, unless the message names it already; in place, so its class, cause and attributes
    (``global_name``) stay as the stand-in raised them."""
    text = str(exc)
    if source not in text:
        exc.args = (f"{source}: {text}",)


def _exception_text(exc: Exception) -> str:
    """``str(exc)`` shortened, for an error naming what went wrong; an exception holding a decoded
    value (``KeyError(key)``) shows it through :func:`bounded_repr`, since its ``str`` would
    print the value whole."""
    if all(isinstance(arg, str | bytes | int | float | None) for arg in exc.args):
        return bounded_repr(str(exc))
    return bounded_repr(exc.args, chars=60)


_ATOM_RESULTS = {
    _rebuild_tensor,
    _rebuild_tensor_v1,
    _rebuild_tensor_v3,
    _torch_layout,
    _codecs_encode,
    _numpy_dtype,
    _numpy_reconstruct,
    _numpy_scalar,
    _posix_path,
    _windows_path,
    _set,
    _frozenset,
    _bytearray,
    _slice,
}


def _classifier(allow: Mapping[str, Any]):
    """How each allowed global behaves when a pickle calls it, for :func:`simulate`."""

    def classify(module: str, name: str) -> str:
        value = allow.get(".".join(python3_name(module, name)))
        if value is None:  # refused, or an Opaque placeholder: never a tuple
            return ATOM
        if isinstance(value, type):
            return TUPLE if issubclass(value, tuple) else ATOM
        if value is _size:
            return TUPLE
        if value is _rebuild_parameter:
            return PASS
        try:
            return ATOM if value in _ATOM_RESULTS else UNKNOWN
        except TypeError:  # unhashable stand-in
            return UNKNOWN

    return classify
