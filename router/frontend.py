"""The request's first stop in the router: validate every field of a `GenerateRequest`, turn
its input (prompt text, token ids or chat messages) into token ids once, and compute the
prompt's chained block hashes (the engine's own function, so they match the workers').

Every rejection is a `RequestError` naming the field and the allowed range; the gRPC layer
maps its `code` to the status.
"""
from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc

from engine.block_hash import page_hashes
from engine.sampling_params import MAX_LOGPROBS, SEED_MAX, SEED_MIN, SamplingParams
from proto.pdcluster.v1 import inference_pb2 as pb

CHAT_ROLES = ("system", "user", "assistant", "tool")
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class RequestError(Exception):
    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
        super().__init__(message)
        self.code = code


CHARS_PER_TOKEN = 32  # a prompt of max_model_len tokens is never longer than this many characters a token


@dataclass(slots=True, frozen=True)
class FrontendLimits:
    max_prompt_chars: int = 1 << 20  # further capped at CHARS_PER_TOKEN x max_model_len
    max_messages: int = 256
    max_stop: int = 16
    max_stop_chars: int = 256
    max_stop_token_ids: int = 64
    default_max_tokens: int = 16

    def prompt_chars(self, max_model_len: int) -> int:
        """The longest prompt text worth tokenizing: one longer cannot fit the context."""
        return min(self.max_prompt_chars, CHARS_PER_TOKEN * max_model_len)

    def request_bytes(self, max_model_len: int) -> int:
        """The largest request message the server takes: the longest text (UTF-8, up to 4 bytes
        a character) or token-id list (up to 10 bytes an id) that can fit the context, the
        stop strings, and room for the other fields. Larger ones are refused by gRPC itself
        (RESOURCE_EXHAUSTED) before a byte of them is parsed."""
        text = 4 * self.prompt_chars(max_model_len) + 16 * self.max_messages
        ids = 10 * max_model_len
        stops = 4 * self.max_stop * self.max_stop_chars + 10 * self.max_stop_token_ids
        return max(text, ids) + stops + (64 << 10)


@dataclass(slots=True)
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_hashes: list[int]
    decode_worker: str = ""  # pinned by the client; checked against the cluster by the dispatcher


class Frontend:
    """Owns the tokenizer; `prepare` is pure apart from it."""

    def __init__(self, model_dir: Path, tokenizer, *, vocab_size: int, max_model_len: int,
                 hash_page_size: int, limits: FrontendLimits | None = None) -> None:
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.hash_page_size = hash_page_size
        self.limits = limits or FrontendLimits()

    @classmethod
    def from_model(cls, model: str | Path, *, hash_page_size: int, max_model_len: int | None = None,
                   limits: FrontendLimits | None = None) -> Frontend:
        from engine.checkpoint import find_model
        from engine.config import ModelConfig
        from router.tokenizer import RouterTokenizer

        model_dir = find_model(model)
        cfg = ModelConfig.from_pretrained(model_dir)
        tok = RouterTokenizer(model_dir)
        return cls(model_dir, tok, vocab_size=cfg.vocab_size,
                   max_model_len=max_model_len or cfg.max_position_embeddings,
                   hash_page_size=hash_page_size, limits=limits)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    # ---- input -> token ids ---------------------------------------------------------------
    def render_messages(self, messages) -> str:
        lim = self.limits
        if len(messages) > lim.max_messages:
            raise RequestError(f"messages has {len(messages)} entries; at most {lim.max_messages} allowed")
        total = sum(len(m.content) for m in messages)
        if total > lim.prompt_chars(self.max_model_len):
            raise RequestError(f"messages have {total} characters of content; at most "
                               f"{lim.prompt_chars(self.max_model_len)} allowed (max_model_len={self.max_model_len})")
        chat = []
        for i, m in enumerate(messages):
            if m.role not in CHAT_ROLES:
                raise RequestError(f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {m.role!r}")
            if not m.content:
                raise RequestError(f"messages[{i}].content must be a non-empty string")
            chat.append({"role": m.role, "content": m.content})
        if not self.has_chat_template:
            raise RequestError("messages need a chat template and this model has none: send prompt or prompt_token_ids",
                               grpc.StatusCode.FAILED_PRECONDITION)
        try:
            return self.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
        except Exception as exc:  # the template's own raise_exception, or a template error
            raise RequestError(f"messages: the model's chat template refused them: {exc}") from exc

    def encode(self, text: str, field: str = "prompt") -> list[int]:
        limit = self.limits.prompt_chars(self.max_model_len)
        if len(text) > limit:
            raise RequestError(f"{field} has {len(text)} characters; at most {limit} allowed (max_model_len="
                               f"{self.max_model_len} tokens)")
        return self.tokenizer.encode(text)

    def tokens_of(self, request) -> tuple[list[int], str]:
        """Token ids of a GenerateRequest's (or TokenizeRequest's) input, and the rendered text."""
        given = [name for name, present in (("prompt", bool(request.prompt)),
                                            ("prompt_token_ids", bool(getattr(request, "prompt_token_ids", ()))),
                                            ("messages", bool(request.messages))) if present]
        if not given:
            raise RequestError("exactly one of prompt, prompt_token_ids, messages must be set; none was")
        if len(given) > 1:
            raise RequestError(f"exactly one of prompt, prompt_token_ids, messages must be set; got {given}")
        if given[0] == "prompt":
            ids, rendered = self.encode(request.prompt), request.prompt
        elif given[0] == "messages":
            rendered = self.render_messages(request.messages)
            ids = self.encode(rendered, "messages")
        else:
            if len(request.prompt_token_ids) >= self.max_model_len:  # before looking at any id
                raise RequestError(f"the prompt has {len(request.prompt_token_ids)} tokens; it must be shorter than "
                                   f"max_model_len={self.max_model_len}")
            ids, rendered = list(request.prompt_token_ids), ""
            if max(ids, default=0) >= self.vocab_size:
                i = next(i for i, t in enumerate(ids) if t >= self.vocab_size)
                raise RequestError(f"prompt_token_ids[{i}] = {ids[i]} is out of range [0, {self.vocab_size})")
        if not ids:
            raise RequestError(f"{given[0]} tokenizes to no tokens")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; it must be shorter than max_model_len="
                               f"{self.max_model_len}")
        return ids, rendered

    # ---- sampling -------------------------------------------------------------------------
    def sampling_params(self, s: pb.SamplingParams, prompt_len: int) -> SamplingParams:
        lim = self.limits
        kw: dict[str, object] = {}
        if s.HasField("max_tokens"):
            if s.max_tokens < 1:
                raise RequestError(f"sampling.max_tokens must be >= 1, got {s.max_tokens}")
            kw["max_tokens"] = s.max_tokens
        else:
            kw["max_tokens"] = lim.default_max_tokens
        if prompt_len + int(kw["max_tokens"]) > self.max_model_len:
            raise RequestError(f"prompt ({prompt_len} tokens) + sampling.max_tokens ({kw['max_tokens']}) must be "
                               f"<= max_model_len={self.max_model_len}")
        for name, lo, hi, lo_open in (("temperature", 0.0, math.inf, False), ("top_p", 0.0, 1.0, True),
                                      ("min_p", 0.0, 1.0, False)):
            if s.HasField(name):
                v = getattr(s, name)
                bad = not math.isfinite(v) or v > hi or (v <= lo if lo_open else v < lo)
                if bad:
                    rng = {"temperature": "[0, inf) (0 = greedy)", "top_p": "(0, 1]", "min_p": "[0, 1]"}[name]
                    raise RequestError(f"sampling.{name} must be in {rng}, got {v}")
                kw[name] = float(v)
        if s.HasField("top_k"):
            if s.top_k < -1:
                raise RequestError(f"sampling.top_k must be -1 or 0 (off) or >= 1, got {s.top_k}")
            kw["top_k"] = s.top_k
        if s.HasField("seed"):
            if not SEED_MIN <= s.seed <= SEED_MAX:
                raise RequestError(f"sampling.seed must be in [-2**63, 2**64 - 1], got {s.seed}")
            kw["seed"] = s.seed
        if len(s.stop) > lim.max_stop:
            raise RequestError(f"sampling.stop has {len(s.stop)} strings; at most {lim.max_stop} allowed")
        for i, st in enumerate(s.stop):
            if not st or len(st) > lim.max_stop_chars:
                raise RequestError(f"sampling.stop[{i}] must have 1 to {lim.max_stop_chars} characters, "
                                   f"got {len(st)}")
        kw["stop"] = list(s.stop)
        if len(s.stop_token_ids) > lim.max_stop_token_ids:
            raise RequestError(f"sampling.stop_token_ids has {len(s.stop_token_ids)} ids; at most "
                               f"{lim.max_stop_token_ids} allowed")
        for i, t in enumerate(s.stop_token_ids):
            if t >= self.vocab_size:
                raise RequestError(f"sampling.stop_token_ids[{i}] = {t} is out of range [0, {self.vocab_size})")
        kw["stop_token_ids"] = list(s.stop_token_ids)
        if s.HasField("ignore_eos"):
            kw["ignore_eos"] = s.ignore_eos
        if s.HasField("logprobs"):
            if not 0 <= s.logprobs <= MAX_LOGPROBS:
                raise RequestError(f"sampling.logprobs must be in [0, {MAX_LOGPROBS}], got {s.logprobs}")
            kw["logprobs"] = s.logprobs
        try:
            return SamplingParams(**kw)
        except ValueError as exc:  # the engine's own check, should the ranges above drift
            raise RequestError(f"sampling: {exc}") from exc

    # ---- the whole request ----------------------------------------------------------------
    def prepare(self, request: pb.GenerateRequest) -> PreparedRequest:
        rid = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        if not REQUEST_ID_RE.match(rid):
            raise RequestError("request_id must be 1 to 128 characters of [A-Za-z0-9._:-], got "
                               f"{request.request_id[:40]!r}")
        ids, _ = self.tokens_of(request)
        params = self.sampling_params(request.sampling, len(ids))
        return PreparedRequest(rid, ids, params, page_hashes(ids, self.hash_page_size), request.decode_worker)
