"""The OpenAI wire format of the router's HTTP API (router/openai_http.py): the fields a body may
have, a body's translation into a gRPC `GenerateRequest` (`translate`), and the errors in
OpenAI's shape (`ApiError`), with `param` naming the field at fault and a stable `code`. Pure
functions of the body: they run off the event loop."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import grpc
from starlette.responses import Response

from proto.pdcluster.v1 import inference_pb2 as pb
from router.frontend import RequestError
from router.http_server import error_body

# gRPC status -> (HTTP status, OpenAI error type, stable code)
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", "unsupported_value"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", "permission_denied"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error", "not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error", "conflict"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "queue_full"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "timeout"),
}

# ---- the fields ------------------------------------------------------------------------------
SAMPLING = frozenset({"max_tokens", "temperature", "top_p", "n", "stop", "presence_penalty", "frequency_penalty",
                      "seed", "logprobs", "logit_bias",
                      # this server's extensions (the gRPC SamplingParams)
                      "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids"})
COMMON = frozenset({"model", "stream", "stream_options"}) | SAMPLING
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "modalities"}
COMPLETION_FIELDS = COMMON | {"prompt", "best_of", "echo", "suffix"}
IGNORED = frozenset({"user", "metadata", "store", "service_tier"})  # accepted, whatever their value, and ignored
UNSUPPORTED = frozenset({"tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "audio",
                         "prediction", "web_search_options", "reasoning_effort", "verbosity", "prompt_cache_key",
                         "safety_identifier"})
MESSAGE_FIELDS = frozenset({"role", "content"})
MESSAGE_IGNORED = frozenset({"name"})
MESSAGE_UNSUPPORTED = frozenset({"tool_calls", "tool_call_id", "function_call", "audio", "refusal", "annotations"})


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error", code: str = "invalid_value", close: bool = False) -> None:
        super().__init__(message)
        self.status, self.param, self.kind, self.code, self.close = status, param, kind, code, close

    @classmethod
    def of(cls, exc: RequestError, chat: bool = True, aliases: dict[str, str] | None = None) -> ApiError:
        """A RequestError of the frontend or the dispatcher, in the HTTP API's words: the gRPC
        field names (`sampling.max_tokens`) become the body's (`max_tokens`) in the message
        and in `param`."""
        status, kind, code = HTTP_STATUS.get(exc.code, (500, "internal_error", "internal_error"))
        message, param = str(exc), None
        if status == 400:
            message, param = _http_words(message, chat, aliases or {})
        return cls(message, status, param, kind, code)

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def bytes(self) -> bytes:
        return error_body(str(self), self.kind, self.code, self.param)

    def response(self) -> Response:
        headers = {"connection": "close"} if self.close else None
        return Response(self.bytes(), status_code=self.status, media_type="application/json", headers=headers)


def error_response(exc: ApiError) -> Response:
    return exc.response()


_SAMPLING_FIELD = re.compile(r"\bsampling\.([a-z_]+)")
_INPUT_FIELD = re.compile(r"^(?:the )?(prompt_token_ids|prompt|messages)((?:\[\d+\])?(?:\.[a-z_]+)?)")


def _http_words(message: str, chat: bool, aliases: dict[str, str]) -> tuple[str, str | None]:
    """(message, param) of a frontend error: `sampling.X` is the body's field X (or its alias:
    max_completion_tokens, top_logprobs), `prompt_token_ids` the completion's `prompt`, the
    prompt of a chat its `messages`."""
    param = None
    m = _SAMPLING_FIELD.search(message)
    if m:
        param = aliases.get(m.group(1), m.group(1))
        rest = message[m.end():]
        idx = re.match(r"\[\d+\]", rest)
        message = _SAMPLING_FIELD.sub(lambda g: aliases.get(g.group(1), g.group(1)), message)
        return message, param + (idx.group(0) if idx else "")
    m = _INPUT_FIELD.match(message)
    if m:
        name = m.group(1)
        if name == "prompt_token_ids" or (name == "prompt" and chat):
            name = "messages" if chat else "prompt"
            suffix = m.group(2) if not chat else ""
        else:
            suffix = m.group(2)
        return message.replace("prompt_token_ids", "prompt") if not chat else message, name + suffix
    if message.startswith("exactly one of"):
        return message, "messages" if chat else "prompt"
    return message, param


# ---- request translation --------------------------------------------------------------------
def _type_name(types: tuple) -> str:
    return " or ".join({"int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean",
                        "list": "an array", "dict": "an object"}[t.__name__] for t in types)


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    return {int: "an integer", float: "a number", str: "a string", list: "an array", dict: "an object"}.get(
        type(v), type(v).__name__)


def _get(body: dict, name: str, types: tuple, default: Any = None) -> Any:
    v = body.get(name)
    if v is None:  # absent, or JSON null: unset
        return default
    if (isinstance(v, bool) and bool not in types) or not isinstance(v, types):
        raise ApiError(f"{name} must be {_type_name(types)}, got {_json_type(v)}", param=name, code="invalid_type")
    return v


def _number(body: dict, name: str) -> float | None:
    v = _get(body, name, (int, float), None)
    if v is None:
        return None
    try:
        f = float(v)
    except OverflowError:  # an integer beyond a float's range
        raise ApiError(f"{name} must be a finite number, got an integer too large for one", param=name) from None
    if not math.isfinite(f):
        raise ApiError(f"{name} must be a finite number, got {v}", param=name)
    return f


def _int32(name: str, v: int, lo: int = -(2**31)) -> int:
    if not lo <= v < 2**31:
        shown = v if abs(v) < 10**30 else f"an integer of {len(str(abs(v)))} digits"
        raise ApiError(f"{name} must be in [{lo}, {2**31 - 1}], got {shown}", param=name)
    return v


def _text(name: str, v: str) -> str:
    """A string that protobuf (UTF-8) can carry: JSON can spell a lone surrogate (\\ud800)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(f"{name} is not valid Unicode text: a lone surrogate at character {exc.start}",
                       param=name) from None
    return v


def check_fields(body: dict, chat: bool) -> None:
    """Unknown fields are refused; fields of features this server lacks too, unless null or
    neutral."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name, v in body.items():
        if name in known or name in IGNORED:
            continue
        if name in UNSUPPORTED or name in (COMPLETION_FIELDS if chat else CHAT_FIELDS):
            if v is None:
                continue
            raise ApiError(f"{name} is not supported by this server" + ("" if name in UNSUPPORTED else
                           f" on /v1/{'chat/completions' if chat else 'completions'}"), param=name,
                           code="unsupported_parameter")
        raise ApiError(f"unrecognized request argument: {json.dumps(name)}", param=name, code="unknown_parameter")
    neutral = {"logit_bias": lambda v: v == {}, "response_format": lambda v: v == {"type": "text"},
               "modalities": lambda v: v == ["text"], "echo": lambda v: v is False, "suffix": lambda v: v == ""}
    for name, ok in neutral.items():
        v = body.get(name)
        if v is not None and name in known and not ok(v):
            allowed = {"logit_bias": "{} or null", "response_format": '{"type": "text"} or null',
                       "modalities": '["text"] or null', "echo": "false or null", "suffix": '"" or null'}[name]
            raise ApiError(f"{name} is not supported by this server: it must be {allowed}", param=name,
                           code="unsupported_parameter")


def sampling_of(body: dict, chat: bool) -> tuple[pb.SamplingParams, bool, dict[str, str]]:
    """The request body's sampling fields as pb.SamplingParams (range checks are the frontend's,
    one place for both doors), whether it asked for logprobs, and which body field stands for
    which gRPC one where the names differ."""
    s = pb.SamplingParams()
    aliases: dict[str, str] = {}
    n = _get(body, "n", (int,), 1)
    if n != 1:
        raise ApiError(f"n must be 1 (one choice per request), got {_int32('n', n)}", param="n",
                       code="unsupported_value")
    best_of = _get(body, "best_of", (int,), None)
    if best_of not in (None, 1):
        raise ApiError(f"best_of must be 1, got {_int32('best_of', best_of)}", param="best_of",
                       code="unsupported_value")
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        v = _number(body, name)
        if v is not None and v != neutral and not (name == "repetition_penalty" and v == 0):  # 0: off, as 1
            raise ApiError(f"{name} is not supported: it must be {neutral:g} or unset, got {v}", param=name,
                           code="unsupported_value")
    max_tokens = _get(body, "max_completion_tokens", (int,), None) if chat else None
    if max_tokens is not None:
        aliases["max_tokens"] = "max_completion_tokens"
    else:
        max_tokens = _get(body, "max_tokens", (int,), None)
    if max_tokens is not None:
        s.max_tokens = _int32(aliases.get("max_tokens", "max_tokens"), max_tokens)
    for name in ("temperature", "top_p", "min_p"):
        v = _number(body, name)
        if v is not None:
            setattr(s, name, v)
    top_k = _get(body, "top_k", (int,), None)
    if top_k is not None:
        s.top_k = _int32("top_k", top_k)
    seed = _get(body, "seed", (int,), None)
    if seed is not None:
        if not -(2**63) <= seed < 2**63:
            raise ApiError("seed must be in [-2**63, 2**63)", param="seed")
        s.seed = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise ApiError("stop must be a string or an array of strings", param="stop", code="invalid_type")
        s.stop.extend(_text(f"stop[{i}]", x) for i, x in enumerate(stop))
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**32
                                                for x in ids):
            raise ApiError("stop_token_ids must be an array of token ids (integers >= 0)", param="stop_token_ids")
        s.stop_token_ids.extend(ids)
    ignore_eos = _get(body, "ignore_eos", (bool,), None)
    if ignore_eos is not None:
        s.ignore_eos = ignore_eos
    want_logprobs = False
    if chat:
        aliases["logprobs"] = "top_logprobs"
        if _get(body, "logprobs", (bool,), False):
            want_logprobs = True
            s.logprobs = _int32("top_logprobs", _get(body, "top_logprobs", (int,), 0))
        elif body.get("top_logprobs") is not None:
            _get(body, "top_logprobs", (int,))
            raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
    else:
        lp = _get(body, "logprobs", (int,), None)
        if lp is not None:
            want_logprobs = True
            s.logprobs = _int32("logprobs", lp)
    return s, want_logprobs, aliases


def chat_messages(body: dict) -> list[pb.ChatMessage]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError("messages must be a non-empty array", param="messages",
                       code="invalid_type" if not isinstance(msgs, list) else "invalid_value")
    out = []
    for i, m in enumerate(msgs):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"{at} must be an object with role and content, got {_json_type(m)}", param=at,
                           code="invalid_type")
        for key, v in m.items():
            if key in MESSAGE_FIELDS or key in MESSAGE_IGNORED or (key in MESSAGE_UNSUPPORTED and v in (None, [])):
                continue
            code = "unsupported_parameter" if key in MESSAGE_UNSUPPORTED else "unknown_parameter"
            raise ApiError(f"{at}.{key} is not supported by this server" if key in MESSAGE_UNSUPPORTED else
                           f"unrecognized argument: {at}.{key}", param=f"{at}.{key}", code=code)
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise ApiError(f"{at}.role must be a string, got {_json_type(role)}", param=f"{at}.role",
                           code="invalid_type")
        if isinstance(content, list):  # content parts: only text is understood
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(f"{at}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                                   "supported", param=f"{at}.content", code="unsupported_value")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise ApiError(f"{at}.content must be a string or an array of text parts, got {_json_type(content)}",
                           param=f"{at}.content", code="invalid_type")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        out.append(pb.ChatMessage(role=_text(f"{at}.role", role), content=_text(f"{at}.content", content)))
    return out


def completion_prompt(body: dict, req: pb.GenerateRequest) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        req.prompt = _text("prompt", prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < 2**32 for t in prompt):
            raise ApiError("prompt token ids must be integers in [0, 2**32)", param="prompt")
        req.prompt_token_ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError("prompt must be one string or one array of token ids: batches are not supported",
                       param="prompt", code="unsupported_value")
    else:
        raise ApiError("prompt must be a non-empty string or array of token ids", param="prompt",
                       code="invalid_type" if not isinstance(prompt, (str, list)) else "invalid_value")


@dataclass
class Translated:
    """A request body, checked and translated."""

    request: pb.GenerateRequest
    want_logprobs: bool
    stream: bool
    include_usage: bool
    aliases: dict[str, str] = field(default_factory=dict)


def translate(raw: bytes, chat: bool, model_id: str) -> Translated:
    """Parse and translate a body (in a worker thread: the C JSON parser holds the GIL, but the
    body's size is capped)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError("the request body is nested too deeply to parse", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(f"the request body is not valid JSON: {str(exc)[:200]}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {_json_type(body)}", code="invalid_json")
    check_fields(body, chat)
    model = _get(body, "model", (str,), None)
    if model is not None and model != model_id:
        raise ApiError(f"the model {model!r} does not exist; this server serves {model_id!r}", 404, "model",
                       "not_found_error", "model_not_found")
    stream = _get(body, "stream", (bool,), False)
    opts = _get(body, "stream_options", (dict,), {})
    for key in opts:
        if key != "include_usage":
            raise ApiError(f"unrecognized argument: stream_options.{key}", param=f"stream_options.{key}",
                           code="unknown_parameter")
    include_usage = bool(_get(opts, "include_usage", (bool,), False)) and stream
    sampling, want_logprobs, aliases = sampling_of(body, chat)
    req = pb.GenerateRequest(sampling=sampling)
    if chat:
        req.messages.extend(chat_messages(body))
    else:
        completion_prompt(body, req)
    return Translated(req, want_logprobs, stream, include_usage, aliases)
