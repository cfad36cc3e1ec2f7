"""Operations on any checkpoint, never knowing its format: unshard / convert, diff, stats, sizes,
verify, state dicts, LoRA merging, and the plan → execute machinery (threads, torch.distributed
ranks) with the writers of the formats ckptkit produces."""

__all__ = [
    "convert",
    "diff",
    "diff_keys",
    "distributed",
    "lora",
    "object_equality",
    "output_plans",
    "output_runs",
    "sizes",
    "source",
    "state_dict",
    "stats",
    "verify",
    "work",
    "writers",
]
