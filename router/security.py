"""Locks on the router's client-facing doors: API keys on every gRPC RPC and HTTP route, and TLS
(optionally mutual) for gRPC, the OpenAI-compatible HTTP API and /metrics.

A client sends its key as `authorization: Bearer KEY` (gRPC metadata, or the HTTP header). A
call without a valid key gets UNAUTHENTICATED (HTTP 401) before anything else happens: its
request is not even parsed. Keys are compared in constant time. Only `grpc.health.v1` and
`/metrics` can be left open, each by its own setting (`open_health`, `open_metrics`).
"""
from __future__ import annotations

import hmac
import json
import ssl
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"
API_KEYS_ENV = "PDCLUSTER_API_KEYS"  # comma-separated, beside --api-key


def check_key(key: str) -> str:
    if not key or len(key) > 256 or not key.isascii() or not key.isprintable() or " " in key or "," in key:
        raise ValueError("an API key must be 1 to 256 printable ASCII characters without spaces or commas")
    return key


@dataclass(frozen=True)
class Access:
    """Who may call: anyone (no keys), or holders of one of `api_keys`."""

    api_keys: tuple[str, ...] = field(default=(), repr=False)
    open_health: bool = False
    open_metrics: bool = False

    def __post_init__(self) -> None:
        for k in self.api_keys:
            check_key(k)

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys)

    def allows(self, authorization: str | bytes | None) -> bool:
        """Whether an `authorization` value carries a valid key (always, with no keys set)."""
        if not self.api_keys:
            return True
        if isinstance(authorization, bytes):
            authorization = authorization.decode("latin-1")
        if not authorization or not authorization.startswith("Bearer "):
            return False
        given = authorization[len("Bearer "):].encode()
        ok = False
        for k in self.api_keys:  # every key compared, in constant time: no early exit to time
            ok |= hmac.compare_digest(given, k.encode())
        return ok

    def grpc_interceptor(self) -> grpc.aio.ServerInterceptor:
        return _KeyInterceptor(self)

    def asgi(self, app, open_paths: Iterable[str] = ()):
        """`app` behind the key check; `open_paths` are served without one."""
        return _KeyMiddleware(app, self, frozenset(open_paths))


MISSING_KEY = ("a valid API key is required: send 'authorization: Bearer KEY' (gRPC metadata) or the "
               "'Authorization: Bearer KEY' header (HTTP)")


class _KeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, access: Access) -> None:
        self.access = access

    async def intercept_service(self, continuation, details):
        if self.access.open_health and details.method.startswith(HEALTH_PREFIX):
            return await continuation(details)
        auth = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        if self.access.allows(auth):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:  # an unknown method: gRPC's own UNIMPLEMENTED
            return None
        return _deny(handler)


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind that answers UNAUTHENTICATED and never parses the request
    (no deserializer: it stays bytes)."""
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, MISSING_KEY)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, MISSING_KEY)
        yield  # an async generator, as a streaming handler must be

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming)
    return grpc.unary_unary_rpc_method_handler(unary)


class _KeyMiddleware:
    """ASGI: a request without a valid key gets 401 in OpenAI's error shape, before routing."""

    def __init__(self, app, access: Access, open_paths: frozenset[str]) -> None:
        self.app, self.access, self.open_paths = app, access, open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.open_paths:
            return await self.app(scope, receive, send)
        auth = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        if self.access.allows(auth):
            return await self.app(scope, receive, send)
        body = json.dumps({"error": {"message": MISSING_KEY, "type": "authentication_error", "param": None,
                                     "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


@dataclass(frozen=True)
class Tls:
    """The router's certificate and key (PEM files); with `client_ca`, clients must present a
    certificate signed by it (mutual TLS)."""

    cert: str
    key: str
    client_ca: str | None = None

    def __post_init__(self) -> None:
        for name in ("cert", "key", "client_ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"tls {name} file {path!r} does not exist")

    def grpc_credentials(self) -> grpc.ServerCredentials:
        ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials([(Path(self.key).read_bytes(), Path(self.cert).read_bytes())],
                                           root_certificates=ca, require_client_auth=ca is not None)

    def uvicorn_options(self) -> dict:
        opts = {"ssl_certfile": self.cert, "ssl_keyfile": self.key}
        if self.client_ca:
            opts.update(ssl_ca_certs=self.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        return opts
