"""Building blocks two or more format adapters share: DCP metadata, torch.save files (zip and
pre-1.6), per-rank file sets and their FSDP stand-ins, unfinished-save checks, files a format
leaves unread. Adapters import these, never each other."""

__all__ = [
    "dcp_metadata",
    "fsdp_pickles",
    "legacy_torch_save",
    "rank_sets",
    "torch_save_files",
    "unfinished",
]
