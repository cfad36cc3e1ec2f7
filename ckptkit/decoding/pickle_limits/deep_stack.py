"""Loading large pickles safely: their tuple nesting bounded by counting the opcodes that can
nest, and the load run on a thread whose C stack fits that bound (too large to simulate, a
pickle may still build deep tuples: hashing them then cannot overflow the stack)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ...errors import PickleLimitError

__all__ = ["NESTING_OPCODES", "nesting_bound", "run_with_stack"]


#: Opcodes that can put a tuple inside a tuple: TUPLE*, and calls (``tuple(x)``, stand-ins).
NESTING_OPCODES = b"t\x85\x86\x87R\x81\x92oi"


def nesting_bound(data: bytes | memoryview) -> int:
    """How deep tuples built by ``data`` could nest at most: its count of nesting opcode bytes
    (opcodes or not), found in one C pass (``bytes.translate`` deleting them)."""
    raw = bytes(data) if isinstance(data, memoryview) else data
    return len(raw) - len(raw.translate(None, NESTING_OPCODES))


#: C stack one level of tuple hashing takes (measured ~64 bytes on CPython 3.11 x86-64) × 2.
_STACK_PER_LEVEL = 128
_BASE_STACK = 16 << 20
_MAX_STACK = 4 << 30
_stack_lock = threading.Lock()


def run_with_stack(levels: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` on a thread whose C stack holds ``levels`` nested tuple hashes (the caller's
    thread when few enough). A pickle too large for that is refused."""
    if levels <= 1000:
        return fn()
    size = _BASE_STACK + levels * _STACK_PER_LEVEL
    if size > _MAX_STACK:
        raise PickleLimitError(
            f"pickle has {levels} nesting opcodes: too many to load with a bounded stack"
        )
    outcome: list[Any] = [None, None]

    def target() -> None:
        try:
            outcome[0] = fn()
        except BaseException as exc:  # handed back to the calling thread
            outcome[1] = exc

    with _stack_lock:
        previous = threading.stack_size(size)
        try:
            thread = threading.Thread(target=target, name="ckptkit-unpickle", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if outcome[1] is not None:
        raise outcome[1]
    return outcome[0]
