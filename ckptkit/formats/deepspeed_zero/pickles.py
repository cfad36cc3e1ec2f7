"""Stand-ins for the globals DeepSpeed ZeRO checkpoints pickle, for the safe unpickler.

``ZeroStageEnum`` (an int enum) decodes to its int; ``fragment_address`` (a dataclass of two
ints) to :class:`FragmentAddress`; stage 3's ``torch._tensor._rebuild_from_type_v2`` (a plain
tensor carrying a ``ds_id`` attribute) to the tensor itself, once its arguments are checked.
``LossScaler`` and other classes stay :class:`~ckptkit.unpickler.Opaque` placeholders.
"""

from __future__ import annotations

from typing import Any

from ...decoding.bounded_repr import bounded_repr
from ...decoding.unpickler import OBJECT_GLOBALS, TensorRef, unsealed
from ...errors import CorruptRecordError, UnsafePickleError

_REBUILD_TENSOR = unsealed(OBJECT_GLOBALS["torch._utils._rebuild_tensor_v2"])


def _zero_stage(value: Any = None) -> int:
    """``ZeroStageEnum(n)`` → ``n`` (0 disabled … 3 weights)."""
    if type(value) is not int or not 0 <= value <= 3:
        raise CorruptRecordError(f"ZeroStageEnum({bounded_repr(value)}) is not a ZeRO stage 0..3")
    return value


class FragmentAddress:
    """``deepspeed.utils.tensor_fragment.fragment_address``: where a parameter's fragment lies
    in a rank's flat partition (``start``, ``numel``); set once, from a dict of two ints."""

    __slots__ = ("numel", "start")

    def __init__(self, *args: Any) -> None:
        if args:
            raise CorruptRecordError("fragment_address is built from its state, not arguments")

    def __setstate__(self, state: Any) -> None:
        if hasattr(self, "numel"):
            raise UnsafePickleError("the pickle sets a fragment_address twice")
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None:
            state = state[1]  # (None, slots) for slotted classes
        if not isinstance(state, dict) or set(state) != {"numel", "start"}:
            raise CorruptRecordError(
                f"fragment_address state {bounded_repr(state)} is not numel/start"
            )
        numel, start = state["numel"], state["start"]
        if type(numel) is not int or type(start) is not int or numel < 0 or start < 0:
            raise CorruptRecordError(
                f"fragment_address({bounded_repr(numel)}, {bounded_repr(start)}) is not two ints"
            )
        self.numel, self.start = numel, start

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FragmentAddress) and (self.numel, self.start) == (
            other.numel,
            other.start,
        )

    def __hash__(self) -> int:
        return hash((self.numel, self.start))

    def __repr__(self) -> str:
        return f"fragment_address(numel={getattr(self, 'numel', None)}, start={getattr(self, 'start', None)})"


class _TensorType:
    """``torch.Tensor`` as a pickle names it: only ever an argument of
    ``_rebuild_from_type_v2``, never called."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise UnsafePickleError("the pickle tries to change torch.Tensor")


_TENSOR = _TensorType()


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> TensorRef:
    """A plain tensor saved with Python attributes (stage 3's ``ds_id``): the tensor, the
    attributes dropped."""
    if unsealed(func) is not _REBUILD_TENSOR or new_type is not _TENSOR:
        raise UnsafePickleError(
            "pickle rebuilds a tensor with something other than torch.Tensor / "
            "_rebuild_tensor_v2; nothing was run",
            global_name="torch._tensor._rebuild_from_type_v2",
        )
    if not isinstance(args, tuple) or not isinstance(state, dict | type(None)):
        raise CorruptRecordError("_rebuild_from_type_v2 called with unexpected arguments")
    ref = _REBUILD_TENSOR(*args)
    if not isinstance(ref, TensorRef):
        raise CorruptRecordError("_rebuild_from_type_v2 did not rebuild a tensor")
    return ref


#: What DeepSpeed ZeRO model-state and optimizer-state pickles may name.
ZERO_GLOBALS: dict[str, Any] = {
    **OBJECT_GLOBALS,
    "deepspeed.runtime.zero.config.ZeroStageEnum": _zero_stage,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
    "torch.Tensor": _TENSOR,
}


__all__ = ["ZERO_GLOBALS", "FragmentAddress"]
