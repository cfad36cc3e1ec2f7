"""Progress over bytes for long operations: a ``tqdm.auto`` bar, or nothing when disabled."""

from __future__ import annotations

import threading

__all__ = ["ByteProgress"]


class ByteProgress:
    """A tqdm bar counting bytes (``desc`` names the operation), or a do-nothing stand-in."""

    def __init__(self, total: int, enabled: bool, desc: str) -> None:
        self.bar = None
        self._lock = threading.Lock()  # workers on several threads update one bar
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc)

    def __enter__(self) -> ByteProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()

    def update(self, n: int) -> None:
        if self.bar is not None:
            with self._lock:
                self.bar.update(n)
