"""Engine behaviour a user notices: prefix caching computes only new tokens, preemption loses
nothing, bad input is refused with the field named while the engine keeps serving, streaming,
stop conditions, aborts."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.helpers import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture
def llm(model_dir, make_llm):
    return make_llm(model_dir, page_size=16)


def test_prefix_cache_computes_only_new_tokens(model_dir, llm, make_llm):
    shared = random_prompts([200], 2048, seed=3)[0]
    first, second = shared + [5, 6, 7], shared + [9, 10, 11, 12, 13]
    out1 = llm.generate([first], GREEDY)[0]
    before = llm.num_computed_prompt_tokens
    out2 = llm.generate([second], GREEDY)[0]
    computed = llm.num_computed_prompt_tokens - before
    cached = (200 // 16) * 16  # full pages of the shared prefix
    assert out2.num_cached_tokens == cached
    assert computed == len(second) - cached
    assert out1.num_cached_tokens == 0
    # Same output as an engine that never saw the first prompt.
    fresh = make_llm(model_dir, page_size=16, enable_prefix_caching=False)
    assert fresh.generate([second], GREEDY)[0].token_ids == out2.token_ids


def test_identical_prompt_reuses_all_but_last_token(llm):
    prompt = random_prompts([64], 2048, seed=4)[0]  # exactly 4 pages
    a = llm.generate([prompt], GREEDY)[0]
    b = llm.generate([prompt], GREEDY)[0]
    assert b.num_cached_tokens == 48  # the last page is recomputed to produce logits
    assert a.token_ids == b.token_ids


def test_preemption_under_small_page_budget_gives_identical_outputs(model_dir, make_llm):
    prompts = random_prompts([40, 70, 25, 90, 60, 33], 2048, seed=5)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    roomy = make_llm(model_dir, page_size=8)
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    tight = make_llm(model_dir, page_size=8, num_pages=24)  # 192 tokens for ~560 needed at once
    got = [o.token_ids for o in tight.generate(prompts, params)]
    assert tight.scheduler.num_preemptions > 0
    assert got == expected


def test_preemption_keeps_seeded_sampling_reproducible(model_dir, make_llm):
    prompts = random_prompts([40, 70, 25, 90], 2048, seed=6)
    # Plain temperature sampling: a top-p/top-k cut moves a whole token's mass when the ~1e-6
    # logit noise of a different batch composition lands on the cut, which would make this flaky.
    params = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=40, ignore_eos=True) for i in range(4)]
    roomy = make_llm(model_dir, page_size=8)
    tight = make_llm(model_dir, page_size=8, num_pages=20)
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    assert [o.token_ids for o in tight.generate(prompts, params)] == expected
    assert tight.scheduler.num_preemptions > 0


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ("", None, "prompt"),
        ([], None, "prompt_token_ids"),
        ([1, 2, 99999], None, "prompt_token_ids"),
        ([1, -1], None, "prompt_token_ids"),
        ([1] * 1024, None, "max_model_len"),
        ([1, 2], dict(max_tokens=0), "max_tokens"),
        ([1, 2], dict(temperature=-0.5), "temperature"),
        ([1, 2], dict(top_p=0.0), "top_p"),
        ([1, 2], dict(top_p=1.5), "top_p"),
        ([1, 2], dict(top_k=-2), "top_k"),
        ([1, 2], dict(min_p=2.0), "min_p"),
        ([1, 2], dict(stop_token_ids=[5000]), "stop_token_ids"),
    ],
)
def test_bad_input_is_refused_and_engine_keeps_serving(llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate([prompt], SamplingParams(**params) if params else GREEDY)
    assert llm.generate([[1, 2, 3]], GREEDY)[0].finish_reason == "length"


def test_request_larger_than_the_whole_cache_is_refused(model_dir, make_llm):
    small = make_llm(model_dir, page_size=16, num_pages=4)
    with pytest.raises(ValueError, match="KV pages"):
        small.generate([[1] * 60], SamplingParams(max_tokens=10))
    assert small.generate([[1] * 30], GREEDY)[0].finish_reason == "length"


def test_streaming_deltas_add_up_to_the_final_output(llm):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    rid = llm.add_request("The prefill pool builds the KV cache", params)
    ids, text, final = [], "", None
    while llm.has_unfinished_requests():
        for out in llm.step():
            assert out.request_id == rid
            ids += out.new_token_ids
            text += out.new_text
            final = out
    assert final.finished and ids == final.token_ids and text == final.text
    assert len(ids) == 20 and final.metrics.ttft is not None


def test_stop_token_and_max_model_len(model_dir, make_llm, llm):
    base = llm.generate([[7, 8, 9]], GREEDY)[0].token_ids
    stop_at = base[5]
    out = llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert out.token_ids == base[: base.index(stop_at) + 1]
    short = make_llm(model_dir, max_model_len=20)
    out = short.generate([[1] * 15], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_stop_string_is_not_emitted(llm):
    base = llm.generate(["hello world"], GREEDY)[0]
    assert len(base.text) > 6
    stop = base.text[3:6]
    out = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and base.text.startswith(out.text)


def test_abort_frees_pages_at_once(llm):
    rid = llm.add_request(random_prompts([100], 2048, seed=7)[0], GREEDY)
    llm.step()
    assert llm.num_free_pages < llm.num_pages
    llm.abort_request(rid)
    assert not llm.has_unfinished_requests()


def test_seeded_sampling_is_reproducible(llm):
    # No top-k/top-p cut: see test_preemption_keeps_seeded_sampling_reproducible.
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=30, ignore_eos=True)
    a = llm.generate([[3, 4, 5]], params)[0].token_ids
    b = llm.generate([[3, 4, 5], [9, 9, 9, 9]], [params, GREEDY])[0].token_ids
    c = llm.generate([[3, 4, 5]], SamplingParams(temperature=1.0, seed=99, max_tokens=30, ignore_eos=True))[0].token_ids
    assert a == b and a != c


def test_logprobs_are_returned_per_token(llm):
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and lp.rank == 1 and len(lp.top) == 3 and lp.top[0][0] == tok


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(model_dir, make_llm, dtype):
    import torch

    half = make_llm(model_dir, dtype=dtype)
    assert half.runner.kv_caches[0].dtype == getattr(torch, dtype)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5, ignore_eos=True)
    prompts = random_prompts([20, 50], 2048, seed=8)
    ref = make_llm(model_dir).generate(prompts, params)
    got = half.generate(prompts, params)
    for r, g in zip(ref, got):
        ref_lp = dict(r.logprobs[0].top)
        # The half-precision choice is among float32's top 5, with a logprob close to float32's.
        assert g.token_ids[0] in ref_lp
        assert abs(ref_lp[g.token_ids[0]] - g.logprobs[0].logprob) < 0.1


def test_a_failing_step_ends_only_its_requests_and_the_engine_goes_on(model_dir, make_llm):
    """An exception while a batch runs (injected into the model runner: a stand-in, named so,
    for any model or sampler error) ends the requests of that batch with finish_reason "error"
    naming it and frees their pages; a request that was not in the batch, and every later one,
    is served exactly."""
    llm = make_llm(model_dir, page_size=16, max_num_seqs=1)
    prompts = random_prompts([30, 40], 2048, seed=9)
    want = make_llm(model_dir, page_size=16).generate([prompts[1]], GREEDY)[0].token_ids
    first = llm.add_request(prompts[0], GREEDY)
    second = llm.add_request(prompts[1], GREEDY)  # waits: one sequence at a time
    real = llm.runner.execute

    def broken_once(batch, on_layer=None):
        llm.runner.execute = real
        raise RuntimeError("injected fault")

    llm.runner.execute = broken_once
    outs = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                outs[out.request_id] = out
    assert outs[first].finish_reason == "error" and "RuntimeError: injected fault" in outs[first].error
    assert outs[first].token_ids == []
    assert outs[second].finish_reason == "length" and outs[second].token_ids == want
    assert llm.num_free_pages == llm.num_pages
    assert llm.generate([prompts[1]], GREEDY)[0].token_ids == want
