"""A lean HTTP/1.1 client for `pipeline bench`: one request per connection, the
response parsed by httptools (uvicorn's parser) inside an asyncio Protocol, and
each server-sent event's data handed to a callback as its bytes arrive, with no
task switch per event. A load generator shares the machine with the server it
measures: against `pipeline serve` at concurrency 64 on 2 cores, aiohttp's
stream reader took 31-37 us of CPU per event and this 19-24, and the server
finished the same work 1.035x as fast beside it (median of 6 paired runs,
0.97-1.06x)."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools

MAX_ERROR_BODY = 200  # characters of a non-200 body that an HttpError keeps


class HttpError(Exception):
    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body.decode(errors='replace')[:MAX_ERROR_BODY]}")
        self.status, self.body = status, body


def sse_data(event: bytes) -> bytes:
    """The data of one server-sent event (its data: lines joined), b"" if none."""
    lines = [line.removeprefix(b"data:").strip() for line in event.splitlines()
             if line.startswith(b"data:")]
    return b"\n".join(lines)


class _Response(asyncio.Protocol):
    """Writes `request`, then parses the response. With `on_event`, a 200
    response's body is read as server-sent events: on_event(data) for each, and
    a True from it ends the exchange. Any other body is kept whole."""

    def __init__(self, request: bytes, on_event: Callable[[bytes], bool] | None,
                 done: asyncio.Future):
        self.request, self.on_event, self.done = request, on_event, done
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.status = 0
        self.body: list[bytes] = []
        self.pending = b""  # an event's bytes so far

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception as error:  # a parse error, or on_event's own
            self._finish(error)

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.on_event is None or self.status != 200:
            self.body.append(body)
            return
        *events, self.pending = (self.pending + body.replace(b"\r\n", b"\n")).split(b"\n\n")
        for data in filter(None, map(sse_data, events)):
            if self.on_event(data):
                self._finish(None)
                return

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        self._finish(None if self.status == 200 else HttpError(self.status, body), body)

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(ConnectionError(f"the connection closed mid-response ({exc})"))

    def _finish(self, error: Exception | None, body: bytes = b"") -> None:
        if self.done.done():
            return
        if error is None:
            self.done.set_result(body)
        else:
            self.done.set_exception(error)
        if self.transport is not None:
            self.transport.close()


async def request(method: str, url: str, *, body: bytes = b"",
                  headers: dict[str, str] | None = None,
                  on_event: Callable[[bytes], bool] | None = None,
                  timeout_s: float | None = None) -> bytes:
    """One exchange; returns a 200 response's body (b"" when streamed to
    `on_event`). Raises HttpError for any other status, ConnectionError or
    OSError when the connection fails, TimeoutError after `timeout_s`."""
    parts = urlsplit(url)
    secure = parts.scheme == "https"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if secure else 80)
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    lines = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close",
             f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    message = ("\r\n".join(lines) + "\r\n\r\n").encode() + body
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    context = ssl.create_default_context() if secure else None
    async with asyncio.timeout(timeout_s):
        transport, _ = await loop.create_connection(
            lambda: _Response(message, on_event, done), parts.hostname, port, ssl=context)
        try:
            return await done
        finally:
            transport.close()
