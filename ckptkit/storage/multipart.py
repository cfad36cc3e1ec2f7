"""One output file going to an object store as a multipart upload (the S3 protocol, through
s3fs), written at offsets by several threads at once, as a :class:`.RangedFile` is locally.

The file is cut into blocks of one part each (:func:`part_bytes`). A block is sent as its part
as soon as all its bytes are written (gathered in memory unless one write covers it), in the
background, at most :data:`~ckptkit.tunables.UPLOAD_PARTS_IN_FLIGHT` at a time: nothing is
staged on local disk, and memory holds the parts travelling plus the block each writer is in
(and the blocks it shares with the writers beside it). The object appears, whole, only when
the upload is completed (:meth:`RangedUpload.complete`, on publish); :meth:`RangedUpload.abort`
takes every part back. The upload's id is recorded in the output's staging folder
(:func:`record_uploads`), so the next run aborts what a killed one left.

The ranks of a job write one upload too: each joins it by its id (``upload_id=``), sends the
blocks it wrote whole, and hands over the parts it sent and its pieces of the blocks it shares
with other ranks (:meth:`RangedUpload.hand_over`); the rank that created the upload takes them
(:meth:`RangedUpload.take_over`), sends those blocks and completes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from .. import tunables
from ..errors import DestinationError
from .staged_files import WritesAtOffsets
from .store import Storage

__all__ = [
    "MAX_PARTS",
    "Handover",
    "MIN_PART_BYTES",
    "PartSender",
    "UPLOADS_FILE",
    "RangedUpload",
    "abort_recorded",
    "part_bytes",
    "record_uploads",
    "supported",
]

#: The S3 protocol's bounds: every part but the last at least this large, at most this many.
MIN_PART_BYTES = 5 << 20
MAX_PARTS = 10_000
#: The file in a staging folder listing its uploads in progress (for the next run to abort).
UPLOADS_FILE = ".ckptkit-uploads.json"  # a reserved name: no output takes it


def supported(destination: Storage) -> bool:
    """Whether ``destination`` is an object store whose multipart uploads this module drives
    (s3fs: ``s3://``)."""
    return not destination.local and callable(getattr(destination.fs, "call_s3", None))


def part_bytes(size: int) -> int:
    """The part size for a file of ``size`` bytes: :data:`~ckptkit.tunables.UPLOAD_PART_BYTES`,
    at least the protocol's minimum, and large enough for ``size`` in :data:`MAX_PARTS` parts
    (whole MiB)."""
    wanted = max(tunables.UPLOAD_PART_BYTES, MIN_PART_BYTES, -(-size // MAX_PARTS))
    return -(-wanted // (1 << 20)) << 20


class PartSender:
    """The parts of one output's uploads on their way: at most
    :data:`~ckptkit.tunables.UPLOAD_PARTS_IN_FLIGHT` at a time whatever the number of files
    (their bytes held meanwhile), on one pool's threads."""

    def __init__(self) -> None:
        self._in_flight = max(1, tunables.UPLOAD_PARTS_IN_FLIGHT)
        self._slots = threading.BoundedSemaphore(self._in_flight)
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # made for the first part

    def submit(self, send: Callable[..., None], *args: Any) -> Future:
        """``send(*args)`` on the pool, once a slot is free (waiting for one)."""
        self._slots.acquire()
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._in_flight, "ckptkit-upload")
            future = self._pool.submit(send, *args)
        future.add_done_callback(lambda _: self._slots.release())  # cancelled ones too
        return future

    def close(self) -> None:
        """Let the pool's threads go (after the parts on their way; again: nothing happens)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


class RangedUpload(WritesAtOffsets):
    """A multipart upload of ``size`` bytes to ``name`` in ``destination``, written at offsets
    (:meth:`write_at`, :meth:`writer_at`) by several threads at once; its store errors come out
    as ckptkit errors naming the final file."""

    def __init__(
        self,
        destination: Storage,
        name: str,
        size: int,
        sender: PartSender | None = None,
        *,
        upload_id: str | None = None,
    ) -> None:
        self._destination, self.name, self.size = destination, name, size
        self.block = part_bytes(size)
        bucket, key, _ = destination.fs.split_path(destination.path(name))
        self._where = {"Bucket": bucket, "Key": key}
        #: a new upload is this process's to complete or abort; one joined (``upload_id``,
        #: another rank's) is handed over to that rank once written (:meth:`hand_over`)
        self._owned = upload_id is None
        self.joined = not self._owned
        if upload_id is None:
            upload_id = self._call("create_multipart_upload")["UploadId"]
        self.upload_id: str = upload_id
        self._lock = threading.Lock()
        self._partial: dict[int, list[tuple[int, bytes]]] = {}  # pieces of blocks written in part
        self._filled: dict[int, int] = {}  # their bytes written
        self._etags: dict[int, str | None] = {}  # uploaded (or being uploaded) blocks
        self._closed = False
        self._finished = False  # completed or aborted
        self._sender = sender if sender is not None else PartSender()
        self._sending: set[Future] = set()  # this file's parts on their way
        self._failure: BaseException | None = None  # the first part that could not be sent

    @property
    def handle(self) -> str:
        """What another rank passes to join this upload (its id)."""
        return self.upload_id

    @property
    def record(self) -> dict[str, str]:
        """What the next run needs to abort this upload."""
        return {"name": self.name, **self._where, "upload_id": self.upload_id}

    def _call(self, operation: str, **kwargs: Any) -> Any:
        fs = self._destination.fs
        if operation != "create_multipart_upload":
            kwargs["UploadId"] = self.upload_id
        return self._destination._call(self.name, fs.call_s3, operation, **self._where, **kwargs)

    def _span(self, index: int) -> tuple[int, int]:
        start = index * self.block
        return start, min(start + self.block, self.size)

    def write_at(self, offset: int, data: bytes | memoryview) -> None:
        """Write all of ``data`` at ``offset`` (a range no other thread writes); every block
        it completes is on its way as a part when this returns."""
        view = memoryview(data).cast("B")
        end = offset + view.nbytes
        if self._closed:
            raise ValueError(f"{self.name}: written after it was closed")
        if offset < 0 or end > self.size:
            raise DestinationError(
                f"{self._destination.describe(self.name)}: bytes {offset}-{end} written beyond "
                f"its planned size of {self.size}"
            )
        position, index = offset, offset // self.block
        while position < end:
            start, stop = self._span(index)
            piece = view[position - offset : min(end, stop) - offset]
            whole = self._place(index, start, stop, position, piece)
            if whole is not None:
                self._upload(index, whole)
            position, index = stop, index + 1

    def _place(
        self, index: int, start: int, stop: int, position: int, piece: memoryview
    ) -> memoryview | bytes | None:
        """Put ``piece`` into block ``index``; the block's bytes when it is now whole. A block
        written in part keeps only the pieces written (copied): a file whose first bytes are
        written early (a header) holds those, not a whole block, until the rest comes."""
        with self._lock:
            if index in self._etags:
                raise DestinationError(
                    f"{self._destination.describe(self.name)}: bytes at {position} written twice"
                )
            if position == start and piece.nbytes == stop - start and index not in self._partial:
                self._etags[index] = None
                return piece  # the whole block in one write: sent from the writer's buffer
            self._partial.setdefault(index, []).append((position, bytes(piece)))
            self._filled[index] = self._filled.get(index, 0) + piece.nbytes
            if self._filled[index] < stop - start:
                return None
            pieces = self._partial.pop(index)
            del self._filled[index]
            self._etags[index] = None
        return _joined(pieces, start, stop)

    def _upload(self, index: int, body: memoryview | bytes) -> None:
        """Send block ``index`` in the background (its bytes copied: the writer's buffer is
        reused once this returns); waits while the output's
        :data:`~ckptkit.tunables.UPLOAD_PARTS_IN_FLIGHT` parts travel."""
        self._raise_failure()
        data = body if isinstance(body, bytes) else bytes(body)
        future = self._sender.submit(self._send, index, data)
        with self._lock:
            self._sending.add(future)
        future.add_done_callback(self._sent)

    def _send(self, index: int, data: bytes) -> None:
        try:
            found = self._call("upload_part", PartNumber=index + 1, Body=data)
            with self._lock:
                self._etags[index] = found["ETag"]
        except BaseException as exc:
            with self._lock:
                self._failure = self._failure or exc
            raise

    def _sent(self, future: Future) -> None:
        with self._lock:
            self._sending.discard(future)

    def _raise_failure(self) -> None:
        """A part that could not be sent fails the writer that comes next, and the completion."""
        if self._failure is not None:
            raise self._failure

    def _stop_sending(self, cancel: bool) -> None:
        """Wait for the parts travelling (cancelling those not started, with ``cancel``)."""
        with self._lock:
            pending = list(self._sending)
        if cancel:
            for future in pending:
                future.cancel()
        wait(pending)

    def close(self) -> None:
        """No more writes (the upload stays open until completed or aborted)."""
        self._closed = True

    def hand_over(self) -> Handover:
        """Once this process's writes to a joined upload are done: wait for its parts on their
        way, and say what the rank that completes the upload needs: the parts sent, and the
        pieces of blocks this process wrote in part (a block another rank writes the rest of)."""
        self._stop_sending(cancel=False)
        self._raise_failure()
        with self._lock:
            self._closed = self._finished = True
            sent = dict(self._etags)
            pieces = [piece for index in sorted(self._partial) for piece in self._partial[index]]
            self._partial.clear()
            self._filled.clear()
        return Handover(self.block, sent, pieces)

    def take_over(self, handovers: Iterable[Any]) -> None:
        """Take the other ranks' :meth:`hand_over`: their parts as sent, their pieces written
        here (a block they complete goes up now); a part sent twice, or another part size
        (tunables that differ between ranks), is refused."""
        for handover in handovers:
            if handover.block != self.block:
                raise DestinationError(
                    f"{self._destination.describe(self.name)}: another rank cut it in parts "
                    f"of {handover.block} bytes, this one in {self.block}: the ranks' "
                    "UPLOAD_PART_BYTES differ"
                )
            with self._lock:
                twice = sorted(set(handover.sent) & (set(self._etags) | set(self._partial)))
                if twice:
                    start = self._span(twice[0])[0]
                    raise DestinationError(
                        f"{self._destination.describe(self.name)}: bytes at {start} written twice"
                    )
                self._etags.update(handover.sent)
            for position, data in handover.pieces:
                self.write_at(position, data)

    def complete(self) -> None:
        """Upload what no write completed (bytes never written are zeros, as in a pre-sized
        file) and complete the upload: the object appears, whole."""
        with self._lock:
            blocks = max(1, -(-self.size // self.block))
            pending = [i for i in range(blocks) if i not in self._etags]
            pieces = {i: self._partial.pop(i, []) for i in pending}
            self._filled.clear()
            for index in pending:
                self._etags[index] = None
        for index in pending:
            self._upload(index, _joined(pieces[index], *self._span(index)))
        self._stop_sending(cancel=False)
        self._raise_failure()
        parts = [{"PartNumber": i + 1, "ETag": self._etags[i]} for i in range(blocks)]
        self._call("complete_multipart_upload", MultipartUpload={"Parts": parts})
        self._finished = True

    def abort(self) -> None:
        """Take every part back (best effort; again: nothing happens). A joined upload stops
        sending; aborting it is the rank's that created it."""
        if self._finished:
            return
        self._finished = True
        self._stop_sending(cancel=True)
        if not self._owned:
            return
        with contextlib.suppress(Exception):  # the store's own lifecycle rules end what is left
            self._call("abort_multipart_upload")


@dataclass(frozen=True)
class Handover:
    """What a rank that joined an upload leaves for the rank completing it
    (:meth:`RangedUpload.hand_over`): its part size, the parts it sent (block index → ETag)
    and the pieces (offset, bytes) of the blocks it wrote in part."""

    block: int
    sent: dict[int, str | None]
    pieces: list[tuple[int, bytes]]


def _joined(pieces: list[tuple[int, bytes]], start: int, stop: int) -> bytes:
    """The bytes ``start``-``stop`` of a file from its ``pieces`` (offset, bytes), zeros where
    none was written (as in a pre-sized file)."""
    pieces = sorted(pieces)
    ends = [start, *(position + len(data) for position, data in pieces)]
    if ends[-1] == stop and all(p == e for (p, _), e in zip(pieces, ends, strict=False)):
        return b"".join(data for _, data in pieces)  # contiguous: one copy
    block = bytearray(stop - start)
    for position, data in pieces:
        block[position - start : position - start + len(data)] = data
    return bytes(block)


def record_uploads(staging: str, uploads: Iterable[RangedUpload], destination_id: str) -> None:
    """List ``uploads`` in the staging folder ``staging`` (ours, mode 0700), replacing the
    last list, so a run that finds the folder's owner gone aborts them."""
    record = {"destination": destination_id, "uploads": [u.record for u in uploads]}
    temporary = os.path.join(staging, UPLOADS_FILE + ".new")
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(record, handle)
    os.replace(temporary, os.path.join(staging, UPLOADS_FILE))


def abort_recorded(record: Any, destination: Storage, destination_id: str) -> None:
    """Abort the uploads a killed run listed (:func:`record_uploads`) when they went to
    ``destination``; best effort."""
    if not isinstance(record, dict) or record.get("destination") != destination_id:
        return
    if not supported(destination):
        return
    for upload in record.get("uploads") or []:
        if not isinstance(upload, dict):
            continue
        try:
            destination.fs.call_s3(
                "abort_multipart_upload",
                Bucket=str(upload["Bucket"]),
                Key=str(upload["Key"]),
                UploadId=str(upload["upload_id"]),
            )
        except Exception:  # noqa: BLE001, S112 - gone already, or the store ends it later
            continue
