"""Building blocks the format adapters share: DCP metadata, torch.save files, per-rank file
sets, unfinished-save checks. Adapters import these, never each other."""
