"""`HttpServer`: uvicorn serving an ASGI app (the OpenAI-compatible API, /metrics) on the
router's own event loop, over TLS when given one."""
from __future__ import annotations

import asyncio
import contextlib
import socket

class HttpServer:
    """uvicorn serving an ASGI app on the running event loop (the router's), on host:port
    (0: a free port), over TLS with a `router.security.Tls`."""

    def __init__(self, app, host: str, port: int, tls=None) -> None:
        import uvicorn

        self.host, self.requested_port = host, port
        self.port: int | None = None
        self.scheme = "https" if tls is not None else "http"
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                access_log=False, timeout_graceful_shutdown=5,
                                **(tls.uvicorn_options() if tls is not None else {}))

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # the process's signals are serve's (a drain), not uvicorn's
                yield

        self._server = _Server(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> str:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
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
