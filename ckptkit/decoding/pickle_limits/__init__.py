"""Resource limits for untrusted pickles, checked before and after the C unpickler runs them.

The C unpickler never runs code through ckptkit's allowlist, but it trusts sizes: a 9-byte
pickle with ``LONG_BINPUT 500000000`` makes it allocate and zero an 8 GB memo, ``BINBYTES8``
allocates the announced length before reading it, and hashing a tuple nested 150 000 deep
(a 150 KB pickle of ``TUPLE1`` opcodes used as a dict key) overflows the C stack, while tuples
that share their halves 40 levels deep take 2**40 steps to hash. So every pickle is first
*scanned* (opcodes walked without building anything; a regular expression skips the harmless
ones at C speed): memo indices, announced lengths, frames and opcodes are checked. Small pickles
are also *simulated* (stack effects only) to bound tuple nesting exactly; larger ones are loaded
on a thread whose stack fits the deepest nesting their tuple opcodes could build. The loaded
value is then *walked* once (iteratively) to bound nesting depth, container sizes and sharing
before any recursive code (``repr``, flattening, ``nest``) touches it.

The caps are in :mod:`.limits`, the scan in :mod:`.opcodes`, the simulation in
:mod:`.simulation`, loading with a sized stack in :mod:`.deep_stack`, the walk in :mod:`.walk`.
"""

from __future__ import annotations

from .deep_stack import NESTING_OPCODES, nesting_bound, run_with_stack
from .limits import METADATA_LIMITS, OBJECT_LIMITS, RECORD_LIMITS, Limits, limit_error
from .opcodes import scan, scan_pieces
from .simulation import ATOM, PASS, TUPLE, UNKNOWN, simulate
from .walk import check_value

__all__ = [
    "ATOM",
    "METADATA_LIMITS",
    "NESTING_OPCODES",
    "OBJECT_LIMITS",
    "PASS",
    "RECORD_LIMITS",
    "TUPLE",
    "UNKNOWN",
    "Limits",
    "check_value",
    "limit_error",
    "nesting_bound",
    "run_with_stack",
    "scan",
    "scan_pieces",
    "simulate",
]
