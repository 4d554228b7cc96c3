"""A worker's role switch in process (what `pdcluster scale --move` does to a worker's engine):
a prefill worker and a decode worker over real NIXL (UCX on host memory) and real gRPC on
127.0.0.1 serve requests, then trade roles without reloading (PrefillWorker.over /
DecodeWorker.over: EngineCore.set_kv_connector): the same model runner, weights and KV cache,
a new connector. Greedy tokens equal Hugging Face's before and after, in both directions; the
prefix cache survives the switch (a prompt the old decode worker held is a cache hit when it
prefills it); every page is free on both engines afterwards; a busy engine refuses to switch;
a decode worker also becomes colocated and back."""
from __future__ import annotations

import pytest

from decode_worker import DecodeWorker
from engine.sampling_params import SamplingParams
from kv_transfer.config import TransferConfig
from prefill_worker import PrefillWorker
from tests.helpers import hf_greedy, random_prompts
from tests.integration.test_tp_disaggregated import Driver, assert_nothing_held

NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
LENGTHS = (3, 16, 17, 40, 70)
ENGINE = dict(page_size=16, num_pages=96, max_num_batched_tokens=256, max_num_seqs=8)


def run(prefill, decode, prompts, tag: str) -> Driver:
    d = Driver(prefill, decode)
    for i, p in enumerate(prompts):
        d.add(f"{tag}-{i}", p, GREEDY)
    d.run()
    assert all(reason == "length" for reason, _ in d.finished.values()), d.finished
    return d


@pytest.mark.parametrize("transport", ["nixl", "grpc"])
def test_workers_trade_roles_with_identical_tokens(transport, tiny_model):
    model = tiny_model("llama")
    cfg = TransferConfig(deadline_s=20.0)
    a = PrefillWorker(model, transport=transport, transfer_config=cfg, **ENGINE)
    b = DecodeWorker(model, transport=transport, transfer_config=cfg, **ENGINE)
    workers = [a, b]
    try:
        prompts = random_prompts(LENGTHS, a.core.config.vocab_size, seed=3)
        want = hf_greedy(model, prompts, NEW_TOKENS)
        d = run(a, b, prompts, "before")
        assert [d.tokens[f"before-{i}"] for i in range(len(prompts))] == want

        runners, weights = (a.core.runner, b.core.runner), (_first_weight(a), _first_weight(b))
        b2 = PrefillWorker.over(b.core, transport=transport, transfer_config=cfg)   # the decode engine now prefills
        a2 = DecodeWorker.over(a.core, transport=transport, transfer_config=cfg)    # and the prefill engine decodes
        workers = [a2, b2]
        assert (a2.core.runner, b2.core.runner) == runners, "a role switch must keep the loaded model"
        assert (_first_weight(a2), _first_weight(b2)) == weights

        d = run(b2, a2, prompts, "after")
        assert [d.tokens[f"after-{i}"] for i in range(len(prompts))] == want
        # the old decode engine held these prompts' full pages: prefilling them now hits its cache
        cached = {r.request_id: r.num_cached_tokens for r in d.prefill_results.values()}
        assert cached["after-4"] >= 64, cached
        assert_nothing_held(a2, b2)
    finally:
        for w in workers:
            w.close()


def test_busy_engine_refuses_to_switch_and_colocated_round_trip(tiny_model):
    model = tiny_model("llama")
    w = DecodeWorker(model, transport=None, **ENGINE)   # colocated
    prompts = random_prompts((20,), w.core.config.vocab_size, seed=5)
    want = hf_greedy(model, prompts, NEW_TOKENS)
    try:
        w.admit("busy", prompts[0], GREEDY)
        with pytest.raises(RuntimeError, match="open request"):
            PrefillWorker.over(w.core, transport="grpc")
        assert w.core.connector is None, "a refused switch leaves the engine as it was"
        got = []
        while w.has_requests:
            got += [t for out in w.step() for t in out.new_token_ids]
        assert got == want[0]
        p = PrefillWorker.over(w.core, transport="grpc")    # colocated -> prefill (sends over gRPC)
        # sends its prefills' KV, and receives too: a prefix fetched from a peer (engine/prefix_fetch.py)
        assert p.core.connector is not None and p.core.connector.roles == (True, True)
        back = DecodeWorker.over(p.core, transport=None)    # -> colocated again: the connector closed
        assert back.core.connector is None
        back.admit("again", prompts[0], GREEDY)
        got = []
        while back.has_requests:
            got += [t for out in back.step() for t in out.new_token_ids]
        assert got == want[0]
        assert back.core.num_free_pages == back.core.num_pages
        w = back
    finally:
        w.close()


def _first_weight(worker) -> int:
    """The storage address of the model's first parameter (unchanged: not reloaded)."""
    model = worker.core.runner.model
    return next(iter(model.parameters())).data_ptr()
