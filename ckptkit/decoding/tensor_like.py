"""Which decoded leaves are tensors ckptkit did not read: placeholders of tensor classes.

A torch.save pickle rebuilds a tensor subclass (DTensor, ShardedTensor, torchao's quantized
tensors…) through torch functions such as ``torch._tensor._rebuild_from_type_v2``. Outside the
allowlist those become :class:`~ckptkit.decoding.unpickler.Opaque` placeholders: the leaf is
then an *object*, and its tensor bytes are never read. :func:`tensor_class` names such leaves,
so the catalog can mark them and no operation mistakes "no tensors" for an empty checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .unpickler import Opaque

__all__ = ["TENSOR_CLASSES", "TENSOR_REBUILDERS", "tensor_class"]

#: torch functions a pickle calls to rebuild a tensor, and what they rebuild when no class is
#: named among their arguments.
TENSOR_REBUILDERS: dict[str, str] = {
    "torch._tensor._rebuild_from_type_v2": "tensor subclass",
    "torch._utils._rebuild_wrapper_subclass": "tensor subclass",
    "torch._utils._rebuild_sparse_tensor": "sparse tensor",
    "torch._utils._rebuild_sparse_csr_tensor": "sparse tensor",
    "torch._utils._rebuild_qtensor": "quantized tensor",
    "torch._utils._rebuild_nested_tensor": "nested tensor",
    "torch._utils._rebuild_meta_tensor_no_storage": "meta tensor",
    "torch._utils._rebuild_device_tensor_from_numpy": "device tensor",
    "torch._utils._rebuild_device_tensor_from_cpu_tensor": "device tensor",
    "torch._utils._rebuild_xla_tensor": "XLA tensor",
    "torch._utils._rebuild_mkldnn_tensor": "MKL-DNN tensor",
}
#: Tensor classes a placeholder may stand for directly (by their global), short names shown.
TENSOR_CLASSES: dict[str, str] = {
    "torch.distributed.tensor.DTensor": "DTensor",
    "torch.distributed._tensor.api.DTensor": "DTensor",
    "torch.distributed.tensor._api.DTensor": "DTensor",
    "torch.distributed._shard.sharded_tensor.api.ShardedTensor": "ShardedTensor",
    "torch.distributed._shard.sharded_tensor.ShardedTensor": "ShardedTensor",
    "torch.Tensor": "Tensor",
    "torch.nn.parameter.Parameter": "Parameter",
}
#: Values looked at, at most, inside one leaf's containers (a list of DTensors is one leaf).
_MAX_VISITS = 10_000


def tensor_class(value: Any) -> str | None:
    """The tensor class ``value`` holds as a placeholder (``"DTensor"``, ``"ShardedTensor"``,
    ``"NF4Tensor"``, ``"sparse tensor"``…), looking into plain containers too; None when it
    holds no tensor left undecoded. Reads nothing, runs nothing: only names are compared."""
    stack, visits = [value], 0
    while stack and visits < _MAX_VISITS:
        item = stack.pop()
        visits += 1
        if isinstance(item, Opaque):
            name = _placeholder_class(item)
            if name is not None:
                return name
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
    return None


def _placeholder_class(item: Opaque) -> str | None:
    """What tensor a placeholder is: the class a rebuild function names among its arguments
    (``_rebuild_from_type_v2(func, DTensor, …)``), a tensor class itself, else None."""
    name = type(item).global_name
    if name in TENSOR_REBUILDERS:
        for arg in item.args:
            named = isinstance(arg, type) and issubclass(arg, Opaque)
            if named and arg.global_name not in TENSOR_REBUILDERS:
                return _short(arg.global_name)
        return TENSOR_REBUILDERS[name]
    if name in TENSOR_CLASSES or type(item).qualname.endswith("Tensor"):
        return _short(name)
    return None


def _short(global_name: str) -> str:
    return TENSOR_CLASSES.get(global_name) or global_name.rsplit(".", 1)[-1]
