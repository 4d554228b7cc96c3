"""`RouterServer`: the grpc.aio server around InferenceService, with the standard health
service (SERVING while every needed role has a healthy worker, NOT_SERVING while draining) and
server reflection, plus a background task that refreshes worker loads for placement. With
`warm_up`, start() first runs one tiny request through every prefill/decode pair, so SERVING
means every transfer handshake is done. With `metrics_port`, it also serves Prometheus text at
/metrics (router.metrics); with `http_port`, the OpenAI-compatible HTTP API
(router.openai_http), on the same event loop and through the same service."""
from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto.pdcluster.v1 import inference_pb2 as pb
from router.pair_calls import WARM_UP_PROMPT
from router.security import Access, Tls
from router.service import InferenceService
from router.wire import safe_deserializer

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name


class RouterServer:
    def __init__(self, service: InferenceService, host: str = "127.0.0.1", port: int = 0,
                 *, load_refresh_s: float = 0.1, load_timeout_s: float = 2.0, max_message_bytes: int = 16 << 20,
                 warm_up: bool = False, metrics_port: int | None = None, http_port: int | None = None,
                 access: Access | None = None, tls: Tls | None = None, http_limits=None,
                 max_body_bytes: int | None = None) -> None:
        self.service = service
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        self.load_refresh_s = load_refresh_s
        self.load_timeout_s = load_timeout_s  # a refresh waits this long; a later answer still counts
        self.max_message_bytes = max_message_bytes
        self.warm_up = warm_up
        self.metrics_port = metrics_port  # None: no /metrics endpoint; 0: a free port
        self.metrics_url = ""
        self.access = access or Access()  # API keys on every RPC and route (router.security)
        self.tls = tls                    # None: plaintext
        self._metrics_http = None
        self.http_port = http_port  # None: no OpenAI-compatible HTTP API; 0: a free port
        self.http_url = ""
        self._http = None
        self.http_limits = http_limits  # router.http_server.HttpLimits; None: its defaults
        # the largest HTTP body: http_limits.max_body_bytes, else derived from the gRPC request cap
        self.max_body_bytes = max_body_bytes
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._refresher: asyncio.Task | None = None
        self._health_status = None  # last status set on self.health

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> str:
        opts = [("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", max(self.max_message_bytes, 16 << 20)), ("grpc.so_reuseport", 0)]
        server = grpc.aio.server(options=opts, interceptors=[self.access.grpc_interceptor()] if self.access.enabled
                                 else None)
        _add_inference_service(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        _add_reflection((SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name), server)
        where = f"{self.host}:{self.requested_port}"
        self.port = (server.add_secure_port(where, self.tls.grpc_credentials()) if self.tls is not None
                     else server.add_insecure_port(where))
        if not self.port:
            raise RuntimeError(f"could not bind the router to {self.host}:{self.requested_port}")
        await self.service.dispatcher.refresh_loads()
        if self.warm_up:  # every prefill/decode pair has shaken hands before SERVING
            await self.service.dispatcher.warm_up(WARM_UP_PROMPT)
            await self.service.dispatcher.refresh_loads()
        await server.start()
        self._server = server
        self.service.on_draining = self._update_health
        if self.metrics_port is not None:
            from router.http_server import HttpServer

            app = self.service.metrics.asgi_app()
            if not self.access.open_metrics:
                app = self.access.asgi(app)
            self._metrics_http = HttpServer(app, self.host, self.metrics_port, self.tls, self._limits())
            self.metrics_url = await self._metrics_http.start() + "/metrics"
            log.info("router metrics on %s", self.metrics_url)
        if self.http_port is not None:
            from router.http_server import HttpServer
            from router.openai_http import OpenAIApi

            limits = self._limits()
            api = OpenAIApi(self.service, self.service.model_id, self.service.frontend.tokenizer,
                            max_body_bytes=self.max_body_bytes or limits.body_bytes(self.max_message_bytes),
                            limits=limits)
            app = self.access.asgi(api.app) if self.access.enabled else api.app
            self._http = HttpServer(app, self.host, self.http_port, self.tls, limits)
            self.http_url = await self._http.start()
            log.info("router OpenAI-compatible API on %s/v1", self.http_url)
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop())
        await self._update_health()
        log.info("router serving %s on %s", SERVICE_NAME, self.address)
        return self.address

    def _limits(self):
        from router.http_server import HttpLimits

        return self.http_limits or HttpLimits()

    @property
    def health_status(self) -> str:
        """The status grpc.health.v1 reports now: SERVING, NOT_SERVING, or "" before start-up."""
        return health_pb2.HealthCheckResponse.ServingStatus.Name(self._health_status) if self._health_status else ""

    def missing_role(self) -> str | None:
        """Why the cluster cannot serve now (a role it needs has no healthy worker), or None."""
        d = self.service.dispatcher
        decodes = [d.views[w] for w in d.decodes]
        if not any(v.healthy for v in decodes):
            return "no healthy decode or colocated worker"
        if any(v.role == "decode" for v in decodes) and not any(d.views[w].healthy for w in d.prefills):
            return "no healthy prefill worker"
        return None

    async def _update_health(self) -> None:
        """grpc.health.v1 tells the truth: SERVING only while every role the cluster needs has a
        healthy worker and the router is not draining."""
        missing = "draining" if self.service.draining else self.missing_role()
        status = health_pb2.HealthCheckResponse.NOT_SERVING if missing else health_pb2.HealthCheckResponse.SERVING
        if status != self._health_status:
            self._health_status = status
            for name in ("", SERVICE_NAME):
                await self.health.set(name, status)
            log.warning("router health %s%s", health_pb2.HealthCheckResponse.ServingStatus.Name(status),
                        f": {missing}" if missing else "")

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.load_refresh_s)
            try:
                await self.service.dispatcher.refresh_loads(self.load_timeout_s)
                await self._update_health()
            except Exception as exc:  # never let placement data stop the router
                log.warning("load refresh failed: %s", exc)

    async def stop(self, grace_s: float = 30.0) -> None:
        """Drain, then stop: health NOT_SERVING at once, new requests refused with UNAVAILABLE
        while the listener stays open, running ones finish within grace_s (then they are
        cancelled, saying so, which frees their pages); then the listener closes."""
        if self._server is not None:
            await self.service.drain(grace_s)
            await self._server.stop(0)
            self._server = None
        if self._http is not None:
            await self._http.stop()
            self._http = None
        await self.service.dispatcher.drain_cleanup()
        if self._metrics_http is not None:
            await self._metrics_http.stop()
            self._metrics_http = None
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
            self._refresher = None


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _add_reflection(service_names: tuple[str, ...], server: grpc.aio.Server) -> None:
    """Server reflection, v1 (what current grpcurl asks first) and v1alpha. grpcio-reflection
    implements v1alpha only; v1's messages are the same on the wire (same fields and numbers,
    another package name), so one servicer answers both."""
    from grpc_reflection.v1alpha import reflection_pb2 as rpb

    names = (*service_names, reflection.SERVICE_NAME, REFLECTION_V1)
    servicer = reflection.aio.ReflectionServicer(names)
    for service in (reflection.SERVICE_NAME, REFLECTION_V1):
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo, request_deserializer=rpb.ServerReflectionRequest.FromString,
                response_serializer=rpb.ServerReflectionResponse.SerializeToString)}),))


def _add_inference_service(service: InferenceService, server: grpc.aio.Server) -> None:
    """The generated `add_InferenceServicer_to_server`, with requests decoded by
    `safe_deserializer`: a request that does not parse (a string field that is not UTF-8)
    reaches the handler as a BadRequest, which answers INVALID_ARGUMENT naming the field."""
    def handler(kind, method, request_cls, response_cls):
        return kind(method, request_deserializer=safe_deserializer(request_cls),
                    response_serializer=response_cls.SerializeToString)

    handlers = {
        "Generate": handler(grpc.unary_stream_rpc_method_handler, service.Generate, pb.GenerateRequest,
                            pb.GenerateResponse),
        "ModelInfo": handler(grpc.unary_unary_rpc_method_handler, service.ModelInfo, pb.ModelInfoRequest,
                             pb.ModelInfoResponse),
        "ClusterStatus": handler(grpc.unary_unary_rpc_method_handler, service.ClusterStatus, pb.ClusterStatusRequest,
                                 pb.ClusterStatusResponse),
        "Tokenize": handler(grpc.unary_unary_rpc_method_handler, service.Tokenize, pb.TokenizeRequest,
                            pb.TokenizeResponse),
        "Drain": handler(grpc.unary_unary_rpc_method_handler, service.Drain, pb.DrainRequest, pb.DrainResponse),
        "Scale": handler(grpc.unary_unary_rpc_method_handler, service.Scale, pb.ScaleRequest, pb.ScaleResponse),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
