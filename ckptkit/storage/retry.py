"""The one retry loop around store calls, and how store errors become ckptkit's: transient ones
(5xx, throttling, dropped connections) retried with backoff, 404 / 403 / 416 typed."""

from __future__ import annotations

import errno
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import tunables
from ..errors import AccessDeniedError, CheckpointError, MissingFileError, StorageError

__all__ = ["RETRY_ATTEMPTS", "RangeNotSatisfiable", "call_with_retries", "error_summary"]

#: Attempts per remote operation, and the first backoff (doubled after each failure, jittered).
RETRY_ATTEMPTS = 5


class RangeNotSatisfiable(Exception):
    """A ranged request starting at or past the end of the file (HTTP 416)."""


def call_with_retries(
    call: Callable[[], Any],
    *,
    remote: bool,
    lock: threading.Lock | None,
    where: Callable[[], str],
) -> Any:
    """``call()`` on the store (under ``lock`` if any), retried with exponential backoff while it
    fails transiently (remote stores only: :data:`RETRY_ATTEMPTS` attempts, local: one); store
    errors come out as ckptkit errors naming ``where()`` (the file's URL)."""
    attempts = RETRY_ATTEMPTS if remote else 1
    delay = tunables.RETRY_BACKOFF_S
    for attempt in range(1, attempts + 1):
        try:
            if lock is None:
                return call()
            with lock:
                return call()
        except Exception as exc:
            kind = _classify(exc)
            if kind == "transient" and attempt < attempts:
                time.sleep(delay * (0.5 + random.random()))
                delay *= 2
                continue
            error = _translate(exc, kind, where(), attempt)
            if error is exc:
                raise
            raise error from exc
    raise AssertionError("unreachable")


def _translate(exc: Exception, kind: str, where: str, attempts: int) -> Exception:
    """The ckptkit error for ``exc`` (of kind ``kind``, see :func:`_classify`) raised by a call
    on the file ``where`` after ``attempts`` attempts; ``exc`` itself when it is not a store's."""
    if kind == "ours":
        return exc
    if kind == "missing":
        return MissingFileError(f"{where}: no such file")
    if kind == "denied":
        return AccessDeniedError(
            f"{where}: access denied ({error_summary(exc)}); check credentials / storage_options"
        )
    if kind == "range":
        return RangeNotSatisfiable(where)
    if kind == "transient":
        return StorageError(
            f"{where}: still failing after {attempts} attempts: {type(exc).__name__}: "
            f"{error_summary(exc)}"
        )
    if isinstance(exc, OSError) or _http_status(exc) is not None:
        return StorageError(f"{where}: {type(exc).__name__}: {error_summary(exc)}")
    return exc


#: errno values of failures worth retrying (s3fs maps 503 / SlowDown to EBUSY, 500 to EREMOTEIO).
_TRANSIENT_ERRNOS = {
    errno.EBUSY,
    errno.EAGAIN,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EPIPE,
    getattr(errno, "EREMOTEIO", errno.EIO),
}
#: Exception classes (by name, so no client library needs importing) of dropped connections.
_TRANSIENT_NAMES = {
    "ClientPayloadError",
    "ClientConnectionError",
    "ServerDisconnectedError",
    "ServerTimeoutError",
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "IncompleteRead",
    "ResponseStreamingError",
    "ProtocolError",
}
_THROTTLING = ("SlowDown", "Throttl", "reduce your request rate", "TooManyRequests")


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status behind ``exc`` or its causes (aiohttp, botocore, gcsfs…), if any."""
    seen = 0
    while exc is not None and seen < 5:
        for attr in ("status", "status_code", "code"):
            value = getattr(exc, attr, None)
            if isinstance(value, int) and 100 <= value < 600:
                return value
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            value = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(value, int):
                return value
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _classify(exc: BaseException) -> str:
    """``ours`` / ``missing`` / ``denied`` / ``range`` / ``transient`` / ``other``."""
    if isinstance(exc, CheckpointError):
        return "ours"
    status = _http_status(exc)
    if status in (401, 403) or isinstance(exc, PermissionError):
        return "denied"
    if status in (404, 410) or isinstance(exc, FileNotFoundError):
        return "missing"
    if status == 416 or "InvalidRange" in str(exc):
        return "range"
    if status is not None and (status >= 500 or status in (408, 429)):
        return "transient"
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return "transient"
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return "transient"
    if any(cls.__name__ in _TRANSIENT_NAMES for cls in type(exc).__mro__):
        return "transient"
    if any(word in str(exc) for word in _THROTTLING):
        return "transient"
    return "other"


def error_summary(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its class name if empty), at most 300 characters."""
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]
