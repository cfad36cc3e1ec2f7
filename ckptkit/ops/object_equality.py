"""Equality of decoded objects (what :func:`ckptkit.diff` calls ``equal`` for non-tensor
entries): by value, type and bytes, never by calling anything the checkpoint named."""

from __future__ import annotations

import math
from argparse import Namespace
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..decoding.unpickler import Opaque, TensorRef

__all__ = ["holds_tensor", "same_value"]


def holds_tensor(value: Any) -> bool:
    """Whether a decoded value holds a tensor reference anywhere inside it."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, TensorRef):
            return True
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif isinstance(item, Opaque):
            stack.extend([*item.args, item.state, *item.items])
    return False


def same_value(x: Any, y: Any) -> bool:
    """Equality of decoded objects: types must match (any two mappings compare by items), NaN
    equals NaN, tensors and arrays by dtype, shape and bytes, placeholders by global name,
    arguments and state, namespaces by attributes."""
    if isinstance(x, Namespace | SimpleNamespace) and type(x) is type(y):
        x, y = vars(x), vars(y)
    if isinstance(x, Mapping) and isinstance(y, Mapping):
        return x.keys() == y.keys() and all(same_value(x[k], y[k]) for k in x)
    if type(x) is not type(y):
        return False
    if isinstance(x, Opaque):
        return (
            x.global_name == y.global_name
            and same_value(x.args, y.args)
            and same_value(x.state, y.state)
            and same_value(x.items, y.items)
        )
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(same_value(i, j) for i, j in zip(x, y, strict=True))
    if isinstance(x, float):
        return x == y or (math.isnan(x) and math.isnan(y))
    if isinstance(x, np.ndarray):
        return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
    if type(x).__module__ == "torch" and type(x).__name__ == "Tensor":
        import torch  # already imported: x is a tensor

        return (
            x.dtype == y.dtype
            and x.shape == y.shape
            and x.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            == y.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        )
    try:
        return bool(x == y)
    except (TypeError, ValueError):
        return x is y
