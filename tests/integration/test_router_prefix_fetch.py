"""The router drives a prefix fetch (`router.fetch_min_pages`): real in-process workers (tiny
llama, local transport; one prefill and one decode worker) behind the real gRPC router. Turn 1
of a conversation is prefilled on the prefill worker and decoded on the decode worker, which then
caches prompt + answer; the prefill worker caches only the prompt. Turn 2 (turn 1's prompt, its
answer and new tokens) goes to the prefill worker, which by the KV index holds 6 leading pages
where the decode worker holds 8: it fetches the 2 it lacks from the decode worker and computes
only the rest. Tokens equal engine.LLM greedy with the fetch on, off, and when the holder fails
to send (the prompt is computed instead, nothing seen by the client)."""
from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from proto.pdcluster.v1 import inference_pb2 as pb
from router.app import build_router
from tests.helpers import Loop, close, collect, local_pair, random_prompts, stub

ANSWER = 30


@pytest.fixture
def cluster(tiny_model):
    made = []

    def make(fetch_min_pages: int):
        model = tiny_model("llama")
        _, _, ph, dh = local_pair(model, 128)
        loop = Loop()
        server = build_router(model, [ph], [dh], max_model_len=256, policy="prefix-aware",
                              fetch_min_pages=fetch_min_pages)
        # the tiny model prefills 32 tokens in about as long as a fetch's fixed cost: without it,
        # the fetch rule (router/fetch_rule.py, tested on its own) would compute them here
        costs = server.service.dispatcher.fetch_costs
        costs.overhead_s, costs.source_overhead_s = 0.0, dict.fromkeys(costs.source_overhead_s, 0.0)
        loop.run(server.start())
        made.append((server, loop, ph, dh))
        return server, model, dh

    yield make
    for server, loop, ph, dh in made:
        loop.run(server.stop(1.0))
        close(ph, dh)
        loop.close()


def two_turns(server, seed=3):
    first, new = random_prompts([100, 10], 256, seed=seed)
    turns, prompt = [], list(first)
    for _ in range(2):
        ids, _, last = collect(stub(server), pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
            max_tokens=ANSWER, temperature=0, ignore_eos=True)))
        turns.append((list(prompt), ids, last))
        prompt = prompt + ids + new
    return turns


def greedy(make_llm, model, prompts):
    llm = make_llm(model, page_size=16, num_pages=256)
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=ANSWER,
                                                                       ignore_eos=True))]


@pytest.mark.parametrize("fetch_min_pages", [0, 2])
def test_turn_2_fetches_the_answer_pages_from_the_decode_worker(cluster, make_llm, fetch_min_pages):
    server, model, _ = cluster(fetch_min_pages)
    turns = two_turns(server)
    assert [ids for _, ids, _ in turns] == greedy(make_llm, model, [p for p, _, _ in turns])
    d = server.service.dispatcher
    cached = turns[1][2].usage.cached_prompt_tokens
    if fetch_min_pages:
        # 100 + 30 answer tokens: 8 full pages cached on the decode worker (all but the last token's KV)
        assert d.fetch_counts == {"fetched": 1, "recomputed": 0} and d.fetched_tokens == 32, d.fetch_counts
        assert cached == 128, cached
        text = __import__("prometheus_client").generate_latest(server.service.metrics.registry).decode()
        assert 'pdcluster_kv_fetches_total{outcome="fetched"} 1.0' in text
        assert "pdcluster_kv_fetched_tokens_total 32.0" in text
    else:
        assert d.fetch_counts == {"fetched": 0, "recomputed": 0} and cached == 96, cached


def test_a_fetch_the_holder_cannot_serve_is_computed_instead(cluster, make_llm):
    server, model, dh = cluster(2)

    async def refuse(fetch, prompt):
        raise RuntimeError("the holder's process is gone")
    dh.export_prefix = refuse
    turns = two_turns(server, seed=4)
    assert [ids for _, ids, _ in turns] == greedy(make_llm, model, [p for p, _, _ in turns])
    d = server.service.dispatcher
    assert d.fetch_counts == {"fetched": 0, "recomputed": 1}, d.fetch_counts
    assert turns[1][2].usage.cached_prompt_tokens == 96
