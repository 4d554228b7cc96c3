"""2 prefill + 2 decode replicas over the grpc KV transport on a real local Ray: greedy
streams equal engine.LLM and every replica of each pool gets work; `pdcluster serve` as a
process drains and stops on SIGTERM, leaving no processes."""
from __future__ import annotations

from engine.sampling_params import SamplingParams
from tests.helpers import our_ray_processes, random_prompts, run_streams, start_cluster, stub, wait_free


def test_2_prefill_2_decode_over_grpc_both_replicas_get_work(tiny_model, make_llm):
    c = start_cluster(tiny_model, prefill=2, decode=2, transport="grpc", policy="round-robin")
    try:
        prompts = random_prompts([4 + 7 * i for i in range(32)], 2048, seed=5)
        got = run_streams(c, prompts)
        want = make_llm(tiny_model("llama"), page_size=16, num_pages=512).generate(
            prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        for (ids, _, _), w in zip(got, want):
            assert ids == w.token_ids
        assert {last.placement.prefill_worker for _, _, last in got} == {"prefill-0", "prefill-1"}
        assert {last.placement.decode_worker for _, _, last in got} == {"decode-0", "decode-1"}
        st = wait_free(stub(c))
        assert len(st.workers) == 4 and all(w.free_pages == w.total_pages for w in st.workers), st
    finally:
        c.stop()
    assert not our_ray_processes()
