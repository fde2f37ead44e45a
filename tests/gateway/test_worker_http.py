"""WorkerHttpPool against a real loopback HTTP/1.1 server: framing, keep-alive reuse, stale connections."""

from __future__ import annotations

import asyncio

import pytest

from gateway.workers.http_pool import PoolConfig, WorkerConnectError, WorkerHttpPool, WorkerProtocolError
from tests.conftest import free_port


class LineServer:
    """Answers each request with its body's lines echoed as NDJSON-ish lines; `mode` picks the framing.

    chunked: one chunk per line; length: content-length; once: chunked, then closes the connection (as a
    worker does with an idle keep-alive connection); garbage: not HTTP."""

    def __init__(self, mode: str = "chunked") -> None:
        self.mode = mode
        self.connections = 0
        self.requests = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                body = await reader.readexactly(length)
                self.requests += 1
                lines = [line + b"\n" for line in body.split(b" ")]
                if self.mode == "garbage":
                    writer.write(b"SMTP ready\r\n\r\n")
                elif self.mode == "length":
                    payload = b"".join(lines)
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(payload) + payload)
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                    for line in lines:
                        writer.write(b"%x\r\n%s\r\n" % (len(line), line))
                        await writer.drain()
                    writer.write(b"0\r\n\r\n")
                await writer.drain()
                if self.mode == "once":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def run(scenario):
    return asyncio.run(scenario())


async def _lines(pool: WorkerHttpPool, body: bytes) -> list[str]:
    resp = await pool.request("POST", "/generate", body)
    try:
        assert resp.status == 200
        return [line async for line in resp.lines()]
    finally:
        resp.close()


@pytest.mark.parametrize("mode", ["chunked", "length"])
def test_bodies_read_to_the_end_reuse_one_connection(mode):
    async def scenario() -> None:
        server = LineServer(mode)
        pool = WorkerHttpPool(await server.start(), {"x-secret": "s"})
        for i in range(5):
            assert await _lines(pool, f"a{i} b c".encode()) == [f"a{i}", "b", "c"]
        assert (server.requests, server.connections) == (5, 1)
        await pool.aclose()
        await server.stop()

    run(scenario)


def test_a_response_left_early_closes_its_connection():
    async def scenario() -> None:
        server = LineServer()
        pool = WorkerHttpPool(await server.start())
        resp = await pool.request("POST", "/generate", b"x y z")
        lines = resp.lines()
        assert await anext(lines) == "x"
        await lines.aclose()
        resp.close()  # not read to the end: the worker must see the connection go (that is its abort)
        assert await _lines(pool, b"next") == ["next"]
        assert server.connections == 2
        await pool.aclose()
        await server.stop()

    run(scenario)


def test_an_idle_connection_the_worker_closed_is_replaced_transparently():
    async def scenario() -> None:
        server = LineServer("once")
        pool = WorkerHttpPool(await server.start())
        for i in range(3):
            assert await _lines(pool, f"r{i}".encode()) == [f"r{i}"]
        assert (server.requests, server.connections) == (3, 3)
        await pool.aclose()
        await server.stop()

    run(scenario)


def test_connection_refused_and_non_http_answers_are_typed_errors():
    async def scenario() -> None:
        pool = WorkerHttpPool(f"http://127.0.0.1:{free_port()}", config=PoolConfig(connect_timeout_s=1.0))
        with pytest.raises(WorkerConnectError, match="cannot connect"):
            await pool.request("POST", "/generate", b"{}")
        server = LineServer("garbage")
        bad = WorkerHttpPool(await server.start())
        with pytest.raises(WorkerProtocolError, match="status line"):
            await bad.request("POST", "/generate", b"{}")
        await server.stop()
        with pytest.raises(ValueError, match="http"):
            WorkerHttpPool("ftp://worker:21")

    run(scenario)
