"""The knobs: sizes and budgets ckptkit's layers read at call time. Set one on this module (e.g.
``ckptkit.tunables.SMALL_FILE_LIMIT = 256 << 20``) to change it for the whole process; every
module reads it from here when it runs, so there is one place to look and one name to patch."""

__all__ = [
    "BATCH_BYTES",
    "BLOCK_ELEMENTS",
    "MAX_REQUEST",
    "RETRY_BACKOFF_S",
    "ROW_BLOCK_BYTES",
    "SEQUENTIAL_PIECE",
    "SMALL_FILE_LIMIT",
    "SPLIT_FILE_BYTES",
    "UPLOAD_PARTS_IN_FLIGHT",
    "UPLOAD_PART_BYTES",
    "WORK_LIMIT",
]

#: Bound of ``Storage.read_file`` (index, config and metadata files), checked against the file's
#: real size before anything is read; raise it (or pass ``max_bytes=``) for larger ones.
SMALL_FILE_LIMIT = 64 << 20
#: Upper bound of one remote request (coalesced ranges, or a piece of a larger range), so the
#: memory a request holds stays bounded; larger ranges are fetched in pieces, in parallel.
MAX_REQUEST = 16 << 20
#: Piece size when streaming a whole remote file front to back (``Storage.open_sequential``);
#: the next piece is fetched while the current one is consumed.
SEQUENTIAL_PIECE = 8 << 20
#: The first backoff of a retried remote operation in seconds (doubled after each failure,
#: jittered).
RETRY_BACKOFF_S = 0.25
#: Signed boxes the exact coverage check of one tensor may handle, summed over its recursion
#: levels. A row-sharded tensor of n chunks costs about n, a 2-D block grid about 2n, any 2-D
#: layout at most 3n; 2**22 is about three seconds of pure Python.
WORK_LIMIT = 1 << 22
#: Records fetched together for one tensor, at most (bytes); bounds memory while assembling.
BATCH_BYTES = 64 << 20
#: Rows of a tensor whose chunks do not tile its first dimension (column or block shards) are
#: assembled this many bytes at a time and streamed.
ROW_BLOCK_BYTES = 4 << 20
#: With ``workers`` > 1, an output file (torch.save, a safetensors shard) holding more than a
#: worker's share of the bytes, and at least this many, is written by several workers at once,
#: each its own byte ranges; smaller ones stay one worker's.
SPLIT_FILE_BYTES = 64 << 20
#: Such a file going to an object store (S3) is uploaded in parts of this size as its bytes are
#: written, never staged on local disk (larger for files past 10,000 parts, the protocol's bound).
UPLOAD_PART_BYTES = 16 << 20
#: Parts of one output's uploads travelling at once, their bytes held meanwhile (memory: about
#: this many parts, twice): more overlaps more of the network's latency.
UPLOAD_PARTS_IN_FLIGHT = 4
#: Elements handled at once by diff, stats, plots and the browser; float64 working arrays then
#: stay at a few × 8 MB.
BLOCK_ELEMENTS = 1 << 20
