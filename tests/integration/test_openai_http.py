"""The OpenAI-compatible HTTP API, with the official `openai` client: real in-process prefill and
decode workers (tiny llama, its tokenizer and chat template, local KV transfer) behind the real
router, which serves gRPC and HTTP from one event loop. A greedy answer is the same token for
token whichever door it came through, streamed or not; errors keep OpenAI's shape and the HTTP
status of their gRPC code."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from proto.pdcluster.v1 import inference_pb2 as pb
from router.app import build_router
from tests.helpers import Loop, close, collect, local_pair, stub, wait_until

S = pb.SamplingParams
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def served(tiny_model):
    model = tiny_model("llama")
    prefill, decode, ph, dh = local_pair(model, 64)
    loop = Loop()
    server = build_router(model, [ph], [dh], max_model_len=256, http_port=0)
    loop.run(server.start())
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield server, client, (prefill, decode)
    loop.run(server.stop(1.0))
    close(ph, dh)
    loop.close()


def grpc_chat(server, max_tokens, **sampling):
    ids, text, final = collect(stub(server), pb.GenerateRequest(
        messages=[pb.ChatMessage(**m) for m in MESSAGES], sampling=S(max_tokens=max_tokens, temperature=0, **sampling)))
    return ids, text, final


def test_models_lists_the_served_model(served):
    server, client, _ = served
    models = client.models.list().data
    assert [m.id for m in models] == [server.service.model_id]
    assert client.models.retrieve(server.service.model_id).id == server.service.model_id


def test_streamed_chat_equals_the_grpc_answer(served):
    server, client, workers = served
    _, want_text, want_final = grpc_chat(server, 24, ignore_eos=True)
    stream = client.chat.completions.create(
        model=server.service.model_id, messages=MESSAGES, max_completion_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want_text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    usage = chunks[-1].usage  # include_usage: a last chunk with no choices
    assert chunks[-1].choices == [] and usage.completion_tokens == 24
    assert usage.prompt_tokens == want_final.usage.prompt_tokens
    for w in workers:
        wait_until(lambda w=w: w.core.num_free_pages == w.core.num_pages, 10, 0.01, "pages back")


def test_chat_and_completions_unstreamed_with_logprobs(served):
    server, client, _ = served
    ids, want_text, _ = grpc_chat(server, 8, ignore_eos=True)
    out = client.chat.completions.create(model=server.service.model_id, messages=MESSAGES, max_tokens=8,
                                         temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == want_text and out.choices[0].finish_reason == "length"
    lps = out.choices[0].logprobs.content
    assert len(lps) == 8 and all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in lps)
    assert all(e.top_logprobs[0].logprob >= e.logprob for e in lps)  # greedy: the chosen token is the top one
    prompt = list(range(5, 25))
    want_ids, want, _ = collect(stub(server), pb.GenerateRequest(prompt_token_ids=prompt, sampling=S(
        max_tokens=6, temperature=0, ignore_eos=True)))
    comp = client.completions.create(model=server.service.model_id, prompt=prompt, max_tokens=6, temperature=0,
                                      logprobs=2, extra_body={"ignore_eos": True})
    assert comp.choices[0].text == want and comp.usage.completion_tokens == 6
    assert len(comp.choices[0].logprobs.tokens) == 6
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=server.service.model_id, prompt=prompt, max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == want


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(n=2), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(extra_body={"top_k": -5}), "top_k"),
    (dict(presence_penalty=0.5), "presence_penalty"),
])
def test_an_invalid_request_is_a_400_naming_the_field(served, kwargs, field):
    server, client, _ = served
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=server.service.model_id, messages=MESSAGES, **kwargs)
    assert field in err.value.message
    assert err.value.body["type"] == "invalid_request_error"


def test_an_unknown_model_is_a_404_and_a_full_queue_a_429(served):
    server, client, _ = served
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    assert "no-such-model" in err.value.message
    svc = server.service
    saved = svc.max_inflight, svc.max_queue, svc._running
    svc.max_inflight, svc.max_queue, svc._running = 1, 0, 1  # as if one request held the only slot
    try:
        with pytest.raises(openai.RateLimitError) as err:
            client.chat.completions.create(model=svc.model_id, messages=MESSAGES, max_tokens=2)
        assert "admission queue is full" in err.value.message
    finally:
        svc.max_inflight, svc.max_queue, svc._running = saved


def test_bad_json_and_unknown_routes_keep_the_error_shape(served):
    server, _, _ = served

    def post(path, data: bytes):
        req = urllib.request.Request(server.http_url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=30)
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())
        raise AssertionError("no error")

    code, body = post("/v1/chat/completions", b"{not json")
    assert code == 400 and "not valid JSON" in body["error"]["message"]
    code, body = post("/v1/chat/completions", json.dumps({"messages": "hi"}).encode())
    assert code == 400 and body["error"]["param"] == "messages"
    code, body = post("/v1/embeddings", b"{}")
    assert code == 404 and body["error"]["type"] == "not_found_error"


def test_a_draining_router_answers_503(served):
    server, client, _ = served
    server.service.draining = True
    try:
        with pytest.raises(openai.InternalServerError) as err:
            client.chat.completions.create(model=server.service.model_id, messages=MESSAGES, max_tokens=2)
        assert err.value.status_code == 503 and "draining" in err.value.message
    finally:
        server.service.draining = False


def test_a_client_leaving_mid_stream_ends_the_request_on_its_workers(served):
    """Last in this module: it slows the decode worker down for good."""
    from tests.helpers import slow_steps

    server, client, workers = served
    slow_steps(workers[1], 0.01)  # 200 tokens take seconds: the stream is open when the client leaves
    served_before, failed_before = server.service.served, server.service.failed
    stream = client.chat.completions.create(model=server.service.model_id, messages=MESSAGES, max_tokens=200,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got >= 3:
            break
    stream.close()
    wait_until(lambda: server.service._running == 0, 10, 0.01, "the request ended on the router")
    assert server.service.served == served_before and server.service.failed == failed_before + 1  # cut, not finished
    for w in workers:
        wait_until(lambda w=w: w.core.num_free_pages == w.core.num_pages and not w.has_requests, 10, 0.01,
                   "the request ended on its workers, pages back")
