"""Safetensors headers read by range, shared by every adapter whose files are safetensors
(plain and HF-sharded safetensors, torch's HF per-rank shards, OLMo-core 0.x rank files)."""

from __future__ import annotations

from ...records import SafetensorsHeader, parse_safetensors_header, safetensors_header_length
from ...storage import Storage


def read_headers(storage: Storage, files: list[str]) -> dict[str, SafetensorsHeader]:
    """Each safetensors file's parsed header, in two batched rounds of range reads."""
    prefixes = storage.read_ranges([(file, 0, 8) for file in files])
    lengths = [
        safetensors_header_length(prefix, storage.describe(file))
        for file, prefix in zip(files, prefixes, strict=True)
    ]
    raws = storage.read_ranges([(file, 8, 8 + n) for file, n in zip(files, lengths, strict=True)])
    return {
        file: parse_safetensors_header(raw, storage.describe(file))
        for file, raw in zip(files, raws, strict=True)
    }
