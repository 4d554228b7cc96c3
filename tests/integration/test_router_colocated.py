"""Placement on colocated workers (each prefills its own prompts): with the prefix-aware policy a
prompt goes to the worker whose prefix cache already holds its first pages, and a burst is
spread by queued prompt tokens. Real in-process workers (tiny llama) behind the real gRPC router.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from decode_worker import DecodeWorker
from proto.pdcluster.v1 import inference_pb2 as pb
from router.app import build_router
from tests.helpers import random_prompts
from tests.helpers import ENGINE, Loop, close, collect, hold_engine_thread, in_process, stub

S = pb.SamplingParams


@pytest.fixture
def colocated(tiny_model, request):
    model = tiny_model("llama")
    workers, handles = [], []
    for i in range(2):
        w = DecodeWorker(model, transport=None, page_size=16, num_pages=64, **ENGINE)  # colocated: no connector
        workers.append(w)
        handles.append(in_process(w, f"colocated-{i}", "colocated"))
    loop = Loop()
    server = build_router(model, [], handles, max_model_len=256, policy=request.param)
    loop.run(server.start())
    yield server, workers
    loop.run(server.stop(1.0))
    close(*handles)
    loop.close()


def ask(server, prompt):
    _, _, last = collect(stub(server), pb.GenerateRequest(prompt_token_ids=prompt, sampling=S(
        max_tokens=3, temperature=0, ignore_eos=True)))
    return last.placement.decode_worker, last.usage.cached_prompt_tokens


@pytest.mark.parametrize("colocated", ["prefix-aware"], indirect=True)
def test_shared_prefix_goes_to_the_worker_that_cached_it(colocated):
    """Before: colocated placement was least-loaded only, so the second prompt of a
    conversation went to the other (idle, less placed) worker and prefilled its prefix again."""
    server, workers = colocated
    prefix = random_prompts([96], 256, seed=21)[0]
    a, b = random_prompts([20, 20], 256, seed=22)
    first, cached0 = ask(server, prefix + a)
    second, cached1 = ask(server, prefix + b)
    assert cached0 == 0
    assert second == first and cached1 == 96  # six full pages of the prefix served from cache
    third, _ = ask(server, random_prompts([40], 256, seed=23)[0])  # no shared prefix: the other worker
    assert third != first
    for w in workers:
        assert w.core.num_free_pages == w.core.num_pages


@pytest.mark.parametrize("colocated", ["prefix-aware", "least-loaded"], indirect=True)
def test_a_burst_of_prompts_is_spread_over_colocated_workers(colocated):
    """The six arrive while both workers are inside a step, so none finishes (and releases its
    queued prompt tokens) before the last is placed: on idle workers a 60-token prompt of the
    tiny model can be served before the burst's last request arrives, and the split then
    depends on timing (4/2 seen on a loaded 2-core machine)."""
    server, workers = colocated
    prompts = random_prompts([60] * 6, 256, seed=24)
    busy = [hold_engine_thread(h, 0.8) for h in server.service.dispatcher.decodes.values()]
    with ThreadPoolExecutor(6) as pool:
        placed = sorted(w for w, _ in pool.map(lambda p: ask(server, p), prompts))
    for t in busy:
        t.result(10)
    assert placed == ["colocated-0"] * 3 + ["colocated-1"] * 3
    for w in workers:
        assert w.core.num_free_pages == w.core.num_pages


@pytest.mark.parametrize("colocated", ["prefix-aware"], indirect=True)
def test_a_request_pinned_to_a_worker_is_placed_there_and_a_bad_pin_is_refused(colocated):
    """GenerateRequest.decode_worker overrides the policy (which would spread these four over
    both workers); an unknown id is INVALID_ARGUMENT naming the field and the allowed ids, and
    the router goes on serving."""
    import grpc

    server, workers = colocated
    s = stub(server)
    prompts = random_prompts([30] * 4, 256, seed=25)
    placed = []
    for p in prompts:
        _, _, last = collect(s, pb.GenerateRequest(prompt_token_ids=p, decode_worker="colocated-1",
                                                   sampling=S(max_tokens=3, temperature=0, ignore_eos=True)))
        placed.append(last.placement.decode_worker)
    assert placed == ["colocated-1"] * 4
    with pytest.raises(grpc.RpcError) as err:
        collect(s, pb.GenerateRequest(prompt_token_ids=prompts[0], decode_worker="colocated-7",
                                      sampling=S(max_tokens=3)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "decode_worker" in err.value.details() and "'colocated-0', 'colocated-1'" in err.value.details()
    fresh = random_prompts([30], 256, seed=26)[0]
    assert ask(server, fresh)[0] == "colocated-0"  # unpinned: the policy again (colocated-1 has placed 4)
    for w in workers:
        assert w.core.num_free_pages == w.core.num_pages
