"""A real S3-protocol server on loopback for the tests: moto's ``ThreadedMotoServer`` whose WSGI
app is wrapped in :class:`Traffic`, which logs every request (method, key, ``Range`` header,
status, response body bytes) and can fail chosen requests on purpose (503 SlowDown, 403…).
Run as a script it serves in a process of its own (``benchmarks/bench_remote.py``), its log
readable at :data:`CONTROL`.

:func:`shared` starts one server per test session and exports ``AWS_ENDPOINT_URL`` plus dummy
credentials, so ``s3://`` URLs in tests, and notebook kernels started afterwards, reach it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass

#: Path answering the request log as JSON (GET) or clearing it (DELETE); not an S3 path.
CONTROL = "/__traffic__"
ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class Request:
    """One request the server answered."""

    seq: int
    method: str
    path: str  # "/bucket/key"
    range: str | None
    status: int = 0
    nbytes: int = 0  # response body bytes sent
    injected: bool = False
    query: str = ""  # "partNumber=2&uploadId=…" for a part of a multipart upload


@dataclass
class Failure:
    """Answer matching requests with ``status``/``code`` instead of serving them, ``times`` times."""

    match: Callable[[str, str], bool]  # (method, path) -> bool
    status: int
    code: str
    times: int


_REASONS = {403: "Forbidden", 500: "Internal Server Error", 503: "Service Unavailable"}


class Traffic:
    """WSGI middleware around moto's app: the request log and failure injection."""

    def __init__(self, app) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.requests: list[Request] = []
        self.failures: list[Failure] = []

    # -- what tests use --------------------------------------------------------------------

    def reset(self) -> None:
        with self.lock:
            self.requests = []
            self.failures = []

    def fail(
        self,
        match: Callable[[str, str], bool],
        *,
        status: int = 503,
        code: str = "SlowDown",
        times: int = 1,
    ) -> None:
        """Fail the next ``times`` requests for which ``match(method, path)`` is true."""
        with self.lock:
            self.failures.append(Failure(match, status, code, times))

    def gets(self, prefix: str = "/") -> list[Request]:
        """GET requests served (not injected failures) for keys under ``prefix``."""
        return [
            r
            for r in self.snapshot()
            if r.method == "GET" and r.path.startswith(prefix) and not r.injected
        ]

    def body_bytes(self, prefix: str = "/", method: str = "GET") -> int:
        """Response body bytes of ``method`` requests under ``prefix``."""
        return sum(
            r.nbytes for r in self.snapshot() if r.method == method and r.path.startswith(prefix)
        )

    def snapshot(self) -> list[Request]:
        with self.lock:
            return list(self.requests)

    # -- WSGI ------------------------------------------------------------------------------

    def __call__(self, environ, start_response) -> Iterable[bytes]:
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        if path == CONTROL:  # the log over HTTP, for a server in another process
            if method == "DELETE":
                self.reset()
            body = json.dumps([asdict(r) for r in self.snapshot()]).encode()
            start_response("200 OK", [("Content-Type", "application/json")])
            return [body]
        with self.lock:
            request = Request(len(self.requests), method, path, environ.get("HTTP_RANGE"))
            request.query = environ.get("QUERY_STRING", "")
            self.requests.append(request)
            failure = next(
                (f for f in self.failures if f.times > 0 and f.match(method, path)), None
            )
            if failure is not None:
                failure.times -= 1
        if failure is not None:
            body = (
                f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{failure.code}</Code>'
                f"<Message>injected by the test server</Message><RequestId>test</RequestId></Error>"
            ).encode()
            if method == "HEAD":
                body = b""
            start_response(
                f"{failure.status} {_REASONS.get(failure.status, 'Error')}",
                [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))],
            )
            request.status, request.nbytes, request.injected = failure.status, len(body), True
            return [body]

        def recording_start_response(status, headers, exc_info=None):
            request.status = int(status.split()[0])
            return start_response(status, headers, exc_info)

        return _Counted(self.app(environ, recording_start_response), request)


class _Counted:
    """The app's response body, counted as it is sent."""

    def __init__(self, body: Iterable[bytes], request: Request) -> None:
        self.body, self.request = body, request

    def __iter__(self) -> Iterator[bytes]:
        for piece in self.body:
            self.request.nbytes += len(piece)
            yield piece

    def close(self) -> None:
        close = getattr(self.body, "close", None)
        if close is not None:
            close()


class Server:
    """moto's threaded S3 server on 127.0.0.1 (a free port), with :class:`Traffic` in front."""

    def __init__(self) -> None:
        os.environ.update(ENV)  # before moto/boto3 read them
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        wsgi = self.server._server  # werkzeug's server: its handler calls ``self.app``
        self.traffic = Traffic(wsgi.app)
        wsgi.app = self.traffic
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"

    def stop(self) -> None:
        self.server.stop()


_SHARED: Server | None = None
_SAVED_ENV: dict[str, str | None] = {}


def shared() -> Server:
    """The session's server, started on first use; exports its endpoint and credentials."""
    global _SHARED
    if _SHARED is None:
        names = [*ENV, "AWS_ENDPOINT_URL"]
        _SAVED_ENV.update({name: os.environ.get(name) for name in names})
        _SHARED = Server()
        os.environ["AWS_ENDPOINT_URL"] = _SHARED.endpoint
    return _SHARED


def stop_shared() -> None:
    """Stop the session's server (if started) and restore the environment."""
    global _SHARED
    if _SHARED is None:
        return
    _SHARED.stop()
    _SHARED = None
    for name, value in _SAVED_ENV.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def main() -> None:
    """``python tests/s3server.py``: serve until stdin closes; prints the endpoint first."""
    import sys

    server = Server()
    print(server.endpoint, flush=True)
    try:
        sys.stdin.read()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
