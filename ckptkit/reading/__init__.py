"""Reading values out of a catalog: tensors assembled from their chunks, objects decoded safely.

Format-free: it sees only entries, chunks and records. Tensors are assembled in numpy (torch is
imported only to hand back a ``torch.Tensor``), a bounded batch of records at a time.

:class:`Reader` (:mod:`.reader`) is the front: tensors whole or streamed, small ones read
ahead. Under it, :mod:`.objects` decodes object entries without running their pickles,
:mod:`.fetch` fetches records and decodes what tensor chunks store, :mod:`.geometry` views
records as numpy arrays and checks that chunks tile their tensor. :mod:`.trusted` alone runs a
checkpoint's pickle code (``read_object(trust=True)``). :mod:`.tensor_blocks` walks a tensor
in fixed-size blocks.
"""

from __future__ import annotations

from .geometry import check_coverage, strided_view
from .reader import Reader

__all__ = ["Reader", "check_coverage", "strided_view"]
