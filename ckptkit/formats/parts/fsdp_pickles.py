"""Stand-ins for the torch classes FSDP ShardedTensor and DTensor pickles name, and the allowlist
of globals a per-rank ``rank{N}.pt`` pickle may name (see :mod:`.rank_sets`).

torch cannot unpickle ShardedTensors without a process group; here the safe unpickler builds
plain stand-ins for those classes instead (nothing from torch is imported or run).
:mod:`.rank_sets` reads the decoded values by checking them against these classes, which keep
their leading underscore: their names show in error messages.

Pickle safety. The rank files' pickles are decoded with :data:`ALLOWED_GLOBALS`. Everything that
builds a tensor (``_rebuild_from_type_v2``, ``_rebuild_wrapper_subclass``, ``getattr``) accepts
only these stand-ins and raises :class:`UnsafePickleError` for anything else; other unknown
globals (user objects in trainer state) become named :class:`~ckptkit.unpickler.Opaque`
placeholders, as in any torch.save file. ``builtins.getattr`` is allowed for exactly one pair,
``(ShardedTensor, "ProcessGroupState")``, which is how ShardedTensor pickles its process-group
state class.
"""

from __future__ import annotations

from typing import Any

from ...decoding.unpickler import OBJECT_GLOBALS, Opaque, unsealed
from ...errors import UnsafePickleError
from .dcp_metadata import ALLOWED_GLOBALS as DCP_GLOBALS
from .dcp_metadata import restricted_getattr

# --------------------------------------------------------------------------------------------
# Stand-ins for the classes ShardedTensor and DTensor pickles name.


class _Standin:
    """A torch class stand-in: built (NEWOBJ/REDUCE) with its arguments, given its pickled state
    (BUILD) as a dict; nothing of torch's class runs."""

    def __new__(cls, *args: Any) -> _Standin:
        obj = object.__new__(cls)
        obj.args, obj.fields = args, {}
        return obj

    def __init__(self, *args: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.fields = _state_fields(state)

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)


def _state_fields(state: Any) -> dict:
    """A pickled state as one dict: the ``__dict__`` form, or ``(dict | None, slots dict)``."""
    if isinstance(state, dict):
        return state
    if (
        isinstance(state, tuple)
        and len(state) == 2
        and (state[0] is None or isinstance(state[0], dict))
        and isinstance(state[1], dict)
    ):
        return {**(state[0] or {}), **state[1]}
    return {}


class _ProcessGroupState(_Standin):
    """``ShardedTensor.ProcessGroupState``: local/global rank and world size of the writer."""


class _WrapperTensor(_Standin):
    """A tensor subclass rebuilt by ``_rebuild_wrapper_subclass``: global dtype and shape."""

    dtype: Any = None
    shape: Any = None


class _ShardedTensor(_WrapperTensor):
    """FSDP1's ShardedTensor: local shards plus the global metadata of every rank's shard."""

    #: Reachable only through the one ``getattr`` the allowlist permits.
    ProcessGroupState = _ProcessGroupState
    local_shards: Any = None
    metadata: Any = None
    pg_state: Any = None

    def __setstate__(self, state: Any) -> None:
        # ShardedTensor.__reduce__ state: (local_shards, metadata, pg_state, sharding_spec, rrefs)
        if isinstance(state, tuple) and len(state) >= 3:
            self.local_shards, self.metadata, self.pg_state = state[0], state[1], state[2]


class _DTensor(_WrapperTensor):
    """A DTensor: ``_local_tensor`` and ``_spec`` (mesh, placements, tensor_meta)."""


class _Shard(_Standin):
    pass


class _ShardMetadata(_Standin):
    pass


class _ShardedTensorMetadata(_Standin):
    pass


class _ChunkShardingSpec(_Standin):
    pass


class _RemoteDevice(_Standin):
    pass


class _DTensorSpec(_Standin):
    pass


class _TensorMeta(_Standin):
    """A NamedTuple ``(shape, stride, dtype)``, built from its arguments."""


class _DeviceMesh(_Standin):
    pass


class _MeshLayout(_Standin):
    pass


class _Placement(_Standin):
    pass


class _ShardPlacement(_Placement):
    """``Shard(dim)``."""


class _ReplicatePlacement(_Placement):
    """``Replicate()``."""


class _UnsupportedPlacement(_Placement):
    """``Partial`` (values not reduced yet) or ``_StridedShard``: refused when describing."""


_UNSUPPORTED: dict[str, type[_UnsupportedPlacement]] = {}


def value_name(value: Any) -> str:
    """How a refused value is named in messages: an unknown global by its name."""
    if isinstance(value, type) and issubclass(value, Opaque):
        return value.global_name
    if isinstance(value, Opaque):
        return type(value).global_name
    if isinstance(value, type):
        return value.__name__
    return type(value).__name__


#: ``builtins.getattr`` for the one pair ShardedTensor pickles use, and nothing else (the
#: shared restricted stand-in; Megatron's metadata allowlist builds its own from it).
_getattr = restricted_getattr(
    {(_ShardedTensor, "ProcessGroupState"): _ProcessGroupState},
    "getattr(ShardedTensor, 'ProcessGroupState')",
)


def _rebuild_wrapper_subclass(
    cls: Any, dtype: Any, size: Any, stride: Any, storage_offset: Any, *_ignored: Any
) -> _WrapperTensor:
    """``torch._utils._rebuild_wrapper_subclass`` for ShardedTensor and DTensor only."""
    if not (isinstance(cls, type) and issubclass(cls, _WrapperTensor)):
        raise UnsafePickleError(
            f"pickle rebuilds a tensor subclass {value_name(cls)}; only ShardedTensor and DTensor "
            "are decoded, nothing was run",
            global_name=value_name(cls),
        )
    obj = cls()
    obj.dtype = dtype
    obj.shape = tuple(size) if isinstance(size, (tuple, list)) else size
    return obj


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> _WrapperTensor:
    """``torch._tensor._rebuild_from_type_v2`` as ShardedTensor and DTensor pickles use it."""
    if unsealed(func) is not _rebuild_wrapper_subclass:
        raise UnsafePickleError(
            f"pickle rebuilds a tensor with {value_name(func)}; only _rebuild_wrapper_subclass of "
            "ShardedTensor / DTensor is decoded, nothing was run",
            global_name=value_name(func),
        )
    if not isinstance(args, tuple) or not args or args[0] is not new_type:
        raise UnsafePickleError(
            f"pickle rebuilds {value_name(new_type)} from other arguments than torch writes",
            global_name=value_name(new_type),
        )
    obj = _rebuild_wrapper_subclass(*args)
    obj.__setstate__(state)
    return obj


def _device(kind: Any, index: Any = None) -> str:
    """``torch.device('cpu')`` as the string ``'cpu'`` (``'cuda:0'`` with an index)."""
    if not isinstance(kind, str) or (index is not None and type(index) is not int):
        raise UnsafePickleError(
            "torch.device called with unexpected arguments", global_name="torch.device"
        )
    return kind if index is None else f"{kind}:{index}"


def _allowed_globals() -> dict[str, Any]:
    allow: dict[str, Any] = {
        **OBJECT_GLOBALS,
        "builtins.getattr": _getattr,
        "torch.device": _device,
        "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
        "torch._utils._rebuild_wrapper_subclass": _rebuild_wrapper_subclass,
        "torch.distributed._shard.sharded_tensor.api.ShardedTensor": _ShardedTensor,
        "torch.distributed._shard.sharded_tensor.shard.Shard": _Shard,
        "torch.distributed._shard.metadata.ShardMetadata": _ShardMetadata,
        "torch.distributed._shard.sharded_tensor.metadata.ShardedTensorMetadata": (
            _ShardedTensorMetadata
        ),
        "torch.distributed._shard.sharding_spec.chunk_sharding_spec.ChunkShardingSpec": (
            _ChunkShardingSpec
        ),
        "torch.distributed.remote_device._remote_device": _RemoteDevice,
        "torch.distributed.device_mesh.DeviceMesh": _DeviceMesh,
        "torch.distributed._tensor.device_mesh.DeviceMesh": _DeviceMesh,
        "torch.distributed._mesh_layout._MeshLayout": _MeshLayout,
        "torch.distributed._mesh_layout._FlatLayout": _MeshLayout,
    }
    for name in ("TensorProperties", "MEM_FORMAT_ENCODING"):  # the classes DCP's metadata names
        full = f"torch.distributed._shard.sharded_tensor.metadata.{name}"
        allow[full] = DCP_GLOBALS[full]
    # DTensor classes: torch >= 2.5 spells them under torch.distributed.tensor, older releases
    # under torch.distributed._tensor.
    for module in ("torch.distributed.tensor", "torch.distributed._tensor.api"):
        allow[f"{module}.DTensor"] = _DTensor
    for module in (
        "torch.distributed.tensor._dtensor_spec",
        "torch.distributed._tensor._dtensor_spec",
        "torch.distributed._tensor.placement_types",
    ):
        allow[f"{module}.DTensorSpec"] = _DTensorSpec
        allow[f"{module}.TensorMeta"] = _TensorMeta
        allow[f"{module}.ShardOrderEntry"] = _Standin
    for module in (
        "torch.distributed.tensor.placement_types",
        "torch.distributed._tensor.placement_types",
    ):
        allow[f"{module}.Shard"] = _ShardPlacement
        allow[f"{module}.Replicate"] = _ReplicatePlacement
        for name in ("Partial", "_Partial", "_StridedShard", "_MaskPartial"):
            allow[f"{module}.{name}"] = _UNSUPPORTED.setdefault(
                name, type(name, (_UnsupportedPlacement,), {})
            )
    return allow


#: What a rank file's pickle may name: the object allowlist plus the stand-ins above.
ALLOWED_GLOBALS = _allowed_globals()


#: The allowlist and the stand-ins :mod:`.rank_sets` checks decoded values against (their
#: leading underscores kept: the class names appear in error messages).
__all__ = [
    "ALLOWED_GLOBALS",
    "_DTensor",
    "_DTensorSpec",
    "_DeviceMesh",
    "_MeshLayout",
    "_ProcessGroupState",
    "_RemoteDevice",
    "_ReplicatePlacement",
    "_Shard",
    "_ShardMetadata",
    "_ShardPlacement",
    "_ShardedTensor",
    "_ShardedTensorMetadata",
    "_Standin",
    "value_name",
]
