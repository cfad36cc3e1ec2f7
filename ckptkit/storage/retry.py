"""The one retry loop around store calls, and how store errors become ckptkit's: transient ones
(5xx, throttling, dropped connections) retried with backoff, 404 / 403 / 416 typed, and a store
that cannot be reached (unknown host, refused connection) or used (no credentials) named with
the fix."""

from __future__ import annotations

import errno
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .. import tunables
from ..errors import (
    AccessDeniedError,
    CheckpointError,
    MissingCredentialsError,
    MissingFileError,
    StorageError,
    UnreachableStoreError,
)

__all__ = [
    "RETRY_ATTEMPTS",
    "MissingCredentialsError",
    "RangeNotSatisfiable",
    "UnreachableStoreError",
    "call_with_retries",
    "error_summary",
]

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
            if kind in _RETRIED and attempt < attempts:
                time.sleep(delay * (0.5 + random.random()))
                delay *= 2
                continue
            error = _translate(exc, kind, where(), attempt, remote=remote)
            if error is exc:
                raise
            raise error from exc
    raise AssertionError("unreachable")


def _translate(
    exc: Exception, kind: str, where: str, attempts: int, *, remote: bool = True
) -> Exception:
    """The ckptkit error for ``exc`` (of kind ``kind``, see :func:`_classify`) raised by a call
    on the file ``where`` (``remote``: of a remote store) after ``attempts`` attempts; ``exc``
    itself when it is not a store's."""
    if kind == "ours":
        return exc
    if kind == "credentials":
        cause = _first(exc, _is_credentials) or exc
        return MissingCredentialsError(
            f"{where}: no usable credentials ({_described(cause)}); {_credentials_hint(where)}"
        )
    timed_out = remote and kind == "transient" and _first(exc, _is_timeout) is not None
    if kind in ("unknown host", "unreachable") or timed_out:
        cause = _first(exc, _is_connection_failure) or _first(exc, _is_timeout) or exc
        tried = f" after {attempts} attempts" if attempts > 1 else ""
        return UnreachableStoreError(
            f"{where}: cannot reach the store ({_connection_reason(exc)}){tried}: "
            f"{_described(cause)}; {_location_hint(where)}"
        )
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


#: Kinds of failure worth another attempt.
_RETRIED = frozenset({"transient", "unreachable"})

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
#: Failures to connect at all (aiohttp, botocore, urllib3, by class name): nothing answered.
_CONNECT_NAMES = {
    "ClientConnectorError",
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ConnectionTimeoutError",
    "NewConnectionError",
    "NameResolutionError",
}
#: Certificate and TLS failures are answers of a kind (the host is there): not "unreachable".
_TLS_NAMES = {"ClientConnectorSSLError", "ClientConnectorCertificateError", "SSLError"}
#: Credentials the client could not find or load (botocore, google-auth, azure-identity).
_CREDENTIAL_NAMES = {
    "NoCredentialsError",
    "PartialCredentialsError",
    "CredentialRetrievalError",
    "ProfileNotFound",
    "NoAuthTokenError",
    "DefaultCredentialsError",
    "CredentialUnavailableError",
}
#: ``getaddrinfo`` answers meaning the name does not exist (not a passing DNS failure).
_UNKNOWN_HOST = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling (at most 5)."""
    for _ in range(5):
        if exc is None:
            return
        yield exc
        exc = exc.__cause__ or exc.__context__


def _first(exc: BaseException, test: Callable[[BaseException], bool]) -> BaseException | None:
    """The first exception in ``exc``'s chain that passes ``test``."""
    return next((e for e in _chain(exc) if test(e)), None)


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def _is_credentials(exc: BaseException) -> bool:
    return bool(_names(exc) & _CREDENTIAL_NAMES)


def _is_connection_failure(exc: BaseException) -> bool:
    if _names(exc) & _TLS_NAMES:
        return False
    return isinstance(exc, (socket.gaierror, ConnectionRefusedError)) or bool(
        _names(exc) & _CONNECT_NAMES
    )


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError) or any("Timeout" in name for name in _names(exc))


def _connection_reason(exc: BaseException) -> str:
    """Why nothing answered, in a few words: unknown host, refused, timed out."""
    dns = _first(exc, lambda e: isinstance(e, socket.gaierror))
    if dns is not None:
        return "unknown host" if dns.errno in _UNKNOWN_HOST else "host name lookup failed"
    if _first(exc, lambda e: isinstance(e, ConnectionRefusedError)) is not None:
        return "connection refused"
    if _first(exc, _is_timeout) is not None:
        return "no answer in time"
    return "cannot connect"


def _protocol(where: str) -> str:
    head, sep, _ = where.partition("://")
    return head.lower() if sep else ""


def _location_hint(where: str) -> str:
    """What to check when the store behind ``where`` cannot be reached."""
    protocol = _protocol(where)
    if protocol in ("s3", "s3a"):
        return (
            "check the bucket name and the network; an S3-compatible store needs its endpoint: "
            "--storage-option endpoint_url=http://HOST:PORT (storage_options={'endpoint_url': "
            "...}, or AWS_ENDPOINT_URL)"
        )
    if protocol in ("http", "https"):
        return "check the URL's host and port, and the network (proxy, VPN)"
    return "check the URL and the network, and the store's address in --storage-option"


def _credentials_hint(where: str) -> str:
    """Where credentials for the store behind ``where`` come from, and how to do without."""
    protocol = _protocol(where)
    if protocol in ("s3", "s3a"):
        return (
            "for a public bucket pass --anon (storage_options={'anon': True}); otherwise set "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or name a profile of ~/.aws/credentials: "
            "--storage-option profile=NAME"
        )
    if protocol in ("gs", "gcs"):
        return (
            "for a public bucket pass --anon (storage_options={'token': 'anon'}); otherwise run "
            "`gcloud auth application-default login` or pass --storage-option token=KEY_FILE"
        )
    return "pass them as storage options (--storage-option KEY=VALUE), or --anon for public data"


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status behind ``exc`` or its causes (aiohttp, botocore, gcsfs…), if any."""
    for link in _chain(exc):
        for attr in ("status", "status_code", "code"):
            value = getattr(link, attr, None)
            if isinstance(value, int) and 100 <= value < 600:
                return value
        response = getattr(link, "response", None)
        if isinstance(response, dict):
            value = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(value, int):
                return value
    return None


def _classify(exc: BaseException) -> str:
    """``ours`` / ``credentials`` / ``missing`` / ``denied`` / ``range`` / ``transient`` (a
    timeout among them) / ``unknown host`` (not retried: the name does not exist) /
    ``unreachable`` (retried: a refused or timed-out connection) / ``other``."""
    if isinstance(exc, CheckpointError):
        return "ours"
    if _first(exc, _is_credentials) is not None:
        return "credentials"
    status = _http_status(exc)
    unanswered = _unanswered(exc) if status is None else None
    if unanswered is not None:
        return unanswered
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
    if _names(exc) & _TRANSIENT_NAMES:
        return "transient"
    if any(word in str(exc) for word in _THROTTLING):
        return "transient"
    return "other"


def _described(exc: BaseException) -> str:
    """``Type: first line of the message`` (the type alone when the message is empty)."""
    summary = error_summary(exc)
    return (
        type(exc).__name__ if summary == type(exc).__name__ else f"{type(exc).__name__}: {summary}"
    )


def _unanswered(exc: BaseException) -> str | None:
    """The kind of a failure no server answered: ``unknown host``, ``unreachable`` (no
    connection), ``transient`` (a timeout; also when a client reports it as a missing file, as
    fsspec's HTTP does); None for any other failure."""
    if _first(exc, _is_connection_failure) is not None:
        return "unknown host" if _connection_reason(exc) == "unknown host" else "unreachable"
    if _first(exc, _is_timeout) is not None:
        return "transient"
    return None


def error_summary(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its class name if empty), at most 300 characters."""
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]
