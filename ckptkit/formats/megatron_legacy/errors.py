"""The error a legacy Megatron checkpoint is refused with when its ranks cannot be merged."""

from __future__ import annotations

from ..parts.megatron_tp_rules import MegatronTPError

__all__ = ["MegatronLegacyError"]


class MegatronLegacyError(MegatronTPError):
    """A legacy Megatron checkpoint ckptkit will not merge: a parameter no naming rule covers,
    shapes that disagree with ``args``, ranks that disagree, a layout not supported. ``file``
    and ``key`` name where (the rank file, the key in it)."""
