"""Decoding untrusted bytes: the one safe unpickler and its limits, the objects it knows, and the
records of torch.save zips, safetensors headers and config files. Nothing here runs checkpoint
code; everything here reads through :mod:`ckptkit.storage`."""

__all__ = [
    "bounded_repr",
    "known_objects",
    "pickle_limits",
    "pickle_stream",
    "placeholders",
    "record_layouts",
    "records",
    "run_config",
    "tensor_like",
    "unpickler",
]
