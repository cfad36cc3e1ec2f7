"""Writers for the formats ckptkit produces: torch.save zips, safetensors files, DCP directories.

Each writes to file objects handed to it (see :class:`ckptkit.storage.AtomicOutput`) and streams
tensor bytes one tensor at a time, so memory stays at about one tensor whatever the total size.
"""

__all__ = ["dcp", "safetensors", "torch_save"]
