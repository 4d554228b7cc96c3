"""`pdcluster serve --mode colocated` on a real local Ray (loopback): 2 colocated workers,
each prefilling its own prompts. Concurrent greedy streams equal engine.LLM (ids and text),
both workers get work, no request crosses a KV transfer, and every page comes back."""
from __future__ import annotations

import argparse

from cluster.serve import add_arguments, load_config
from engine.sampling_params import SamplingParams
from tests.helpers import CLUSTER_ENGINE as ENGINE
from tests.helpers import our_ray_processes, random_prompts, run_streams, stub, wait_free


def colocated_config():
    """The config `pdcluster serve --mode colocated --decode 2` builds, on the tiny model."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = load_config(parser.parse_args(["--mode", "colocated", "--decode", "2", "--model", "tiny",
                                         "--port", "0", "--policy", "round-robin"]))
    pools = [p.model_copy(update={"engine": p.engine.model_copy(update=ENGINE)}) for p in cfg.pools]
    return cfg.model_copy(update={"pools": pools})


def test_2_colocated_workers_greedy_equal_llm_no_transfer(tiny_model, make_llm):
    from cluster.runtime import Cluster

    cfg = colocated_config()
    assert [(p.role, p.replicas) for p in cfg.pools] == [("colocated", 2)]
    tiny_model("llama")  # built once here; the actors find it in PDCLUSTER_CACHE
    c = Cluster(cfg)
    c.start()
    try:
        s = stub(c)
        prompts = random_prompts([5 + 6 * i for i in range(16)], 2048, seed=6)
        got = run_streams(c, prompts)
        want = make_llm(tiny_model("llama"), page_size=16, num_pages=512).generate(
            prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        for (ids, text, last), w in zip(got, want):
            assert ids == w.token_ids and text == w.text
            assert last.finish_reason == "length" and last.usage.completion_tokens == 10
            # prefilled where it decodes: no prefill worker, no KV transfer
            assert last.placement.local_prefill and last.placement.prefill_worker == "", last.placement
            assert last.timings.transfer_s == 0.0, last.timings
            assert last.timings.prefill_s > 0.0, last.timings
        assert {last.placement.decode_worker for _, _, last in got} == {"colocated-0", "colocated-1"}
        st = wait_free(s)
        assert {w.worker_id: w.role for w in st.workers} == {"colocated-0": "colocated", "colocated-1": "colocated"}
        assert all(w.requests_placed > 0 and w.transferring_requests == 0 for w in st.workers), st
        assert all(w.total_pages > 0 and w.free_pages == w.total_pages and w.healthy for w in st.workers), st
        assert st.requests_served >= 16 and st.requests_failed == 0
    finally:
        c.stop()
    assert not our_ray_processes(), "Ray processes left after stop"
