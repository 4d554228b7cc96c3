"""The OpenAI-compatible HTTP API of the router: `/v1/models`, `/v1/completions` and
`/v1/chat/completions`, streamed (server-sent events) or not, beside the gRPC endpoint.

Each request is translated into the gRPC `GenerateRequest` and runs through the same
`InferenceService.generate` (validation, admission, placement, migration, drain): the two doors
differ only in their wire format.

Every error has OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`: `param`
names the field at fault (`temperature`, `messages[2].content`) whenever one is, and `code` is
a stable string (`invalid_value`, `invalid_type`, `unknown_parameter`, `unsupported_parameter`,
`invalid_json`, `body_too_large`, `request_timeout`, `model_not_found`, `queue_full`, ...).
Statuses: 400 invalid, 401 unauthenticated, 404 unknown model or route, 405 wrong method, 408
body too slow, 409 duplicate request id, 413 body too large, 429 queue full, 503 unavailable
or draining, 504 deadline. A stream that fails after its first event ends with an `error`
event, then `[DONE]`.

The body: refused from its Content-Length before a byte is read when larger than the cap
(413; a chunked one as soon as what was read passes it), read within `body_timeout_s` (408),
then parsed and translated off the event loop. Unknown fields are refused (400
`unknown_parameter`), but for a few harmless ones accepted and ignored (`IGNORED`); fields of
features this server lacks (tools, ...) are refused (400 `unsupported_parameter`) unless
neutral; a JSON `null` is the field unset.

A request ends when its client leaves, at any stage (queued, prefilling, transferring,
decoding; streamed or not): the generation runs as a task while the connection is watched for
`http.disconnect`, which cancels it, and the dispatcher cancels the request on its workers.

Starlette app, served by uvicorn on the router's own event loop (router.http_server).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proto.pdcluster.v1 import inference_pb2 as pb
from router.frontend import RequestError
from router.http_server import HttpLimits
from router.openai_wire import ApiError, Translated, error_response, translate

log = logging.getLogger(__name__)

# ---- the app --------------------------------------------------------------------------------
class OpenAIApi:
    """Routes over an `InferenceService` (router/service.py); bodies within `max_body_bytes`
    and `limits.body_timeout_s`."""

    def __init__(self, service, model_id: str, tokenizer=None, *, max_body_bytes: int = 64 << 20,
                 limits: HttpLimits | None = None) -> None:
        self.service = service
        self.model_id = model_id
        self.tokenizer = tokenizer  # RouterTokenizer, for the token strings of logprobs
        self.max_body_bytes = max_body_bytes
        self.limits = limits or HttpLimits()
        self.created = int(time.time())
        self.app = Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
        ], exception_handlers={404: self._not_found, 405: self._not_allowed, Exception: self._internal})

    async def _internal(self, request: Request, exc: Exception) -> Response:
        log.error("HTTP %s %s failed: %r", request.method, request.url.path, exc)
        return error_response(ApiError(f"internal error: {type(exc).__name__}", 500, kind="internal_error",
                                       code="internal_error", close=True))

    async def _not_found(self, request: Request, exc) -> Response:
        return error_response(ApiError(f"no route {request.url.path}", 404, kind="not_found_error", code="not_found"))

    async def _not_allowed(self, request: Request, exc) -> Response:
        return error_response(ApiError(f"{request.method} is not allowed on {request.url.path}", 405,
                                       kind="invalid_request_error", code="method_not_allowed"))

    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "pdcluster",
                "max_model_len": self.service.frontend.max_model_len}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name != self.model_id:
            return error_response(ApiError(f"the model {name!r} does not exist; this server serves "
                                           f"{self.model_id!r}", 404, "model", "not_found_error", "model_not_found"))
        return JSONResponse(self._model_card())

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _body(self, request: Request) -> bytes:
        """The body, read within the size cap and the body timeout: refused from its
        Content-Length before a byte is read, or as soon as what was read passes the cap."""
        cap = self.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise ApiError(f"Content-Length must be a byte count, got {length[:40]!r}", code="invalid_http",
                               close=True)
            if int(length) > cap:
                raise ApiError(f"the request body has {int(length)} bytes; at most {cap} are allowed", 413,
                               code="body_too_large", close=True)
        buf = bytearray()
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                async for chunk in request.stream():
                    buf += chunk
                    if len(buf) > cap:
                        raise ApiError(f"the request body has more than {cap} bytes, the most allowed", 413,
                                       code="body_too_large", close=True)
        except TimeoutError:
            raise ApiError(f"the request body did not arrive within body_timeout_s={self.limits.body_timeout_s:g} s "
                           f"({len(buf)} bytes did)", 408, code="request_timeout", close=True) from None
        return bytes(buf)

    async def _serve(self, request: Request, chat: bool) -> Response:
        try:
            raw = await self._body(request)
            t = await asyncio.to_thread(translate, raw, chat, self.model_id)
        except ApiError as exc:
            return error_response(exc)
        except ClientDisconnect:  # gone before its body was in: nothing to answer
            return Response(status_code=400)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        t.request.request_id = rid
        return _Generation(self.service, t, _Shape(rid, self.model_id, chat, t.want_logprobs, self.tokenizer))


class _Generation:
    """ASGI: one generation, answered as JSON or as server-sent events. It runs as a task while
    the connection is watched for `http.disconnect` for the request's whole life (queued,
    prefilling, transferring, decoding): a client that leaves cancels it, and the dispatcher
    cancels the request on its workers."""

    def __init__(self, service, t: Translated, shape: _Shape) -> None:
        self.service, self.t, self.shape = service, t, shape

    async def __call__(self, scope, receive, send) -> None:
        work = asyncio.create_task(self._respond(send))
        gone = asyncio.create_task(_disconnected(receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this task is cancelled (the server stopping)
            gone.cancel()
            if not work.done():  # the client left: the request ends
                work.cancel()
            await asyncio.wait({work, gone})
        if not work.cancelled():
            work.result()  # an exception escaping: router.http_server's guard answers 500

    async def _respond(self, send) -> None:
        t, shape = self.t, self.shape
        gen = self.service.generate(t.request)
        try:
            # the first message decides the status: an error before any token is an HTTP error
            try:
                first = await anext(gen)
            except RequestError as exc:
                return await _send_error(send, ApiError.of(exc, shape.chat, t.aliases))
            except StopAsyncIteration:
                return await _send_error(send, ApiError("the request ended without an answer", 500,
                                                        kind="internal_error", code="internal_error"))
            if t.stream:
                await self._events(send, gen, first)
                return
            msgs = [first]
            try:
                async for m in gen:
                    msgs.append(m)
            except RequestError as exc:
                return await _send_error(send, ApiError.of(exc, shape.chat, t.aliases))
            body = json.dumps(shape.whole(msgs), ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                    (b"x-request-id", shape.rid.encode())]})
            await send({"type": "http.response.body", "body": body})
        finally:
            await gen.aclose()  # closed at a yield (the client gone mid-stream): cancelled on its workers

    async def _events(self, send, gen, first: pb.GenerateResponse) -> None:
        shape = self.shape
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                                (b"x-request-id", shape.rid.encode())]})

        async def event(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        try:
            if shape.chat:
                await event(_sse(shape.chunk(delta={"role": "assistant", "content": ""})))
            msg = first
            while True:
                await event(_sse(shape.delta(msg)))
                if msg.finish_reason:
                    if self.t.include_usage:
                        await event(_sse(shape.usage_chunk(msg)))
                    break
                try:
                    msg = await anext(gen)
                except StopAsyncIteration:
                    break
        except RequestError as exc:
            await event(b"data: " + ApiError.of(exc, shape.chat, self.t.aliases).bytes() + b"\n\n")
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_error(send, exc: ApiError) -> None:
    body = exc.bytes()
    await send({"type": "http.response.start", "status": exc.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _Shape:
    """OpenAI's response shapes for one request."""

    def __init__(self, rid: str, model: str, chat: bool, logprobs: bool, tokenizer) -> None:
        self.rid, self.model, self.chat, self.logprobs, self.tokenizer = rid, model, chat, logprobs, tokenizer
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _token(self, tid: int) -> str:
        return self.tokenizer.decode_one(tid) if self.tokenizer is not None else str(tid)

    def _logprobs(self, msgs: list[pb.GenerateResponse]) -> dict | None:
        if not self.logprobs:
            return None
        entries = [lp for m in msgs for lp in m.logprobs]
        if self.chat:
            def item(tid, lp):
                tok = self._token(tid)
                return {"token": tok, "logprob": lp, "bytes": list(tok.encode())}
            return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t.token_id, t.logprob)
                                                                                  for t in e.top]}
                                for e in entries]}
        tokens = [self._token(e.token_id) for e in entries]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._token(t.token_id): t.logprob for t in e.top} for e in entries],
                "text_offset": offsets}

    @staticmethod
    def _usage(final: pb.GenerateResponse) -> dict:
        u = final.usage
        usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                 "total_tokens": u.prompt_tokens + u.completion_tokens}
        if u.cached_prompt_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": u.cached_prompt_tokens}
        return usage

    @staticmethod
    def _finish(msg: pb.GenerateResponse) -> str | None:
        if not msg.finish_reason:
            return None
        return "length" if msg.finish_reason == "length" else "stop"

    def whole(self, msgs: list[pb.GenerateResponse]) -> dict:
        text = "".join(m.text for m in msgs)
        final = msgs[-1]
        choice: dict[str, Any] = {"index": 0, "finish_reason": self._finish(final), "logprobs": self._logprobs(msgs)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": self.rid, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self._usage(final)}

    def chunk(self, delta: dict | None = None, text: str | None = None, finish: str | None = None,
              logprobs: dict | None = None) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": logprobs}
        if self.chat:
            choice["delta"] = delta if delta is not None else {}
        else:
            choice["text"] = text or ""
        return {"id": self.rid, "object": self.object + (".chunk" if self.chat else ""), "created": self.created,
                "model": self.model, "choices": [choice]}

    def delta(self, msg: pb.GenerateResponse) -> dict:
        lps = self._logprobs([msg]) if msg.logprobs else None
        if self.chat:
            return self.chunk(delta={"content": msg.text} if msg.text else {}, finish=self._finish(msg), logprobs=lps)
        return self.chunk(text=msg.text, finish=self._finish(msg), logprobs=lps)

    def usage_chunk(self, final: pb.GenerateResponse) -> dict:
        return {"id": self.rid, "object": self.object + (".chunk" if self.chat else ""), "created": self.created,
                "model": self.model, "choices": [], "usage": self._usage(final)}
