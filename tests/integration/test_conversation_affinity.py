"""A conversation's later turns go to the decode worker that holds it: real in-process workers
(tiny llama, local transport; one prefill worker, two decode workers with
`local_prefill_threshold` 48) behind the real gRPC router with the prefix-aware policy. Turn
1's prompt (100 tokens) is too long to prefill on a decode worker: the prefill worker builds it
and sends it. Turn 2 is turn 1's prompt + its answer + 10 new tokens: the decode worker that
decoded turn 1 caches all of it but the new part (its KV index says so, and the router expects
the answer's pages the moment the answer ends), so the router places turn 2 there and that
worker prefills only the new tokens, with no transfer; on the other decode worker, the whole
prompt would be uncached. Two conversations at once take the two decode workers and stay on
them. Tokens equal engine.LLM greedy for every turn; every page is free after."""
from __future__ import annotations

import threading

import pytest

from decode_worker import DecodeWorker
from decode_worker.types import DecodeConfig
from kv_transfer.config import TransferConfig
from kv_transfer.local import LocalHub
from prefill_worker.worker import PrefillWorker
from proto.pdcluster.v1 import inference_pb2 as pb
from router.app import build_router
from tests.helpers import ENGINE, Loop, close, collect, in_process, random_prompts, stub

THRESHOLD = 48
ANSWER = 30
NEW = 10


@pytest.fixture(params=[0.1, 300.0], ids=["refresh-0.1s", "refresh-300s"])
def cluster(request, tiny_model):
    model = tiny_model("llama")
    hub = LocalHub()
    cfg = TransferConfig(deadline_s=20)
    kw = dict(transport="local", transfer_config=cfg, transport_kwargs={"hub": hub}, page_size=16, num_pages=128,
              **ENGINE)
    prefill = PrefillWorker(model, **kw)
    decodes = [DecodeWorker(model, config=DecodeConfig(local_prefill_threshold=THRESHOLD), **kw) for _ in range(2)]
    ph = in_process(prefill, "prefill-0", "prefill")
    dhs = [in_process(d, f"decode-{i}", "decode") for i, d in enumerate(decodes)]
    loop = Loop()
    server = build_router(model, [ph], dhs, max_model_len=256, policy="prefix-aware")
    # at 300 s, loads and KV events are pulled at start-up only: what the router knows of an
    # answer's pages is what it expects when the answer ends (a next turn may come before a pull)
    server.load_refresh_s = request.param
    loop.run(server.start())
    yield server, model
    loop.run(server.stop(1.0))
    close(ph, *dhs)
    loop.close()


def turn(server, prompt):
    ids, _, last = collect(stub(server), pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
        max_tokens=ANSWER, temperature=0, ignore_eos=True)))
    return ids, last


def check(llm, turns):
    """Greedy tokens of every turn equal engine.LLM's; turn 1 was built by the prefill worker;
    every later turn went to turn 1's decode worker and was prefilled there, only its new part."""
    from engine.sampling_params import SamplingParams

    want = llm.generate([p for p, *_ in turns], SamplingParams(temperature=0, max_tokens=ANSWER, ignore_eos=True))
    assert [ids for _, ids, *_ in turns] == [w.token_ids for w in want]
    first = turns[0][2]
    assert first.prefill_worker == "prefill-0" and not first.local_prefill, first
    for prompt, _, placement, cached in turns[1:]:
        assert placement.decode_worker == first.decode_worker and placement.local_prefill, placement
        assert placement.prefill_worker == "" and len(prompt) - cached < THRESHOLD, (len(prompt), cached)


def conversation(server, first, news):
    prompt, turns = list(first), []
    for new in news:
        ids, last = turn(server, prompt)
        turns.append((list(prompt), ids, last.placement, last.usage.cached_prompt_tokens))
        prompt = prompt + ids + new
    return turns


def test_later_turns_go_to_the_decode_worker_that_holds_the_conversation(cluster, make_llm):
    server, model = cluster
    llm = make_llm(model, page_size=16, num_pages=256)
    # one conversation alone: by load alone, turn 2 would go to the other (idle) decode worker
    one = conversation(server, random_prompts([100], 256, seed=7)[0], random_prompts([NEW] * 3, 256, seed=8))
    check(llm, one)
    # two conversations at once: spread over the two decode workers, each staying on its own
    firsts, news = random_prompts([100, 100], 256, seed=9), random_prompts([NEW] * 4, 256, seed=10)
    got = {}
    threads = [threading.Thread(target=lambda c=c: got.__setitem__(c, conversation(server, firsts[c],
                                                                                  news[2 * c:2 * c + 2])))
               for c in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for c in (0, 1):
        check(llm, got[c])
    assert {got[0][0][2].decode_worker, got[1][0][2].decode_worker} == {"decode-0", "decode-1"}
