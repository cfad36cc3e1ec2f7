"""Stand-ins for the classes Megatron-core's ``torch_dist`` ``.metadata`` pickles besides
torch's DCP ones: ``MCoreMetadata`` (0.8-0.15: a ``Metadata`` with ``mcore_data``),
``MCoreSavePlan`` and torch's planner classes (``SavePlan``, ``WriteItem``, ``WriteItemType``,
``TensorWriteData``) of the ``all_local_plans`` it attaches, and ``builtins.getattr`` for the
enum members those plans name. Nothing of Megatron's or torch's classes runs.

They are in the Megatron allowlist only, never in the plain DCP one: torch's own writer pickles
none of them, so a plain DCP ``.metadata`` naming a planner class or ``getattr`` stays refused
(fewer callables on the common path), and Megatron directories are recognised by their
``metadata.json`` before the DCP adapter looks.
"""

from __future__ import annotations

from typing import Any

from ..parts.dcp_metadata import MEMORY_FORMAT_MEMBERS, MetadataStandin, Standin, restricted_getattr

__all__ = ["MEGATRON_GLOBALS", "mcore_data"]


class _MCoreMetadata(MetadataStandin):
    """``MCoreMetadata``: torch's ``Metadata`` plus ``mcore_data`` (per-key Megatron facts,
    e.g. ``nd_reformulated_orig_global_shape``)."""

    __slots__ = ()


class _PlanStandin(Standin):
    """A save-plan class (``SavePlan``, ``MCoreSavePlan``, ``WriteItem``, ``TensorWriteData``):
    its pickled state kept, never used to read anything."""

    __slots__ = ()


class _WriteItemType:
    """torch's ``WriteItemType`` enum: only its member names, reached through the allowed
    ``getattr`` (Python >= 3.12 pickles enum members as ``getattr(cls, name)``) or called with
    a member value (older pickles)."""

    __slots__ = ("value",)
    MEMBERS = ("TENSOR", "SHARD", "BYTE_IO")

    def __init__(self, value: Any = None) -> None:
        self.value = value if isinstance(value, int | str) else None

    def __setstate__(self, state: Any) -> None:
        self.value = None


def _member(name: str) -> _WriteItemType:
    return _WriteItemType(name)


_PLANNER = "torch.distributed.checkpoint.planner"
_MCORE = "megatron.core.dist_checkpointing.strategies.torch"

#: ``getattr`` pairs the Megatron metadata pickles use: enum members of ``WriteItemType`` and
#: of the memory-format encoding, as Python >= 3.12 pickles enum members.
_GETATTR = restricted_getattr(
    {
        **{(_WriteItemType, name): _member(name) for name in _WriteItemType.MEMBERS},
        **MEMORY_FORMAT_MEMBERS,
    },
    "getattr on the members of WriteItemType and _MEM_FORMAT_ENCODING",
)

#: What a Megatron ``torch_dist`` ``.metadata`` may name besides the DCP allowlist.
MEGATRON_GLOBALS: dict[str, Any] = {
    "builtins.getattr": _GETATTR,
    f"{_MCORE}.MCoreMetadata": _MCoreMetadata,
    f"{_MCORE}.MCoreSavePlan": _PlanStandin,
    f"{_PLANNER}.SavePlan": _PlanStandin,
    f"{_PLANNER}.WriteItem": _PlanStandin,
    f"{_PLANNER}.TensorWriteData": _PlanStandin,
    f"{_PLANNER}.WriteItemType": _WriteItemType,
}


def mcore_data(metadata: Any) -> dict[str, dict]:
    """``MCoreMetadata.mcore_data`` as ``{key: {field: value}}`` (empty when absent or not a
    mapping of mappings)."""
    data = metadata.get("mcore_data") if isinstance(metadata, Standin) else None
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, dict)}
