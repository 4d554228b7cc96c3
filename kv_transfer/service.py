"""The receiver's gRPC service (handshake, begin, chunk stream, cancel) and the sender's
side of it (PeerChannel). Both bind/connect to explicit hosts (127.0.0.1 by default) and
set gRPC's message size limits explicitly.

Two servers: `serve` (a sync grpc.server on `server_threads` threads) for control-only
receivers (nixl: unary calls that return at once), and `AsyncService` (grpc.aio) for the
grpc transport's receiver. A sync server runs each call on a thread of its pool until the
call ends, and a Push stream lasts from its sender's start() to its final notice: with as
many streams open as threads, every further call (Begin included) queued until its deadline,
while the streams holding the threads waited for layers that the waiting Begin's caller
(the prefill engine, which starts every transfer of a step before computing any layer) was
to send. The aio service holds no thread per call: all its calls are coroutines on one
event loop, so how many streams are open does not bound what else is served.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Protocol

import grpc

from kv_transfer.config import TransferConfig
from kv_transfer.handshake import HandshakeError
from kv_transfer.wire import PushFrame, decode_push
from proto.client import with_metadata
from proto.pdcluster.v1 import kv_transfer_pb2 as pb
from proto.pdcluster.v1 import kv_transfer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class ServedReceiver(Protocol):
    def handle_handshake(self, request: pb.HandshakeRequest) -> pb.HandshakeReply: ...
    def handle_begin(self, request: pb.BeginTransfer) -> pb.Ack: ...
    def handle_push(self, items: Iterator[PushFrame], context: grpc.ServicerContext) -> Iterator[pb.Ack]: ...
    def handle_cancel(self, request: pb.Abort) -> pb.Ack: ...


def _handlers(receiver: ServedReceiver) -> grpc.GenericRpcHandler:
    """KVTransfer's methods; Push items are decoded by wire.decode_push, which leaves each
    chunk's payload in the message gRPC delivered instead of copying it through protobuf."""
    def unary(fn, request_type):
        return grpc.unary_unary_rpc_method_handler(lambda request, context: fn(request),
                                                   request_deserializer=request_type.FromString,
                                                   response_serializer=_serialize)
    return grpc.method_handlers_generic_handler("pdcluster.v1.KVTransfer", {
        "Handshake": unary(receiver.handle_handshake, pb.HandshakeRequest),
        "Begin": unary(receiver.handle_begin, pb.BeginTransfer),
        "Cancel": unary(receiver.handle_cancel, pb.Abort),
        "Push": grpc.stream_stream_rpc_method_handler(receiver.handle_push, request_deserializer=decode_push,
                                                      response_serializer=_serialize),
    })


def _serialize(message) -> bytes:
    return message.SerializeToString()


def _options(config: TransferConfig) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", config.grpc_max_message_bytes),
            ("grpc.max_receive_message_length", config.grpc_max_message_bytes),
            ("grpc.so_reuseport", 0)]


# ---- the KV plane's credential (TransferConfig.secret) ------------------------------------------
NO_CREDENTIAL = "the KV transfer service needs the cluster's credential"


def _credential(config: TransferConfig) -> tuple[tuple[str, str], ...]:
    """What a caller sends: the cluster's secret as a bearer token."""
    return (("authorization", f"Bearer {config.secret}"),) if config.secret else ()


def _authorized(config: TransferConfig, metadata) -> bool:
    want = f"Bearer {config.secret}".encode()
    got = next((v for k, v in metadata or () if k == "authorization"), "")
    return hmac.compare_digest(got.encode() if isinstance(got, str) else got, want)


def _refusal(handler: grpc.RpcMethodHandler, asynchronous: bool) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that answers UNAUTHENTICATED, returns nothing and never
    parses the request (no deserializer)."""
    if asynchronous:
        async def unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, NO_CREDENTIAL)

        async def stream(request_iterator, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, NO_CREDENTIAL)
    else:
        def unary(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, NO_CREDENTIAL)

        def stream(request_iterator, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, NO_CREDENTIAL)
            yield
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)


class _SyncCredentialCheck(grpc.ServerInterceptor):
    def __init__(self, config: TransferConfig) -> None:
        self.config = config

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or _authorized(self.config, details.invocation_metadata):
            return handler
        return _refusal(handler, asynchronous=False)


class _AsyncCredentialCheck(grpc.aio.ServerInterceptor):
    def __init__(self, config: TransferConfig) -> None:
        self.config = config

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or _authorized(self.config, details.invocation_metadata):
            return handler
        return _refusal(handler, asynchronous=True)


def serve(receiver: ServedReceiver, config: TransferConfig) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.server_threads,
                                                    thread_name_prefix="kv-recv"), options=_options(config),
                         interceptors=[_SyncCredentialCheck(config)] if config.secret else None)
    server.add_generic_rpc_handlers([_handlers(receiver)])
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise OSError(f"could not bind the KV transfer service to {config.host}:{config.port}")
    server.start()
    return server, port


class PushStream(Protocol):
    """One Push stream's state on the receiver: `item` handles a decoded item and returns the
    Ack to send (None: none, the item's ack is deferred); `end` runs once when the stream ends,
    `clean` when its sender half-closed it after every item was accepted."""
    def item(self, frame: PushFrame) -> pb.Ack | None: ...
    def end(self, clean: bool) -> None: ...


class StreamedReceiver(Protocol):
    """A receiver served by AsyncService. Its handlers run on the service's event loop, so
    they must never wait on the network or on another call (ledger locks only)."""
    def handle_handshake(self, request: pb.HandshakeRequest) -> pb.HandshakeReply: ...
    def handle_begin(self, request: pb.BeginTransfer) -> pb.Ack: ...
    def handle_cancel(self, request: pb.Abort) -> pb.Ack: ...
    def open_push(self) -> PushStream: ...


def _async_handlers(receiver: StreamedReceiver) -> grpc.GenericRpcHandler:
    def unary(fn, request_type):
        async def call(request, context):
            return fn(request)
        return grpc.unary_unary_rpc_method_handler(call, request_deserializer=request_type.FromString,
                                                   response_serializer=_serialize)

    async def push(frames, context: grpc.aio.ServicerContext) -> None:
        # reader/writer API rather than an async generator: a cancellation (the sender cancelled,
        # the stream broke, the server stops) lands in this coroutine whether it awaits a read or
        # a write, so `end` runs at once, never later from the generator's finalizer
        stream = receiver.open_push()
        clean = False
        try:
            while (frame := await context.read()) is not grpc.aio.EOF:
                ack = stream.item(frame)
                if ack is None:
                    continue
                await context.write(ack)
                if not ack.ok:
                    return
            clean = True
        finally:
            stream.end(clean)

    return grpc.method_handlers_generic_handler("pdcluster.v1.KVTransfer", {
        "Handshake": unary(receiver.handle_handshake, pb.HandshakeRequest),
        "Begin": unary(receiver.handle_begin, pb.BeginTransfer),
        "Cancel": unary(receiver.handle_cancel, pb.Abort),
        "Push": grpc.stream_stream_rpc_method_handler(push, request_deserializer=decode_push,
                                                      response_serializer=_serialize),
    })


class _ServiceLoop:
    """The process's one event loop for KV services, on a daemon thread started on first use
    and kept for the process's life: grpc.aio binds its completion queue's poller to the loops
    it runs on, so one long-lived loop, rather than one per receiver, keeps it bound to one."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None
    _pid = 0

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None or cls._pid != os.getpid():  # a forked child has no loop thread
                loop = asyncio.new_event_loop()
                threading.Thread(target=cls._run, args=(loop,), name="kv-service-loop", daemon=True).start()
                cls._loop, cls._pid = loop, os.getpid()
            return cls._loop

    @staticmethod
    def _run(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        loop.run_forever()

    @staticmethod
    def running_here(loop: asyncio.AbstractEventLoop) -> bool:
        try:
            return asyncio.get_running_loop() is loop
        except RuntimeError:
            return False


class AsyncService:
    """KVTransfer served by grpc.aio on the process's KV service loop; `port` is bound."""

    def __init__(self, receiver: StreamedReceiver, config: TransferConfig) -> None:
        self._loop = _ServiceLoop.get()
        self._server, self.port = self._run(self._start(receiver, config), timeout=30)

    def _run(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @staticmethod
    async def _start(receiver: StreamedReceiver, config: TransferConfig):
        server = grpc.aio.server(options=_options(config),
                                 interceptors=[_AsyncCredentialCheck(config)] if config.secret else None)
        server.add_generic_rpc_handlers([_async_handlers(receiver)])
        try:
            port = server.add_insecure_port(f"{config.host}:{config.port}")
        except RuntimeError:
            port = 0
        if port == 0:
            raise OSError(f"could not bind the KV transfer service to {config.host}:{config.port}")
        await server.start()
        return server, port

    def stop(self, grace: float) -> None:
        """Stop serving: calls still open after `grace` seconds are cancelled (their streams' `end`).
        Called from a handler (on the loop itself), it starts the stop without waiting for it."""
        if _ServiceLoop.running_here(self._loop):
            self._loop.create_task(self._server.stop(grace))
            return
        self._run(self._server.stop(grace), timeout=grace + 5)


class PeerChannel:
    """A sender's connection to one receiver endpoint, handshaken once and then reused."""

    def __init__(self, endpoint: str, config: TransferConfig) -> None:
        self.endpoint = endpoint
        self.config = config
        self.channel = with_metadata(grpc.insecure_channel(endpoint, options=_options(config)), _credential(config))
        self.stub = pb_grpc.KVTransferStub(self.channel)
        self._data_channels: list[grpc.Channel] = []
        self._pushes: list = []
        self.reply: pb.HandshakeReply | None = None
        self.lock = threading.Lock()

    def push(self, lane: int):
        """The Push call of data lane `lane` (items already encoded, wire.encode_chunk).
        Each lane has its own channel and TCP connection: one gRPC connection serializes its
        streams' framing and socket writes, so lanes on one connection would not run in parallel."""
        with self.lock:
            while len(self._pushes) <= lane:
                opts = [*_options(self.config), ("grpc.use_local_subchannel_pool", 1)]
                channel = with_metadata(grpc.insecure_channel(self.endpoint, options=opts), _credential(self.config))
                self._data_channels.append(channel)
                self._pushes.append(channel.stream_stream("/pdcluster.v1.KVTransfer/Push", request_serializer=None,
                                                          response_deserializer=pb.Ack.FromString))
            return self._pushes[lane]

    def handshake(self, request: pb.HandshakeRequest) -> pb.HandshakeReply:
        try:
            grpc.channel_ready_future(self.channel).result(timeout=self.config.handshake_timeout_s)
            reply = self.stub.Handshake(request, timeout=self.config.handshake_timeout_s)
        except (grpc.FutureTimeoutError, grpc.RpcError) as exc:
            raise HandshakeError(f"handshake with {self.endpoint} failed: {_describe(exc)}") from exc
        if not reply.accepted:
            raise HandshakeError(f"handshake with {self.endpoint} refused: {reply.reason}")
        self.reply = reply
        return reply

    def begin(self, request: pb.BeginTransfer) -> None:
        try:
            ack = self.stub.Begin(request, timeout=self.config.handshake_timeout_s)
        except grpc.RpcError as exc:
            raise HandshakeError(f"begin with {self.endpoint} failed: {_describe(exc)}") from exc
        if not ack.ok:
            raise HandshakeError(f"begin refused by {self.endpoint}: {ack.reason}")

    def cancel(self, request_id: str, reason: str) -> None:
        try:
            self.stub.Cancel(pb.Abort(request_id=request_id, reason=reason), timeout=1.0)
        except grpc.RpcError:
            pass  # best effort: the receiver's own deadline frees its pages anyway

    def close(self) -> None:
        for channel in (self.channel, *self._data_channels):
            channel.close()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, grpc.FutureTimeoutError):
        return "endpoint unreachable (connect timed out)"
    return str(exc)


class PeerSet:
    """PeerChannels by endpoint, created and handshaken on first use."""

    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        self._peers: dict[str, PeerChannel] = {}
        self._lock = threading.Lock()

    def get(self, endpoint: str, make_request) -> PeerChannel:
        with self._lock:
            peer = self._peers.get(endpoint)
            if peer is None:
                peer = self._peers[endpoint] = PeerChannel(endpoint, self.config)
        with peer.lock:
            if peer.reply is None:
                try:
                    peer.handshake(make_request())
                except HandshakeError:
                    with self._lock:
                        self._peers.pop(endpoint, None)
                    peer.close()
                    raise
        return peer

    def drop(self, endpoint: str) -> None:
        with self._lock:
            peer = self._peers.pop(endpoint, None)
        if peer is not None:
            peer.close()

    def close(self) -> None:
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            peer.close()
