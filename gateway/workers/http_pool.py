"""`WorkerHttpPool`: the gateway's HTTP/1.1 client for a worker's streaming calls, with kept-alive connections.

Why not httpx here: its connection pool scans every connection, polling each idle socket, whenever a
request starts or ends, so its cost per request grows with the number of pooled connections (one per
concurrent stream); under load that was most of the gateway's CPU. The worker protocol needs little:

    request    POST/GET with a JSON body and content-length, written at once.
    response   a status line and headers, then a chunked or content-length body (or one ending at close).
    pool       LIFO list of idle connections to one worker. A connection is reused only when its response
               was read to the end and neither side asked to close; one idle longer than `idle_expiry_s`
               (below uvicorn's 5 s keep-alive) is closed instead. A request that fails on a reused
               connection before any byte of the answer arrived (the worker closed it meanwhile) is sent
               once more on a new connection; nothing ran for it.

Errors: `WorkerConnectError` when no connection could be made (nothing ran); `WorkerProtocolError` for a
malformed answer; OSError / asyncio.IncompleteReadError for a connection that broke mid-answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024


class WorkerConnectError(ConnectionError):
    """No connection to the worker could be made."""


class WorkerProtocolError(ValueError):
    """The worker's answer is not the HTTP/1.1 this client reads."""


@dataclass(frozen=True)
class PoolConfig:
    connect_timeout_s: float = 5.0
    idle_expiry_s: float = 4.0  # less than the worker's keep-alive timeout (uvicorn: 5 s)
    max_idle: int = 256

    def __post_init__(self) -> None:
        if self.connect_timeout_s <= 0 or self.idle_expiry_s <= 0 or self.max_idle < 0:
            raise ValueError(f"invalid worker pool config {self}")


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = time.monotonic()

    def usable(self, now: float, idle_expiry_s: float) -> bool:
        return (not self.writer.is_closing() and not self.reader.at_eof()
                and now - self.idle_since < idle_expiry_s)

    def close(self) -> None:
        self.writer.close()


class WorkerResponse:
    """One answer: `status`, lower-cased `headers`; read the body with `lines()` or `read()`, then `close()`."""

    def __init__(self, pool: WorkerHttpPool, conn: _Connection, status: int, headers: dict[str, str]) -> None:
        self._pool = pool
        self._conn: _Connection | None = conn
        self.status = status
        self.headers = headers
        self._keep_alive = headers.get("connection", "").lower() != "close"
        self._done = False

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive. Reading it to the end returns the connection to the pool."""
        conn = self._conn
        assert conn is not None, "the response was closed"
        reader = conn.reader
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line = await reader.readuntil(b"\r\n")
                try:
                    size = int(size_line.split(b";", 1)[0], 16)
                except ValueError:
                    raise WorkerProtocolError(f"bad chunk size line {size_line[:40]!r}") from None
                if size == 0:
                    while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                        pass
                    break
                data = await reader.readexactly(size + 2)
                yield data[:-2]
        elif "content-length" in self.headers:
            remaining = int(self.headers["content-length"])
            while remaining > 0:
                data = await reader.read(min(remaining, 65536))
                if not data:
                    raise asyncio.IncompleteReadError(b"", remaining)
                remaining -= len(data)
                yield data
        else:  # delimited by the worker closing the connection
            self._keep_alive = False
            while data := await reader.read(65536):
                yield data
        self._done = True
        self.close()

    async def lines(self) -> AsyncIterator[str]:
        """The body split at newlines (without them), decoded as UTF-8; a last unterminated line too."""
        pending = b""
        async for data in self.chunks():
            pending += data
            *complete, pending = pending.split(b"\n")
            for line in complete:
                yield line.decode("utf-8")
        if pending:
            yield pending.decode("utf-8")

    async def read(self) -> bytes:
        return b"".join([data async for data in self.chunks()])

    def close(self) -> None:
        """Give the connection back (when the body was read to the end and may be kept) or close it."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool._put_back(conn, reusable=self._done and self._keep_alive)


class WorkerHttpPool:
    """Connections to one worker base URL (http://, or https:// with the system's CA certificates)."""

    def __init__(self, base_url: str, default_headers: dict[str, str] | None = None,
                 config: PoolConfig | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the worker pool needs an http(s)://host:port URL, got {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self._tls = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        self.config = config or PoolConfig()
        netloc = parts.netloc.rsplit("@", 1)[-1]
        self._fixed_head = "".join(f"{k}: {v}\r\n" for k, v in {"host": netloc, **(default_headers or {})}.items())
        self._idle: list[_Connection] = []
        self._idle_loop: asyncio.AbstractEventLoop | None = None  # the loop the idle connections belong to
        self._closed = False

    async def request(self, method: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None) -> WorkerResponse:
        """Send one request; the answer's head has arrived when this returns (the caller reads the body)."""
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head = (f"{method} {self.prefix}{path} HTTP/1.1\r\n{self._fixed_head}{extra}"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode("latin-1")
        conn = self._take_idle()
        if conn is not None:
            try:
                return await self._exchange(conn, head + body)
            except (OSError, asyncio.IncompleteReadError) as e:
                if getattr(e, "partial", b""):
                    raise
                # NOTE: nothing of an answer came back: the worker had closed this idle connection; retry once.
        return await self._exchange(await self._connect(), head + body)

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _take_idle(self) -> _Connection | None:
        loop = asyncio.get_running_loop()
        if loop is not self._idle_loop:  # connections of another (maybe closed) loop cannot be used here
            for conn in self._idle:
                with contextlib.suppress(RuntimeError):  # that loop is closed
                    conn.close()
            self._idle, self._idle_loop = [], loop
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if conn.usable(now, self.config.idle_expiry_s):
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Connection:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port, ssl=self._tls),
                                                    self.config.connect_timeout_s)
        except (OSError, TimeoutError) as e:
            raise WorkerConnectError(f"cannot connect to {self.host}:{self.port} ({type(e).__name__})") from None
        return _Connection(reader, writer)

    async def _exchange(self, conn: _Connection, raw_request: bytes) -> WorkerResponse:
        try:
            conn.writer.write(raw_request)
            await conn.writer.drain()
            try:
                head = await conn.reader.readuntil(b"\r\n\r\n")
            except asyncio.LimitOverrunError:
                raise WorkerProtocolError("the worker's response head is too large") from None
            status, headers = _parse_head(head)
        except BaseException:
            conn.close()
            raise
        return WorkerResponse(self, conn, status, headers)

    def _put_back(self, conn: _Connection, reusable: bool) -> None:
        if reusable and not self._closed and len(self._idle) < self.config.max_idle:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    status_line, *header_lines = head[:-4].decode("latin-1").split("\r\n")
    version, _, rest = status_line.partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise WorkerProtocolError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
    headers: dict[str, str] = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if not sep:
            raise WorkerProtocolError(f"malformed header line {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    return int(code), headers
