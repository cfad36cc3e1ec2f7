"""Optional dependencies: which extra of the ``torch-ckptkit`` distribution brings each package,
and the one way code imports them, so a missing one is a :class:`MissingExtraError` naming the
``pip install`` line instead of a bare ``ModuleNotFoundError`` from deep inside a call.

The base install inspects, verifies, diffs, computes statistics and writes safetensors and
torch.save files without any of these.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingExtraError

__all__ = [
    "DISTRIBUTION",
    "EXTRA_OF_PACKAGE",
    "EXTRA_OF_PROTOCOL",
    "install_command",
    "require",
    "require_protocols",
]

#: The name ckptkit has on the package index (``ckptkit`` there is an unrelated project).
DISTRIBUTION = "torch-ckptkit"

#: Top-level package → the extra that installs it.
EXTRA_OF_PACKAGE: dict[str, str] = {
    "torch": "torch",
    "s3fs": "s3",
    "gcsfs": "gcs",
    "pyarrow": "runs",
    "matplotlib": "notebooks",
    "ipywidgets": "notebooks",
    "papermill": "notebooks",
    "nbconvert": "notebooks",
}

#: fsspec protocol → the package that implements it (when the base install lacks it).
EXTRA_OF_PROTOCOL: dict[str, str] = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}


def install_command(extra: str) -> str:
    """The shell line that installs ``extra``: ``pip install 'torch-ckptkit[torch]'``."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def require(module: str, purpose: str) -> ModuleType:
    """``import module`` for ``purpose`` (what the caller is doing, e.g. ``"read() as torch
    tensors"``); if its package is not installed, a :class:`MissingExtraError` naming the extra.

    Only the package itself being absent is translated: an installed package that fails to
    import (a broken dependency of its own) raises as it is.
    """
    package = module.partition(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] != package:
            raise
        extra = EXTRA_OF_PACKAGE.get(package, "all")
        raise MissingExtraError(
            f"{purpose} needs {package}, which is not installed: {install_command(extra)}",
            extra=extra,
            module=package,
        ) from exc


def require_protocols(url: str) -> None:
    """Check the packages behind ``url``'s fsspec protocols (each part of a chained
    ``blockcache::s3://…``) are installed, before fsspec is asked for the filesystem."""
    for part in url.split("::"):
        protocol, sep, _ = part.partition("://")
        package = EXTRA_OF_PROTOCOL.get(protocol.lower()) if sep else None
        if package is not None:
            require(package, f"a {protocol}:// location")
