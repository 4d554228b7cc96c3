"""The OpenAI-compatible HTTP API under arbitrary input (property-based, hypothesis): any JSON
value in any field (known field names and unknown ones), any nesting, any string (lone
surrogates, NUL, long), any number (huge integers, -0.0, big exponents, NaN), raw bodies that
are not JSON, wrong content types; /v1/completions and /v1/chat/completions, streamed and not,
through the real router to real in-process workers (tiny llama, local KV transfer).

Every answer is either a valid one (200 in OpenAI's response shape, or its event stream) or
a 4xx in OpenAI's error shape whose `param` names the field at fault; never a 5xx; and the
server keeps serving, with every page back. PDCLUSTER_FUZZ_EXAMPLES raises the example count
(default 300)."""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.app import build_router
from tests.helpers import Loop, close, local_pair, wait_until

EXAMPLES = int(os.environ.get("PDCLUSTER_FUZZ_EXAMPLES", "300"))
KNOWN = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
         "presence_penalty", "frequency_penalty", "seed", "logprobs", "top_logprobs", "logit_bias", "stream",
         "stream_options", "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "best_of", "echo",
         "suffix", "response_format", "tools", "tool_choice", "user", "metadata", "n", "modalities"]
FIELD_CODES = {"invalid_value", "invalid_type", "unknown_parameter", "unsupported_parameter", "unsupported_value",
               "model_not_found"}

strings = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["\ud800", "a\udfffb", "\x00", "\x00\x00x", "Hello", "user", "assistant", "system", "text",
                     "x" * 20_000, "\U0001f600" * 50, ""]),
)
numbers = st.one_of(
    st.integers(-3, 300), st.integers(), st.sampled_from([10**400, -(10**400), 2**31, 2**63, 2**64, -(2**63) - 1]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([-0.0, 0.0, 1e308, 5e-324, 0.5, 1.0]),
)
leaves = st.one_of(st.none(), st.booleans(), numbers, strings)
values = st.recursive(leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.one_of(st.sampled_from(["role", "content", "type", "text",
                                                                            "include_usage"]), strings),
                                                 inner, max_size=3)), max_leaves=8)
names = st.one_of(st.sampled_from(KNOWN), strings)


@st.composite
def bodies(draw):
    """(path, raw body, content type): a valid request with some fields replaced or added, or
    a raw body."""
    chat = draw(st.booleans())
    path = "/v1/chat/completions" if chat else "/v1/completions"
    kind = draw(st.sampled_from(["fields", "fields", "fields", "fields", "raw", "nested"]))
    ctype = draw(st.sampled_from(["application/json", "application/json", "text/plain", "",
                                  "application/x-www-form-urlencoded"]))
    if kind == "raw":
        return path, draw(st.binary(max_size=200)), ctype, None
    if kind == "nested":
        depth = draw(st.integers(1, 200_000))
        return path, b"{\"prompt\": " + b"[" * depth + b"]" * depth + b"}", ctype, {"prompt": None}
    body = ({"messages": [{"role": "user", "content": "Hello"}]} if chat else {"prompt": "Hello"})
    body.update(max_tokens=2, stream=draw(st.booleans()))
    for name in draw(st.lists(names, max_size=3)):
        body[name] = draw(values)
    if draw(st.booleans()):  # no runaway generations: a valid max_tokens stays small
        mt = body.get("max_tokens")
        if isinstance(mt, int) and not isinstance(mt, bool) and 8 < mt < 2**31:
            body["max_tokens"] = 8
    mct = body.get("max_completion_tokens")
    if isinstance(mct, int) and not isinstance(mct, bool) and 8 < mct < 2**31:
        body["max_completion_tokens"] = 8
    mt = body.get("max_tokens")
    if isinstance(mt, int) and not isinstance(mt, bool) and 8 < mt < 2**31:
        body["max_tokens"] = 8
    return path, json.dumps(body).encode(), ctype, body


@pytest.fixture(scope="module")
def served(tiny_model):
    model = tiny_model("llama")
    prefill, decode, ph, dh = local_pair(model, 64)
    loop = Loop()
    server = build_router(model, [ph], [dh], max_model_len=256, http_port=0)
    loop.run(server.start())
    yield server, (prefill, decode)
    loop.run(server.stop(1.0))
    close(ph, dh)
    loop.close()


def send(server, path: str, data: bytes, ctype: str) -> tuple[int, bytes, str]:
    headers = {"Content-Type": ctype} if ctype else {}
    req = urllib.request.Request(server.http_url + path, data=data, headers=headers)
    if not ctype:
        req.remove_header("Content-type")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read(), r.headers.get("content-type", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers.get("content-type", "")


def check_error(status: int, raw: bytes, body: dict | None) -> None:
    assert 400 <= status < 500, (status, raw[:300])
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["code"], str), err
    if err["code"] in FIELD_CODES:
        assert err["param"] is not None, f"a field error without its field: {err}"
        head = err["param"].split("[", 1)[0].split(".", 1)[0]
        assert body is not None and (err["param"] in body or head in body or head in ("messages", "prompt")), (
            err, body)


def check_answer(raw: bytes, ctype: str, chat: bool) -> None:
    obj = "chat.completion" if chat else "text_completion"
    if ctype.startswith("text/event-stream"):
        events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" in c or c["object"].startswith(obj) for c in chunks), chunks
        assert any(c.get("choices") and c["choices"][0]["finish_reason"] for c in chunks) or "error" in chunks[-1]
    else:
        out = json.loads(raw)
        assert out["object"] == obj and out["choices"][0]["finish_reason"] in ("stop", "length"), out
        assert out["usage"]["completion_tokens"] >= 1


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow,
                                                                        HealthCheck.data_too_large])
@given(case=bodies())
def test_any_body_gets_an_answer_or_a_4xx_naming_the_field(served, case):
    server, _ = served
    path, data, ctype, body = case
    status, raw, rtype = send(server, path, data, ctype)
    if status == 200:
        check_answer(raw, rtype, path.endswith("chat/completions"))
    else:
        check_error(status, raw, body)


def test_the_server_still_serves_after_the_fuzz(served):
    server, workers = served
    status, raw, _ = send(server, "/v1/completions", json.dumps({"prompt": "Hello", "max_tokens": 3}).encode(),
                          "application/json")
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3
    with urllib.request.urlopen(server.http_url + "/v1/models", timeout=10) as r:
        assert json.loads(r.read())["data"][0]["id"] == server.service.model_id
    for w in workers:
        wait_until(lambda w=w: w.core.num_free_pages == w.core.num_pages and not w.has_requests, 10, 0.01,
                   "pages back")
