"""Building blocks two or more format adapters share: DCP metadata, torch.save files (zip and
pre-1.6), per-rank file sets and their FSDP stand-ins, unfinished-save checks, checkpoints inside a
folder, Megatron's tensor-parallel rules and run tracker. Adapters import these, never each other."""

__all__ = [
    "dcp_metadata",
    "fsdp_pickles",
    "legacy_torch_save",
    "megatron_tp",
    "megatron_tracker",
    "megatron_tp_rules",
    "rank_sets",
    "sub_checkpoints",
    "torch_save_files",
    "unfinished",
]
