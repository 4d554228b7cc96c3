"""The router's gRPC server in one process, in front of real prefill and decode workers over
the `local` transport: greedy streams equal engine.LLM, every kind of bad request gets its
status code (and the server serves afterwards), a full queue is RESOURCE_EXHAUSTED, cancel
and deadline free the pages on both workers, a failed prefill is retried on another worker,
health and reflection answer."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine.load import WorkerLoad
from engine.sampling_params import SamplingParams
from proto.pdcluster.v1 import inference_pb2 as pb
from router.app import build_router
from tests.helpers import random_prompts
from tests.helpers import Loop, close, collect, local_pair, stub, wait_free

S = pb.SamplingParams


class FlakyPrefill:
    """A fault-injecting stand-in for a prefill worker's handle, named so: its worker 'dies'
    before the first token."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id, self.pool, self.role, self.calls = worker_id, "prefill", "prefill", 0
        self.last_output, self.on_lost = 0.0, None  # (router.handles.WorkerHandle's liveness and loss hook)

    def fence(self, exc):
        return 0

    async def unfence(self):
        return []

    async def submit(self, task):
        if not task.request_id.startswith("warm-up"):  # the router warms a lost worker up before placing on it
            self.calls += 1
        raise ConnectionError("prefill worker died")

    async def cancel(self, request_id):
        return False

    async def load(self):
        return WorkerLoad(free_pages=64, total_pages=64)

    async def close(self):
        pass

    def take_lost(self):
        return None


@pytest.fixture(scope="module")
def router(tiny_model):
    model = tiny_model("llama")
    prefill, decode, ph, dh = local_pair(model, 128)
    loop = Loop()
    main = loop.run(_start(model, [ph], [dh], policy="prefix-aware", max_model_len=256))
    tiny_queue = loop.run(_start(model, [ph], [dh], max_inflight=1, max_queue=0, max_model_len=256))
    flaky = FlakyPrefill("prefill-flaky")
    retrying = loop.run(_start(model, [flaky, ph], [dh], policy="round-robin", max_model_len=256))
    servers = dict(main=main, tiny_queue=tiny_queue, retrying=retrying, flaky=flaky, model=model, loop=loop,
                   workers=(prefill, decode))
    yield servers
    for s in (main, tiny_queue, retrying):
        loop.run(s.stop(1.0))
    close(ph, dh)
    loop.close()


async def _start(model, prefills, decodes, **kw):
    server = build_router(model, prefills, decodes, **kw)
    await server.start()
    return server


def test_concurrent_greedy_streams_match_llm(router, make_llm):
    model = router["model"]
    prompts = random_prompts([3, 17, 40, 64, 9, 33, 80, 120], 256, seed=3)
    want = make_llm(model, page_size=16, num_pages=128).generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    s = stub(router["main"])
    req = lambda p: pb.GenerateRequest(prompt_token_ids=p, sampling=S(max_tokens=12, temperature=0, ignore_eos=True))
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: collect(s, req(p)), prompts))
    for (ids, text, last), w in zip(got, want):
        assert ids == w.token_ids
        assert text == w.text
        assert last.finish_reason == "length"
        assert last.usage.completion_tokens == 12 and last.usage.prompt_tokens == len(w.prompt_token_ids)
        assert last.placement.prefill_worker == "prefill-0" and last.placement.decode_worker == "decode-0"
        assert last.timings.ttft_s > 0 and last.timings.e2e_s >= last.timings.ttft_s
    # a text prompt and a chat prompt: tokenized once by the router, same tokens as the engine
    llm = make_llm(model, page_size=16, num_pages=128)
    ids, text, _ = collect(s, pb.GenerateRequest(prompt="The prefill pool", sampling=S(max_tokens=8, temperature=0)))
    assert ids == llm.generate("The prefill pool", SamplingParams(temperature=0, max_tokens=8))[0].token_ids
    tok = s.Tokenize(pb.TokenizeRequest(messages=[pb.ChatMessage(role="user", content="hi")]))
    assert "<|im_start|>user" in tok.rendered and tok.token_ids
    ids, _, last = collect(s, pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi")],
                                                  sampling=S(max_tokens=5, temperature=0, ignore_eos=True)))
    assert ids == llm.generate(list(tok.token_ids), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].token_ids
    info = s.ModelInfo(pb.ModelInfoRequest())
    assert info.vocab_size == 2048 and info.has_chat_template and info.max_model_len == 256
    wait_free(s)


BAD = [
    ("no input", dict(), grpc.StatusCode.INVALID_ARGUMENT, "exactly one"),
    ("two inputs", dict(prompt="a", prompt_token_ids=[1]), grpc.StatusCode.INVALID_ARGUMENT, "exactly one"),
    ("token id >= vocab", dict(prompt_token_ids=[1, 99999]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids[1]"),
    ("prompt too long", dict(prompt_token_ids=[1] * 300), grpc.StatusCode.INVALID_ARGUMENT, "max_model_len"),
    ("prompt + max_tokens too long", dict(prompt_token_ids=[1] * 200, sampling=S(max_tokens=100)),
     grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens"),
    ("max_tokens 0", dict(prompt="a", sampling=S(max_tokens=0)), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be >= 1"),
    ("max_tokens negative", dict(prompt="a", sampling=S(max_tokens=-3)), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    ("temperature negative", dict(prompt="a", sampling=S(temperature=-0.5)), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("temperature nan", dict(prompt="a", sampling=S(temperature=float("nan"))), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("temperature inf", dict(prompt="a", sampling=S(temperature=float("inf"))), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("top_p 0", dict(prompt="a", sampling=S(top_p=0)), grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1]"),
    ("top_p > 1", dict(prompt="a", sampling=S(top_p=1.5)), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ("top_k < -1", dict(prompt="a", sampling=S(top_k=-2)), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
    ("min_p > 1", dict(prompt="a", sampling=S(min_p=1.5)), grpc.StatusCode.INVALID_ARGUMENT, "min_p"),
    ("min_p negative", dict(prompt="a", sampling=S(min_p=-0.1)), grpc.StatusCode.INVALID_ARGUMENT, "min_p"),
    ("logprobs > 20", dict(prompt="a", sampling=S(logprobs=21)), grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
    ("logprobs negative", dict(prompt="a", sampling=S(logprobs=-1)), grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
    ("empty stop string", dict(prompt="a", sampling=S(stop=["x", ""])), grpc.StatusCode.INVALID_ARGUMENT, "stop[1]"),
    ("too many stop strings", dict(prompt="a", sampling=S(stop=["s"] * 17)), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    ("stop token >= vocab", dict(prompt="a", sampling=S(stop_token_ids=[5, 4096])), grpc.StatusCode.INVALID_ARGUMENT,
     "stop_token_ids[1]"),
    ("bad chat role", dict(messages=[pb.ChatMessage(role="robot", content="x")]), grpc.StatusCode.INVALID_ARGUMENT,
     "messages[0].role"),
    ("empty chat content", dict(messages=[pb.ChatMessage(role="user", content="")]), grpc.StatusCode.INVALID_ARGUMENT,
     "messages[0].content"),
    ("bad request_id", dict(request_id="has space", prompt="a"), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    ("request_id too long", dict(request_id="r" * 200, prompt="a"), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    # cheap size checks before any per-id or tokenizer work (max_model_len 256: 8,192 characters)
    ("far too many ids", dict(prompt_token_ids=[99999] * 5000), grpc.StatusCode.INVALID_ARGUMENT, "max_model_len"),
    ("prompt text too long", dict(prompt="word " * 2000), grpc.StatusCode.INVALID_ARGUMENT, "at most 8192"),
    ("chat content too long", dict(messages=[pb.ChatMessage(role="user", content="x" * 9000)]),
     grpc.StatusCode.INVALID_ARGUMENT, "at most 8192"),
    ("message larger than the request limit", dict(prompt="x" * (1 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED,
     "larger than max"),
]


def raw_generate(server, payload: bytes) -> grpc.RpcError:
    """A Generate call with hand-made request bytes; the error it ends with."""
    channel = grpc.insecure_channel(server.address)
    call = channel.unary_stream("/pdcluster.v1.Inference/Generate", request_serializer=lambda b: b,
                                response_deserializer=pb.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as err:
        list(call(payload, timeout=30))
    return err.value


def test_strings_that_are_not_utf8_are_invalid_argument_naming_the_field(router):
    def corrupt(req: pb.GenerateRequest, needle: bytes) -> bytes:
        data = bytearray(req.SerializeToString())
        data[data.index(needle)] = 0xFF
        return bytes(data)

    cases = [(pb.GenerateRequest(prompt="hello"), b"hello", "prompt must be valid UTF-8"),
             (pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi"),
                                           pb.ChatMessage(role="user", content="zzzq")]), b"zzzq",
              "messages[1].content must be valid UTF-8"),
             (pb.GenerateRequest(prompt="a", sampling=S(stop=["ok", "qqqq"])), b"qqqq", "sampling.stop[1]")]
    for req, needle, message in cases:
        err = raw_generate(router["main"], corrupt(req, needle))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.details(), err.details()
    err = raw_generate(router["main"], b"\xff\xff\xff")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid pdcluster.v1.GenerateRequest" in err.details()
    ids, _, last = collect(stub(router["main"]), pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=S(max_tokens=3, ignore_eos=True)))
    assert len(ids) == 3 and last.finish_reason == "length"


def test_bad_requests_get_status_codes_then_server_serves(router):
    s = stub(router["main"])
    for name, fields, code, needle in BAD:
        with pytest.raises(grpc.RpcError) as err:
            list(s.Generate(pb.GenerateRequest(**fields), timeout=30))
        assert err.value.code() == code, (name, err.value.code(), err.value.details())
        assert needle in err.value.details(), (name, err.value.details())
    with pytest.raises(grpc.RpcError) as err:  # Tokenize validates the same way
        s.Tokenize(pb.TokenizeRequest())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # a request_id already in flight
    slow = s.Generate(pb.GenerateRequest(request_id="dup", prompt_token_ids=[1, 2, 3],
                                         sampling=S(max_tokens=200, temperature=0, ignore_eos=True)), timeout=60)
    next(slow)
    with pytest.raises(grpc.RpcError) as err:
        list(s.Generate(pb.GenerateRequest(request_id="dup", prompt="a"), timeout=30))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    slow.cancel()
    ids, _, last = collect(s, pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=S(max_tokens=4, temperature=0)))
    assert len(ids) >= 1 and last.finish_reason in ("stop", "length")
    assert len(BAD) + 2 >= 24
    wait_free(s)


def test_full_queue_is_resource_exhausted(router):
    s = stub(router["tiny_queue"])
    long_req = pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=S(max_tokens=200, temperature=0, ignore_eos=True))
    first = s.Generate(long_req, timeout=60)
    next(first)
    with pytest.raises(grpc.RpcError) as err:
        list(s.Generate(pb.GenerateRequest(prompt="a"), timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queue" in err.value.details()
    first.cancel()
    st = wait_free(s)
    assert all(w.free_pages == w.total_pages for w in st.workers), st


def test_cancel_and_deadline_free_pages_on_both_workers(router):
    s = stub(router["main"])
    call = s.Generate(pb.GenerateRequest(prompt_token_ids=list(range(1, 60)),
                                         sampling=S(max_tokens=190, temperature=0, ignore_eos=True)), timeout=60)
    next(call)
    call.cancel()
    st = wait_free(s)
    assert all(w.free_pages == w.total_pages for w in st.workers), st
    with pytest.raises(grpc.RpcError) as err:
        # 250 tokens, the most max_model_len allows, take ~0.5-1.3 s here: a 0.1 s deadline
        # expires mid-request (0.5 s did not always: an idle machine finished 190 tokens first)
        list(s.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2, 3, 4, 5],
                                           sampling=S(max_tokens=250, temperature=0, ignore_eos=True)), timeout=0.1))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    st = wait_free(s)
    assert all(w.free_pages == w.total_pages for w in st.workers), st
    assert {w.role for w in st.workers} == {"prefill", "decode"}


def test_failed_prefill_is_retried_on_another_worker(router, make_llm):
    s = stub(router["retrying"])
    prompt = random_prompts([20], 256, seed=9)[0]
    ids, _, last = collect(s, pb.GenerateRequest(prompt_token_ids=prompt,
                                                 sampling=S(max_tokens=6, temperature=0, ignore_eos=True)))
    assert router["flaky"].calls == 1
    assert last.placement.attempts == 2 and last.placement.prefill_worker == "prefill-0"
    want = make_llm(router["model"], page_size=16, num_pages=64).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert ids == want.token_ids
    wait_free(stub(router["main"]))


def test_health_serving_and_reflection_lists_service(router):
    ch = grpc.insecure_channel(router["main"].address)
    assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="pdcluster.v1.Inference")).status \
        == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
    resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {svc.name for svc in resp.list_services_response.service}
    assert "pdcluster.v1.Inference" in names and "grpc.health.v1.Health" in names
    assert "grpc.reflection.v1.ServerReflection" in names
    # v1 (current grpcurl asks it first): the same messages on the wire under another service name
    v1 = ch.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                          request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                          response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    resp = next(v1(iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol="pdcluster.v1.Inference")])))
    assert resp.file_descriptor_response.file_descriptor_proto  # the .proto, for tools without the file


def test_first_token_is_sent_from_the_prefill_result(router, make_llm):
    """TTFT ends when the prefill worker samples the first token, not when its KV lands."""
    s = stub(router["main"])
    prompt = random_prompts([64], 256, seed=11)[0]
    chunks = list(s.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=S(max_tokens=4, temperature=0,
                                                                                    ignore_eos=True)), timeout=60))
    t = chunks[-1].timings
    assert len(chunks[0].token_ids) == 1
    # the first chunk carries its token's text too, and the text adds up to the colocated run's
    colocated = make_llm(router["model"], page_size=16, num_pages=128).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert chunks[0].text and colocated.text.startswith(chunks[0].text)
    assert "".join(c.text for c in chunks) == colocated.text
    assert t.transfer_s > 0 and t.ttft_s + t.transfer_s <= t.e2e_s
    assert t.ttft_s <= t.queue_s + t.prefill_s + 0.25  # admission only; no transfer inside TTFT
    # a first token that ends the request: one token, exactly one final chunk
    want = make_llm(router["model"], page_size=16, num_pages=128).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=1))[0]
    chunks = list(s.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=S(max_tokens=1, temperature=0)),
                             timeout=60))
    assert [i for c in chunks for i in c.token_ids] == want.token_ids
    assert "".join(c.text for c in chunks) == want.text
    assert sum(1 for c in chunks if c.finish_reason) == 1 and chunks[-1].usage.completion_tokens == 1


def test_logprobs_match_llm(router, make_llm):
    """Every token's logprobs (the first from the prefill worker, the rest from the decode
    worker) equal the colocated engine's."""
    prompt = random_prompts([40], 256, seed=5)[0]
    want = make_llm(router["model"], page_size=16, num_pages=128).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True))[0]
    chunks = list(stub(router["main"]).Generate(pb.GenerateRequest(
        prompt_token_ids=prompt, sampling=S(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)), timeout=60))
    for c in chunks:
        assert len(c.logprobs) == len(c.token_ids)
    got = [lp for c in chunks for lp in c.logprobs]
    assert [lp.token_id for lp in got] == want.token_ids and len(want.logprobs) == 6
    for g, w in zip(got, want.logprobs):
        assert g.token_id == w.token_id and g.rank == w.rank
        assert abs(g.logprob - w.logprob) < 1e-4
        assert [t.token_id for t in g.top] == [t for t, _ in w.top]
        assert all(abs(t.logprob - v) < 1e-4 for t, (_, v) in zip(g.top, w.top))


def test_warm_up_runs_every_pair_before_serving(router):
    """With warm_up, start() has sent one request through the prefill/decode pair (its
    transfer handshake done) before health says SERVING, and left every page free."""
    prefill, decode = router["workers"]
    before = prefill.num_prefilled
    main = router["main"]
    dispatcher = main.service.dispatcher
    server = router["loop"].run(_start(router["model"], list(dispatcher.prefills.values()),
                                       list(dispatcher.decodes.values()), max_model_len=256, warm_up=True))
    try:
        assert prefill.num_prefilled == before + 1
        st = wait_free(stub(server))
        assert all(w.free_pages == w.total_pages for w in st.workers), st
        ids, _, last = collect(stub(server), pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=S(
            max_tokens=3, temperature=0, ignore_eos=True)))
        assert len(ids) == 3 and last.usage.cached_prompt_tokens == 0
    finally:
        router["loop"].run(server.stop(1.0))
