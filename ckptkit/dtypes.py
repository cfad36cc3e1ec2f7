"""Element types as torch spells them, with their sizes and their names in other formats.

Torch-free: inspection never needs torch, only the name → size/numpy/safetensors mappings here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import FormatError
from .extras import require

__all__ = [
    "DType",
    "BY_NAME",
    "BY_STORAGE",
    "BY_SAFETENSORS",
    "dtype",
    "from_safetensors",
    "to_numpy",
    "to_torch",
]


@dataclass(frozen=True, slots=True)
class DType:
    """One element type: torch's name, bytes per element, and its spelling elsewhere."""

    name: str
    itemsize: int
    numpy: str | None  # numpy dtype string; None where numpy has no such type (bfloat16, fp8)
    safetensors: str | None
    storage: str | None  # legacy typed-storage class in torch.save pickles, e.g. "FloatStorage"
    is_floating: bool = False

    def __repr__(self) -> str:
        return f"torch.{self.name}"


_TABLE = [
    DType("float64", 8, "<f8", "F64", "DoubleStorage", True),
    DType("float32", 4, "<f4", "F32", "FloatStorage", True),
    DType("float16", 2, "<f2", "F16", "HalfStorage", True),
    DType("bfloat16", 2, None, "BF16", "BFloat16Storage", True),
    DType("float8_e4m3fn", 1, None, "F8_E4M3", None, True),
    DType("float8_e5m2", 1, None, "F8_E5M2", None, True),
    DType("float8_e4m3fnuz", 1, None, None, None, True),
    DType("float8_e5m2fnuz", 1, None, None, None, True),
    DType("complex128", 16, "<c16", "C128", "ComplexDoubleStorage"),
    DType("complex64", 8, "<c8", "C64", "ComplexFloatStorage"),
    DType("int64", 8, "<i8", "I64", "LongStorage"),
    DType("int32", 4, "<i4", "I32", "IntStorage"),
    DType("int16", 2, "<i2", "I16", "ShortStorage"),
    DType("int8", 1, "|i1", "I8", "CharStorage"),
    DType("uint64", 8, "<u8", "U64", None),
    DType("uint32", 4, "<u4", "U32", None),
    DType("uint16", 2, "<u2", "U16", None),
    DType("uint8", 1, "|u1", "U8", "ByteStorage"),
    DType("bool", 1, "|b1", "BOOL", "BoolStorage"),
]

_ALIASES = {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "long": "int64",
    "int": "int32",
    "short": "int16",
    "cfloat": "complex64",
    "cdouble": "complex128",
}

BY_NAME: dict[str, DType] = {d.name: d for d in _TABLE}
BY_NAME.update({alias: BY_NAME[name] for alias, name in _ALIASES.items()})
BY_STORAGE: dict[str, DType] = {d.storage: d for d in _TABLE if d.storage}
BY_STORAGE["UntypedStorage"] = BY_NAME["uint8"]
BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in _TABLE if d.safetensors}


def dtype(name: str) -> DType:
    """Look a dtype up by torch name (``"float32"``, ``"torch.bfloat16"``, aliases included)."""
    found = BY_NAME.get(name.removeprefix("torch."))
    if found is None:
        raise FormatError(f"unknown dtype {name!r}")
    return found


def from_safetensors(code: str) -> DType:
    """The dtype a safetensors header code (``"BF16"``) stands for."""
    found = BY_SAFETENSORS.get(code)
    if found is None:
        raise FormatError(f"unknown safetensors dtype {code!r}")
    return found


def to_numpy(dt: DType) -> np.dtype:
    """A numpy dtype holding the same bytes: the type itself, or a same-sized uint for bf16/fp8."""
    return np.dtype(dt.numpy or f"<u{dt.itemsize}")


def to_torch(dt: DType):
    """The torch dtype object (imports torch)."""
    torch = require("torch", f"the torch dtype {dt.name}")

    return getattr(torch, dt.name)
