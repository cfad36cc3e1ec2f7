"""The one safe unpickler: every pickle ckptkit reads goes through :func:`safe_loads`.

Each global a pickle names is looked up in an allowlist that maps it to a harmless stand-in
(a plain class, ``tuple``, a validating function); nothing is ever imported from the name.
Outside the allowlist a global either raises :class:`UnsafePickleError` (metadata: strict) or
becomes a visible :class:`Opaque` placeholder (user objects), never called.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import io
import pathlib
import pickle
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal

import numpy as np

from . import dtypes
from .dtypes import DType
from .errors import CheckpointError, CorruptRecordError, UnsafePickleError

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


class _StorageType:
    """Stand-in for a ``torch.FloatStorage``-like class named in a persistent id."""

    __slots__ = ("dtype",)

    def __init__(self, dt: DType) -> None:
        self.dtype = dt


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, *_ignored):
    if not isinstance(storage, StorageRef):
        raise CorruptRecordError(f"tensor rebuilt from {type(storage).__name__}, not a storage")
    return TensorRef(
        storage, int(storage_offset), tuple(size), tuple(stride), storage.dtype, bool(requires_grad)
    )


def _rebuild_tensor_v3(
    storage, storage_offset, size, stride, requires_grad, hooks, dtype, *_ignored
):
    """torch's form for dtypes without a typed storage (fp8, uint16…): untyped bytes + dtype."""
    if not isinstance(dtype, DType):
        raise CorruptRecordError(f"tensor rebuilt with dtype {dtype!r}")
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
    dt = np.dtype(spec, align=bool(align))
    if dt.hasobject:
        raise UnsafePickleError("numpy object arrays are not allowed", global_name="numpy.dtype")
    return dt


def _numpy_reconstruct(subtype, shape, dtype):
    if subtype is not np.ndarray:
        raise UnsafePickleError("only plain numpy arrays are allowed", global_name="numpy.ndarray")
    return np.ndarray.__new__(np.ndarray, shape, _numpy_dtype(dtype))


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
_NUMPY_GLOBALS.update({"numpy.ndarray": np.ndarray, "numpy.dtype": _numpy_dtype})

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
    "builtins.set": set,
    "builtins.frozenset": frozenset,
    "builtins.complex": complex,
    "builtins.slice": slice,
    "builtins.range": range,
    "builtins.bytearray": bytearray,
    "collections.defaultdict": collections.defaultdict,
    "_codecs.encode": _codecs_encode,
    **_NUMPY_GLOBALS,
}

_PY2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg"}


class Opaque:
    """A value whose class the allowlist does not know: kept by name and arguments, never run."""

    global_name = "?"

    def __new__(cls, *args):  # NEWOBJ and REDUCE both land here
        obj = object.__new__(cls)
        obj.args, obj.state, obj.items = args, None, []
        return obj

    def __init__(self, *args) -> None:
        pass

    def __setstate__(self, state) -> None:
        self.state = state

    def append(self, item) -> None:
        self.items.append(item)

    def extend(self, items) -> None:
        self.items.extend(items)

    def __setitem__(self, key, value) -> None:
        self.items.append((key, value))

    def __repr__(self) -> str:
        return f"<{self.global_name}{self.args!r}>" if self.args else f"<{self.global_name}>"


_OPAQUE_CLASSES: dict[str, type[Opaque]] = {}


def _opaque_class(name: str) -> type[Opaque]:
    cls = _OPAQUE_CLASSES.get(name)
    if cls is None:
        cls = _OPAQUE_CLASSES[name] = type("Opaque", (Opaque,), {"global_name": name})
    return cls


def is_opaque(value: Any) -> bool:
    """True for placeholders of globals the allowlist refused (see :class:`Opaque`)."""
    return isinstance(value, Opaque)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data, allow, unknown, source):
        super().__init__(data if hasattr(data, "read") else io.BytesIO(data))
        self._allow, self._unknown, self._source = allow, unknown, source

    def find_class(self, module: str, name: str) -> Any:
        full = f"{_PY2_MODULES.get(module, module)}.{name}"
        try:
            return self._allow[full]
        except KeyError:
            pass
        if self._unknown == "opaque":
            return _opaque_class(full)
        raise UnsafePickleError(
            f"{self._source}: pickle references {full}, which is not on the allowlist; "
            "nothing was imported or run",
            global_name=full,
        )

    def persistent_load(self, pid: Any) -> Any:
        if (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
            and "torch._utils._rebuild_tensor_v2" in self._allow
        ):
            _, storage_type, key, location, numel = pid
            return StorageRef(str(key), storage_type.dtype, int(numel), str(location))
        raise UnsafePickleError(f"{self._source}: unexpected persistent id {pid!r}")


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic GC while building many objects that form no cycles (3x faster)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def safe_loads(
    data: bytes | BinaryIO,
    *,
    allow: Mapping[str, Any],
    source: str,
    unknown: Literal["raise", "opaque"] = "raise",
) -> Any:
    """Unpickle ``data`` (bytes or a binary file) resolving globals only through ``allow``.

    ``source`` names the input in errors; ``unknown="opaque"`` keeps refused globals as
    :class:`Opaque` placeholders instead of raising :class:`UnsafePickleError`.
    """
    try:
        with paused_gc():
            return _Unpickler(data, allow, unknown, source).load()
    except CheckpointError:
        raise
    except Exception as exc:  # malformed input raises all sorts of things
        raise CorruptRecordError(f"{source}: cannot unpickle: {type(exc).__name__}: {exc}") from exc
