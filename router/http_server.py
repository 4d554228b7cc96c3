"""`HttpServer`: uvicorn serving an ASGI app (the OpenAI-compatible API, /metrics) on the
router's own event loop, over TLS when given one, with the door's limits (`HttpLimits`):

- a connection must complete its request headers within `header_timeout_s` of opening (or of
  its previous response's end); else it gets 408 and is closed (a client that sends a byte a
  minute holds nothing for long);
- an idle keep-alive connection is closed after `keep_alive_s`;
- at most `max_connections` connections are served at once; a request on one past that gets
  503 (OpenAI's error shape) and its connection is closed;
- the body limits (`max_body_bytes`, `body_timeout_s`) are the app's to apply, since only it
  reads the body (router.openai_http: 413 from Content-Length before a byte is read, 408).

Every answer the server itself gives (408, 503, 400 for a request that is not HTTP, 500 for
an exception an app let escape) has OpenAI's JSON error shape.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpLimits:
    """The HTTP door's limits (RouterSettings.http_*); `max_body_bytes` None: derived from the
    largest gRPC request (`HttpLimits.derived_body_bytes`)."""

    max_body_bytes: int | None = None
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    max_connections: int = 1024

    def __post_init__(self) -> None:
        if self.max_body_bytes is not None and self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024 (or None: derived), got {self.max_body_bytes}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not 0 < getattr(self, name) <= 3600:
                raise ValueError(f"{name} must be in (0, 3600], got {getattr(self, name)}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")

    @staticmethod
    def derived_body_bytes(request_bytes: int) -> int:
        """A body that can hold the largest request gRPC takes (`FrontendLimits.request_bytes`),
        written as JSON: every character escaped is at most 3x its UTF-8 bytes (an astral
        character: 4 bytes, or 12 as two \\uXXXX escapes), plus room for the other fields."""
        return 3 * request_bytes + (64 << 10)

    def body_bytes(self, request_bytes: int) -> int:
        return self.max_body_bytes if self.max_body_bytes is not None else self.derived_body_bytes(request_bytes)


def error_body(message: str, kind: str, code: str, param: str | None = None) -> bytes:
    """OpenAI's error shape, as bytes (ASCII: a lone surrogate a client sent is escaped)."""
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


_PHRASES = {400: "Bad Request", 408: "Request Timeout", 500: "Internal Server Error", 503: "Service Unavailable"}


def _raw_response(status: int, body: bytes) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for answers given outside any
    request cycle (headers never completed)."""
    return (f"HTTP/1.1 {status} {_PHRASES[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class _Guard:
    """ASGI: an exception an app lets escape becomes a 500 in OpenAI's shape (if no response
    started yet; else the connection is closed, as uvicorn does)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            log.exception("HTTP %s %s failed", scope.get("method"), scope.get("path"))
            if started:
                raise
            body = error_body(f"internal error: {type(exc).__name__}", "internal_error", "internal_error")
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})


def _over_capacity_app(max_connections: int):
    body = error_body(f"the server has {max_connections} connections open, its max_connections; retry later",
                      "service_unavailable", "too_many_connections")

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close"), (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": body})

    return app


def protocol_class(limits: HttpLimits):
    """uvicorn's h11 protocol with the header timeout and the connection limit."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    refuse = _over_capacity_app(limits.max_connections)
    timeout_body = _raw_response(408, error_body(
        f"the request headers did not arrive within header_timeout_s={limits.header_timeout_s:g} s",
        "invalid_request_error", "request_timeout"))

    class Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _lingering = False

        def connection_made(self, transport) -> None:
            super().connection_made(_LingeringTransport(transport, self))
            if len(self.connections) > limits.max_connections:
                self.app = refuse  # its request, once its headers are in, gets 503 and the connection closes
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            if self._lingering:  # the rest of a refused body: dropped
                return
            super().data_received(data)
            self._headers_done()

        def should_linger(self) -> bool:
            """Closing while the client still sends its body (a 413, a 408): the answer would be
            lost to the reset that unread data causes."""
            return self.conn.their_state is h11.SEND_BODY or (self.conn.their_state is h11.IDLE and
                                                               bool(self.conn.trailing_data[0]))

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()  # the next request's headers, from this response's end
                self._headers_done()      # unless a pipelined one was already in

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:  # not HTTP: OpenAI's shape all the same
            body = error_body(f"the request is not valid HTTP/1.1: {msg}", "invalid_request_error", "invalid_http")
            with contextlib.suppress(h11.LocalProtocolError):
                out = self.conn.send(h11.Response(status_code=400, reason=b"Bad Request", headers=[
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close")]))
                out += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
                self.transport.write(out)
            self.transport.close()

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._header_timeout)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_done(self) -> None:
            if self._header_timer is not None and self.conn.their_state is not h11.IDLE:
                self._disarm_header_timer()

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            self._unset_keepalive_if_required()
            if self.conn.trailing_data[0]:  # a request begun but not finished in time: say so
                self.transport.write(timeout_body)
            self.transport.close()

    return Protocol


LINGER_S = 2.0


class _LingeringTransport:
    """A transport whose close, while the client is still sending (a refused body), sends
    the answer and a FIN and then drops what still comes for up to LINGER_S before closing:
    closing at once with unread data resets the connection, and a client busy sending would
    lose the 413 it was sent. What comes meanwhile is discarded, never buffered."""

    def __init__(self, transport, protocol) -> None:
        self._t, self._p = transport, protocol

    def __getattr__(self, name):
        return getattr(self._t, name)

    def is_closing(self) -> bool:
        return self._p._lingering or self._t.is_closing()

    def close(self) -> None:
        if self._p._lingering or self._t.is_closing() or not self._p.should_linger() or not self._t.can_write_eof():
            return self._t.close()
        self._p._lingering = True
        try:
            self._t.write_eof()
            self._t.resume_reading()
        except (OSError, RuntimeError):
            return self._t.close()
        self._p.loop.call_later(LINGER_S, self._t.close)


class HttpServer:
    """uvicorn serving an ASGI app on the running event loop (the router's), on host:port
    (0: a free port), over TLS with a `router.security.Tls`, within `limits`."""

    def __init__(self, app, host: str, port: int, tls=None, limits: HttpLimits | None = None) -> None:
        import uvicorn

        self.host, self.requested_port = host, port
        self.port: int | None = None
        self.scheme = "https" if tls is not None else "http"
        self.limits = limits or HttpLimits()
        config = uvicorn.Config(_Guard(app), host=host, port=port, log_level="warning", lifespan="off",
                                access_log=False, timeout_graceful_shutdown=5, http=protocol_class(self.limits),
                                timeout_keep_alive=self.limits.keep_alive_s,
                                **(tls.uvicorn_options() if tls is not None else {}))

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # the process's signals are serve's (a drain), not uvicorn's
                yield

        self._server = _Server(config)
        self._task: asyncio.Task | None = None

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self._server.server_state.connections)

    async def start(self) -> str:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say so, and without
        # it a response's body waits ~40 ms behind its headers (Nagle and the client's delayed ACK)
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.requested_port))
        except OSError as exc:
            sock.close()
            raise RuntimeError(f"could not bind the HTTP API to {self.host}:{self.requested_port}: {exc}") from exc
        self.port = sock.getsockname()[1]
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the HTTP API stopped while starting")
            await asyncio.sleep(0.01)
        return f"{self.scheme}://{self.host}:{self.port}"

    async def stop(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._task
            self._task = None
