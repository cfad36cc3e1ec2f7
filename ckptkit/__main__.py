"""``python -m ckptkit …``: the ``ckptkit`` command line, so ``torchrun -m ckptkit unshard …``
starts it on every rank."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
