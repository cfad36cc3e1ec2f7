"""The caps for one kind of pickle (:class:`Limits`) and those ckptkit reads with: DCP metadata,
tensor records, user objects."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import PickleLimitError

__all__ = ["METADATA_LIMITS", "OBJECT_LIMITS", "RECORD_LIMITS", "Limits", "limit_error"]


@dataclass(frozen=True)
class Limits:
    """Caps for one kind of pickle. Exceeding one raises :class:`PickleLimitError`."""

    #: Input bytes.
    max_bytes: int
    #: Highest memo index a PUT may name (also never above its position in the input).
    max_memo: int = 1 << 26
    #: Nesting of tuples inside tuples (hashing recurses through them without a guard).
    max_tuple_depth: int = 24
    #: Nesting of containers in the loaded value (walking it recurses).
    max_depth: int = 100
    #: Elements in any one container, and nodes of the value counted as a tree (sharing).
    max_items: int = 1 << 26
    #: Bytes of one integer (LONG1/LONG4); ``repr`` refuses ints above 4300 digits anyway.
    max_int_bytes: int = 1024
    #: Distinct globals one pickle may name. One outside the allowlist becomes a placeholder
    #: class (a TorchScript class name too): ~3 KB each, for ~10 bytes of pickle.
    max_globals: int = 4096
    #: Characters of a global's module and name together (a placeholder keeps them, and every
    #: lookup joins them: a long memoized module name reused by each global would cost its
    #: length again and again). Python's own qualified names are far shorter.
    max_global_name: int = 4096
    #: Pickles up to this size (or with at most 4096 nesting opcodes) have their tuple nesting
    #: computed exactly before loading. Larger ones load on a thread with a stack deep enough
    #: for any nesting they could build: they cannot crash, but tuples sharing their halves
    #: could still take long to hash (DCP metadata of more than ~3500 chunks is in this case).
    simulate_bytes: int = 512 << 10
    #: Walk the loaded value (False for DCP metadata: its adapter type-checks what it keeps).
    check_value: bool = True
    #: Allow reference cycles that pass through an object (OmegaConf nodes point back to their
    #: parents); cycles made of dicts and lists alone are refused always (flattening walks them).
    object_cycles: bool = False


#: DCP ``.metadata``: large (70 MB at 512k chunks), read by the DCP adapter, which validates.
METADATA_LIMITS = Limits(max_bytes=2 << 30, check_value=False)
#: A tensor record's ``data.pkl``: a few hundred bytes describing one tensor.
RECORD_LIMITS = Limits(max_bytes=1 << 20)
#: User objects and whole torch.save pickles (trainer state, optimizer param groups, …).
OBJECT_LIMITS = Limits(max_bytes=1 << 30, object_cycles=True)


def limit_error(source: str, what: str) -> PickleLimitError:
    """The error refusing a pickle from ``source`` for going over a limit (``what``)."""
    return PickleLimitError(f"{source}: pickle refused, over a limit: {what}")
