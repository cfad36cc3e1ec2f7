"""The error a legacy Megatron checkpoint is refused with when its ranks cannot be merged."""

from __future__ import annotations

from ...errors import FormatError

__all__ = ["MegatronLegacyError"]


class MegatronLegacyError(FormatError):
    """A legacy Megatron checkpoint ckptkit will not merge: a parameter no naming rule covers,
    shapes that disagree with ``args``, ranks that disagree, a layout not supported. ``file``
    and ``key`` name where (the rank file, the key in it)."""

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.file = file
        self.key = key
