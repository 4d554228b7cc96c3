"""The OpenAI-compatible HTTP API of the router: `/v1/models`, `/v1/completions` and
`/v1/chat/completions`, streamed (server-sent events) or not, beside the gRPC endpoint.

Each request is translated into the gRPC `GenerateRequest` and runs through the same
`InferenceService.generate` (validation, admission, placement, migration, drain): the two doors
differ only in their wire format. Errors keep OpenAI's JSON shape
(`{"error": {"message", "type", "param", "code"}}`) with the HTTP status of the gRPC code: 400
invalid, 401 unauthenticated, 404 unknown model or route, 409 duplicate request id, 429 queue
full, 503 unavailable or draining. A stream that fails after its first event ends with an
`error` event, then `[DONE]`.

Starlette app, served by uvicorn on the router's own event loop (router.http_server).
"""
from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from proto.pdcluster.v1 import inference_pb2 as pb
from router.frontend import RequestError

log = logging.getLogger(__name__)

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
MAX_BODY_BYTES = 64 << 20  # before parsing; the gRPC request limit then applies to what it becomes


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind

    @classmethod
    def of(cls, exc: RequestError) -> ApiError:
        status, kind = HTTP_STATUS.get(exc.code, (500, "internal_error"))
        return cls(str(exc), status, None, kind)

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}}


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


# ---- request translation --------------------------------------------------------------------
def _get(body: dict, name: str, types: tuple, default: Any = None) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in types:
        raise ApiError(f"{name} must be of type {'/'.join(t.__name__ for t in types)}, got {v!r}", param=name)
    if not isinstance(v, types):
        raise ApiError(f"{name} must be of type {'/'.join(t.__name__ for t in types)}, got {type(v).__name__}",
                       param=name)
    return v


def sampling_of(body: dict, chat: bool) -> tuple[pb.SamplingParams, bool]:
    """The request body's sampling fields as pb.SamplingParams (range checks are the frontend's,
    one place for both doors), and whether it asked for logprobs."""
    s = pb.SamplingParams()
    n = _get(body, "n", (int,), 1)
    if n != 1:
        raise ApiError(f"n must be 1 (one choice per request), got {n}", param="n")
    best_of = _get(body, "best_of", (int,), None)
    if best_of not in (None, 1):
        raise ApiError(f"best_of must be 1, got {best_of}", param="best_of")
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        v = _get(body, name, (int, float), None)
        if v not in (None, 0, 0.0) and not (name == "repetition_penalty" and v == 1):
            raise ApiError(f"{name} is not supported (leave it unset or neutral), got {v}", param=name)
    if body.get("logit_bias"):
        raise ApiError("logit_bias is not supported", param="logit_bias")
    max_tokens = _get(body, "max_completion_tokens", (int,), None) if chat else None
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", (int,), None)
    if max_tokens is not None:
        _int32("max_tokens", max_tokens)
        s.max_tokens = max_tokens
    for name in ("temperature", "top_p", "min_p"):
        v = _get(body, name, (int, float), None)
        if v is not None:
            if isinstance(v, float) and not math.isfinite(v):
                raise ApiError(f"{name} must be a finite number, got {v}", param=name)
            setattr(s, name, float(v))
    top_k = _get(body, "top_k", (int,), None)
    if top_k is not None:
        _int32("top_k", top_k)
        s.top_k = top_k
    seed = _get(body, "seed", (int,), None)
    if seed is not None:
        if not -(2**63) <= seed < 2**63:
            raise ApiError(f"seed must be in [-2**63, 2**63), got {seed}", param="seed")
        s.seed = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise ApiError("stop must be a string or a list of strings", param="stop")
        s.stop.extend(stop)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**32
                                                for x in ids):
            raise ApiError("stop_token_ids must be a list of token ids (integers >= 0)", param="stop_token_ids")
        s.stop_token_ids.extend(ids)
    ignore_eos = _get(body, "ignore_eos", (bool,), None)
    if ignore_eos is not None:
        s.ignore_eos = ignore_eos
    want_logprobs = False
    if chat:
        if _get(body, "logprobs", (bool,), False):
            want_logprobs = True
            top = _get(body, "top_logprobs", (int,), 0)
            _int32("top_logprobs", top)
            s.logprobs = top
        elif body.get("top_logprobs") is not None:
            raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
    else:
        lp = _get(body, "logprobs", (int,), None)
        if lp is not None:
            _int32("logprobs", lp)
            want_logprobs = True
            s.logprobs = lp
    return s, want_logprobs


def _int32(name: str, v: int) -> None:
    if not -(2**31) <= v < 2**31:
        raise ApiError(f"{name} is out of range, got {v}", param=name)


def chat_messages(body: dict) -> list[pb.ChatMessage]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ApiError(f"messages[{i}] must be an object with role and content", param="messages")
        role, content = m.get("role"), m.get("content")
        if isinstance(content, list):  # content parts: only text is understood
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(f"messages[{i}].content: only text parts are supported", param="messages")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(role, str) or not isinstance(content, str):
            raise ApiError(f"messages[{i}] must have a string role and string (or text parts) content",
                           param="messages")
        out.append(pb.ChatMessage(role=role, content=content))
    return out


def completion_prompt(body: dict, req: pb.GenerateRequest) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < 2**32 for t in prompt):
            raise ApiError("prompt token ids must be integers >= 0", param="prompt")
        req.prompt_token_ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError("prompt must be one string or one list of token ids: batches are not supported",
                       param="prompt")
    else:
        raise ApiError("prompt must be a non-empty string or list of token ids", param="prompt")


# ---- the app --------------------------------------------------------------------------------
class OpenAIApi:
    """Routes over an `InferenceService` (router/service.py)."""

    def __init__(self, service, model_id: str, tokenizer=None) -> None:
        self.service = service
        self.model_id = model_id
        self.tokenizer = tokenizer  # RouterTokenizer, for the token strings of logprobs
        self.created = int(time.time())
        self.app = Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
        ], exception_handlers={404: self._not_found, 405: self._not_allowed})

    async def _not_found(self, request: Request, exc) -> Response:
        return error_response(ApiError(f"no route {request.url.path}", 404, kind="not_found_error"))

    async def _not_allowed(self, request: Request, exc) -> Response:
        return error_response(ApiError(f"{request.method} is not allowed on {request.url.path}", 405,
                                       kind="invalid_request_error"))

    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "pdcluster",
                "max_model_len": self.service.frontend.max_model_len}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name != self.model_id:
            return error_response(ApiError(f"the model {name!r} does not exist; this server serves "
                                           f"{self.model_id!r}", 404, "model", "not_found_error"))
        return JSONResponse(self._model_card())

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _body(self, request: Request) -> dict:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(f"the request body has {len(raw)} bytes; at most {MAX_BODY_BYTES} allowed", 413)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(f"the request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        return body

    async def _serve(self, request: Request, chat: bool) -> Response:
        try:
            body = await self._body(request)
            model = body.get("model")
            if model is not None and model != self.model_id:
                raise ApiError(f"the model {model!r} does not exist; this server serves {self.model_id!r}", 404,
                               "model", "not_found_error")
            sampling, want_logprobs = sampling_of(body, chat)
            req = pb.GenerateRequest(sampling=sampling)
            if chat:
                req.messages.extend(chat_messages(body))
            else:
                completion_prompt(body, req)
            stream = _get(body, "stream", (bool,), False)
            opts = body.get("stream_options") or {}
            if not isinstance(opts, dict):
                raise ApiError("stream_options must be an object", param="stream_options")
            include_usage = bool(opts.get("include_usage")) and stream
        except ApiError as exc:
            return error_response(exc)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        req.request_id = rid
        gen = self.service.generate(req)
        shape = _Shape(rid, self.model_id, chat, want_logprobs, self.tokenizer)
        # the first message decides the status: an error before any token is an HTTP error
        try:
            first = await anext(gen)
        except RequestError as exc:
            return error_response(ApiError.of(exc))
        except StopAsyncIteration:
            return error_response(ApiError("the request ended without an answer", 500, kind="internal_error"))
        if stream:
            return StreamingResponse(self._events(gen, first, shape, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        try:
            msgs = [first] + [m async for m in gen]
        except RequestError as exc:
            return error_response(ApiError.of(exc))
        return JSONResponse(shape.whole(msgs), headers={"X-Request-Id": rid})

    async def _events(self, gen: AsyncIterator, first: pb.GenerateResponse, shape: _Shape,
                      include_usage: bool) -> AsyncIterator[bytes]:
        try:
            if shape.chat:
                yield _sse(shape.chunk(delta={"role": "assistant", "content": ""}))
            msg = first
            while True:
                yield _sse(shape.delta(msg))
                if msg.finish_reason:
                    if include_usage:
                        yield _sse(shape.usage_chunk(msg))
                    break
                try:
                    msg = await anext(gen)
                except StopAsyncIteration:
                    break
        except RequestError as exc:
            yield _sse(ApiError.of(exc).body())
        finally:
            await gen.aclose()  # a client gone mid-stream: the request is cancelled on its workers
        yield b"data: [DONE]\n\n"


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
