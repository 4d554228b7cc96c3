"""Sampling requests over the whole wire range, served (property-based, hypothesis): every
SamplingParams a client can encode, admitted values and refused ones alike, sent through the
real gRPC router to real in-process prefill and decode workers (tiny llama, local KV transfer).
An admitted request streams tokens in range within max_tokens; a refused one gets
INVALID_ARGUMENT naming the field; no request gets any other code, and the cluster keeps
serving with every page back."""
from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from proto.pdcluster.v1 import inference_pb2 as pb
from router.app import build_router
from tests.helpers import Loop, close, collect, local_pair, stub, wait_until

VOCAB = 2048  # the tiny model's
MAX_MODEL_LEN = 256
F32 = 3.4028234663852886e38

floats32 = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.sampled_from([0.0, -0.0, 1.0, 1e-45, 1e-38, F32, -1.0, 0.5, 1.0000001]),
)
sampling = st.fixed_dictionaries({}, optional={
    "max_tokens": st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(1, 6)),
    "temperature": floats32,
    "top_p": floats32,
    "top_k": st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(-2, VOCAB + 2)),
    "min_p": floats32,
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.lists(st.text(max_size=8), max_size=3),
    "stop_token_ids": st.lists(st.one_of(st.integers(0, VOCAB + 5), st.integers(0, 2**32 - 1)), max_size=3),
    "ignore_eos": st.booleans(),
    "logprobs": st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(-1, 21)),
})
prompts = st.one_of(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
                    st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=3))


@pytest.fixture(scope="module")
def served(tiny_model):
    model = tiny_model("llama")
    prefill, decode, ph, dh = local_pair(model, 64)
    loop = Loop()
    server = build_router(model, [ph], [dh], max_model_len=MAX_MODEL_LEN)
    loop.run(server.start())
    yield server, (prefill, decode)
    loop.run(server.stop(1.0))
    close(ph, dh)
    loop.close()


def field_named(details: str) -> bool:
    names = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "logprobs",
             "prompt_token_ids", "prompt")
    return any(n in details for n in names)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(prompt=prompts, s=sampling)
def test_every_wire_value_is_served_or_refused_naming_its_field(served, prompt, s):
    server, workers = served
    s = dict(s)
    if s.get("max_tokens", 0) > 6:  # keep admitted runs short; large values stay for the refusals
        s["max_tokens"] = s["max_tokens"] if s["max_tokens"] > MAX_MODEL_LEN else 6
    req = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(**s))
    try:
        ids, _, final = collect(stub(server), req, timeout=60)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details(), s)
        assert field_named(exc.details()), exc.details()
        event("refused")
        return
    event("served")
    assert all(0 <= t < VOCAB for t in ids)
    assert 1 <= len(ids) <= s.get("max_tokens", 16) and final.usage.completion_tokens == len(ids)
    t = s.get("temperature", 1.0)
    assert math.isfinite(t) and t >= 0  # only finite temperatures are admitted
    if s.get("logprobs") is not None:
        assert 0 <= s["logprobs"] <= 20


def test_the_cluster_still_serves_with_every_page_back(served):
    server, workers = served
    ids, _, _ = collect(stub(server), pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=pb.SamplingParams(
        max_tokens=4, temperature=0, ignore_eos=True)))
    assert len(ids) == 4
    for w in workers:
        wait_until(lambda w=w: w.core.num_free_pages == w.core.num_pages, 10, 0.01, "every page back")
