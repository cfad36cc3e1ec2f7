"""All file access, over fsspec: exact byte ranges, coalesced and fetched together.

No other module opens files. A :class:`Storage` is one checkpoint location (a local path or any
fsspec URL: ``s3://``, ``gs://``, ``https://``, ``memory://``…); the rest of ckptkit names files
relative to it; :class:`Store` states what formats and operations call on it (:class:`Output`:
on an output).

Local files are read directly. Remote stores get exact ranged requests (``cat_file(path, start,
end)``, never a read-ahead file object), at most :data:`~ckptkit.tunables.MAX_REQUEST` bytes
each and :data:`~ckptkit.storage.remote.MAX_IN_FLIGHT` at a time, retried with exponential
backoff on transient errors (5xx, throttling, connection resets) in
:func:`~ckptkit.storage.retry.call_with_retries` (behind ``Storage._call``), the one place that
also turns store errors into ckptkit's (404 → :class:`MissingFileError`, 403 →
:class:`AccessDeniedError`); for S3 the client's own retries are switched off so they do not
multiply (``remote._filesystem``). Nothing needs a listing: names are probed, sizes looked up one
by one where a store cannot list. ``cache=`` puts fsspec's ``blockcache`` / ``filecache`` in
front of a remote store. Writes go through :func:`atomic_output`: nothing appears under a final
name before success.

Every name, size and file type a checkpoint holds is untrusted: names are resolved in one
place (``Storage._resolve``: relative, no ``..``, no control characters, under the root, else
:class:`UnsafePathError`); local files are opened only if they are regular files inside the
root (no FIFO, device, or symlink leading outside); whole-file reads are bounded by
:data:`~ckptkit.tunables.SMALL_FILE_LIMIT` and no buffer is larger than what the file holds, whatever length a
record claims; source files are never memory-mapped (a file shrinking under a map is SIGBUS).
Output names follow the same rule (:class:`OutputNameError`) and write errors come out as
:class:`DestinationError`; staging folders of killed runs are removed by the next run.

The modules, one concern each (constants and helpers are looked up, and patched, where they live):

- :mod:`~ckptkit.storage.store`: the :class:`Storage` class, delegating to the modules below;
- :mod:`~ckptkit.storage.names`: which file names are safe (pure functions);
- :mod:`~ckptkit.storage.local`: local ``pread`` / large reads, file kinds for messages;
- :mod:`~ckptkit.storage.remote`: the fsspec filesystem factory, the I/O pool, large ranges in
  pieces, the sequential remote stream;
- :mod:`~ckptkit.storage.retry`: the retry loop and the translation of store errors;
- :mod:`~ckptkit.storage.atomic`: :class:`AtomicOutput` / :func:`atomic_output`: staged outputs
  published by a journal, all or nothing;
- :mod:`~ckptkit.storage.staged_files`: the staged files: a stream, or a :class:`RangedFile`
  written by threads at offsets;
- :mod:`~ckptkit.storage.multipart`: a file going up to S3 as parts, written by threads at offsets;
- :mod:`~ckptkit.storage.recovery`: owners, journals, and what the next run does with a killed
  run's staging (finish nothing half: roll back, remove);
- :mod:`~ckptkit.storage.anchored`: the one path walker: folders opened component by component
  without following links, every move, unlink and removal relative to a folder descriptor;
- :mod:`~ckptkit.storage.private_files`: the user's own cache files: created exclusively,
  never read or written through a link;
- :mod:`~ckptkit.storage.protocol`: :class:`Store`, :class:`Output` and :class:`RangedOutput`,
  the interfaces above.
"""

from __future__ import annotations

from .atomic import AtomicOutput, atomic_output
from .protocol import Output, RangedOutput, Store
from .staged_files import RangedFile
from .store import Storage

__all__ = [
    "AtomicOutput",
    "Output",
    "RangedFile",
    "RangedOutput",
    "Storage",
    "Store",
    "atomic_output",
]
