"""Untrusted text made safe for a terminal: a checkpoint's names are printed with every
character a terminal would act on escaped (a key can hold an escape sequence that retitles the
window or sets the clipboard)."""

from __future__ import annotations

from typing import TextIO

__all__ = ["PrintableStream", "printable"]


#: Characters a checkpoint's names may hold that a terminal would act on (C0/C1 controls but
#: newline and tab, DEL, bidirectional overrides): printed escaped, as ``\x1b``.
_UNPRINTABLE = {
    c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"
    for c in [*range(0x20), *range(0x7F, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
    if chr(c) not in "\n\t"
}


def printable(text: str) -> str:
    """``text`` with every character a terminal would interpret escaped (names come from the
    checkpoint: a key can hold an escape sequence that retitles the window or sets the
    clipboard)."""
    return text.translate(_UNPRINTABLE)


class PrintableStream:
    """A text stream that escapes what :func:`printable` escapes before writing (the CLI
    points ``sys.stdout`` at one, so nothing it prints reaches the terminal raw)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        return self.stream.write(printable(text))

    def __getattr__(self, name: str):
        return getattr(self.stream, name)
