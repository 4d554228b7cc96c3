"""Prefill and decode workers in one process over the `local` transport: greedy and seeded
output equal to the colocated engine, first token from the prefill worker and the rest from
the decode worker, prefix reuse, the page queue, local prefill, cancellation in each stage,
transfer failure (fail / re-prefill), and no pages left held on either side."""
from __future__ import annotations

import time

import pytest

from decode_worker import Admission, DecodeConfig, DecodeStage, DecodeWorker, TokenSource, TransferFailurePolicy
from engine.sampling_params import SamplingParams
from kv_transfer.config import TransferConfig
from kv_transfer.local import LocalHub
from prefill_worker import PrefillTask, PrefillWorker
from tests.conftest import register_engine
from tests.helpers import random_prompts, wait_until

ENGINE = dict(max_num_batched_tokens=64, max_num_seqs=8)


def make_pair(model_dir, *, decode_pages=64, prefill_pages=64, config=None, deadline_s=10.0, begin_timeout_s=60.0):
    hub = LocalHub()
    cfg = TransferConfig(deadline_s=deadline_s, begin_timeout_s=begin_timeout_s)
    prefill = PrefillWorker(model_dir, transport="local", transfer_config=cfg, transport_kwargs={"hub": hub},
                            page_size=16, num_pages=prefill_pages, **ENGINE)
    decode = DecodeWorker(model_dir, transport="local", transfer_config=cfg, transport_kwargs={"hub": hub},
                          config=config, page_size=32, num_pages=decode_pages, detokenize=False, **ENGINE)
    register_engine(prefill.core)
    register_engine(decode.core)
    return prefill, decode


class Driver:
    """Plays the router: admit on decode, hand descriptors to prefill, step both, collect."""

    def __init__(self, prefill: PrefillWorker, decode: DecodeWorker) -> None:
        self.prefill, self.decode = prefill, decode
        self.prompts: dict[str, tuple[list[int], SamplingParams]] = {}
        self.first: dict[str, int] = {}
        self.tokens: dict[str, list[tuple[TokenSource, int]]] = {}
        self.finished: dict[str, str] = {}

    def add(self, rid: str, prompt: list[int], params: SamplingParams):
        self.prompts[rid] = (prompt, params)
        self.tokens[rid] = []
        adm = self.decode.admit(rid, prompt, params)
        self._route(adm)
        return adm

    def _route(self, adm) -> None:
        if adm.descriptors:
            prompt, params = self.prompts[adm.request_id]
            self.prefill.submit(PrefillTask(adm.request_id, prompt, params, adm.descriptors))

    def step(self) -> None:
        for r in self.prefill.step():
            if r.first_token is not None:
                self.first[r.request_id] = r.first_token
        for out in self.decode.step():
            if isinstance(out, Admission):
                self._route(out)
                continue
            self.tokens[out.request_id].extend((out.source, t) for t in out.new_token_ids)
            if out.finished:
                self.finished[out.request_id] = out.finish_reason

    def run(self, timeout_s: float = 60.0, arrivals=None) -> None:
        arrivals = dict(arrivals or {})
        deadline = time.monotonic() + timeout_s
        step = 0
        while arrivals or len(self.finished) < len(self.prompts) or self.prefill.num_transferring:
            assert time.monotonic() < deadline, f"hung: finished {self.finished}, stages " \
                f"{ {r: self.decode.stage(r) for r in self.prompts} }"
            for args in arrivals.pop(step, []):
                self.add(*args)
            self.step()
            step += 1

    def ids(self, rid: str) -> list[int]:
        return [t for _, t in self.tokens[rid]]


def assert_no_pages_held(*workers):
    for w in workers:
        assert w.core.num_free_pages == w.core.num_pages, f"{type(w).__name__}: {w.load()}"


def test_greedy_matches_colocated_with_arrivals_while_decoding(tiny_model, make_llm):
    model = tiny_model("llama")
    prefill, decode = make_pair(model)
    prompts = random_prompts([5, 40, 77, 130], 256, seed=1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    d = Driver(prefill, decode)
    d.run(arrivals={0: [("a", prompts[0], params)], 2: [("b", prompts[1], params)],
                    4: [("c", prompts[2], params), ("d", prompts[3], params)]})
    want = make_llm(model, page_size=16, num_pages=64).generate(prompts, params)
    for rid, w in zip("abcd", want):
        assert d.ids(rid) == w.token_ids
        assert d.tokens[rid][0] == (TokenSource.PREFILL_WORKER, d.first[rid])
        assert all(s == TokenSource.DECODE_WORKER for s, _ in d.tokens[rid][1:])
    assert decode.core.num_computed_prompt_tokens == 0  # every prompt came over the transfer
    assert_no_pages_held(prefill, decode)
    prefill.close(), decode.close()


def test_seeded_sampling_matches_colocated_and_prefix_reused(tiny_model, make_llm):
    model = tiny_model("qwen3")
    prefill, decode = make_pair(model)
    base = random_prompts([48], 256, seed=2)[0]
    prompts = [base + [7, 8, 9], base + [10, 11]]
    # Plain temperature: a top-p/top-k cut can flip on the ~1e-6 logit noise between batch compositions.
    params = [SamplingParams(temperature=0.9, seed=11, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.2, seed=5, max_tokens=10, ignore_eos=True)]
    d = Driver(prefill, decode)
    d.run(arrivals={0: [("s0", prompts[0], params[0])], 3: [("s1", prompts[1], params[1])]})
    want = make_llm(model, page_size=16, num_pages=64).generate(prompts, params)
    assert d.ids("s0") == want[0].token_ids and d.ids("s1") == want[1].token_ids
    load = prefill.load()
    assert load.prefix_cache_hit_rate > 0  # the second prompt's first 48 tokens came from the cache
    assert_no_pages_held(prefill, decode)
    prefill.close(), decode.close()


def test_page_exhaustion_queues_then_completes(tiny_model):
    model = tiny_model("llama")
    prefill, decode = make_pair(model, decode_pages=8)
    prompts = random_prompts([90, 90, 90], 256, seed=3)  # 3 pages each of 32
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    d = Driver(prefill, decode)
    stages = [d.add(f"q{i}", p, params).stage for i, p in enumerate(prompts)]
    assert stages == [DecodeStage.WAITING_FOR_KV, DecodeStage.WAITING_FOR_KV, DecodeStage.QUEUED_FOR_PAGES]
    assert decode.load().queued_for_pages == 1
    d.run()
    assert all(len(d.ids(f"q{i}")) == 8 for i in range(3))
    assert_no_pages_held(prefill, decode)
    prefill.close(), decode.close()


def test_local_prefill_below_threshold(tiny_model, make_llm):
    model = tiny_model("llama")
    prefill, decode = make_pair(model, config=DecodeConfig(local_prefill_threshold=20))
    short, long = random_prompts([10, 60], 256, seed=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    d = Driver(prefill, decode)
    assert d.add("short", short, params).stage == DecodeStage.LOCAL_PREFILL
    assert d.add("long", long, params).descriptors is not None
    d.run()
    want = make_llm(model, page_size=16, num_pages=64).generate([short, long], params)
    assert d.ids("short") == want[0].token_ids and d.ids("long") == want[1].token_ids
    assert all(s == TokenSource.DECODE_WORKER for s, _ in d.tokens["short"])
    assert prefill.num_prefilled == 1
    assert_no_pages_held(prefill, decode)
    prefill.close(), decode.close()


def test_cancel_in_each_stage(tiny_model):
    model = tiny_model("llama")
    prefill, decode = make_pair(model, decode_pages=6)
    p = random_prompts([90, 90, 40], 256, seed=5)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    d = Driver(prefill, decode)
    d.add("decoding", p[0], params)
    d.add("waiting", p[1], params)
    assert d.add("queued", p[2], params).stage == DecodeStage.QUEUED_FOR_PAGES
    # queued: dropped from the page queue, nothing allocated
    assert decode.cancel("queued")
    # waiting for KV: prefill has it queued too; the router cancels both sides
    assert decode.stage("waiting") == DecodeStage.WAITING_FOR_KV
    assert decode.cancel("waiting") and prefill.cancel("waiting")
    for _ in range(200):
        d.step()
        if decode.stage("decoding") == DecodeStage.DECODING:
            break
    assert decode.stage("decoding") == DecodeStage.DECODING
    assert decode.cancel("decoding")
    d.step()
    assert d.finished == {"queued": "abort", "waiting": "abort", "decoding": "abort"}
    for _ in range(5):
        d.step()
    assert_no_pages_held(prefill, decode)
    assert not decode.has_requests and not prefill.has_work and not prefill.num_transferring
    prefill.close(), decode.close()


def test_cancel_while_transfer_in_flight_fails_sender(tiny_model):
    """Decode cancels after the prefill started sending: the sender sees FAILED and releases."""
    model = tiny_model("llama")
    prefill, decode = make_pair(model)
    prompt = random_prompts([100], 256, seed=6)[0]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    adm = decode.admit("x", prompt, params)
    prefill.submit(PrefillTask("x", prompt, params, adm.descriptors))
    sender = prefill.connector.sender
    real_send = sender.send_layer

    def send_then_cancel(rid, layer):
        real_send(rid, layer)
        if layer == 0:
            decode.cancel("x")  # mid-forward: the receiver fails the transfer

    sender.send_layer = send_then_cancel
    results = []
    for _ in range(10):
        results += prefill.step()
        decode.step()
    assert results and not results[0].ok
    assert sender.status("x").state.name == "FAILED"
    assert_no_pages_held(prefill, decode)
    prefill.close(), decode.close()


@pytest.mark.parametrize("policy", [TransferFailurePolicy.FAIL, TransferFailurePolicy.REPREFILL])
def test_transfer_failure_policy(tiny_model, make_llm, policy):
    """No prefill ever comes (as if its worker died): the begin timeout fails the transfer."""
    model = tiny_model("llama")
    prefill, decode = make_pair(model, config=DecodeConfig(on_transfer_failure=policy), deadline_s=10.0,
                                begin_timeout_s=0.3)
    prompt = random_prompts([70], 256, seed=7)[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    d = Driver(prefill, decode)
    decode.admit("lost", prompt, params)  # descriptor never handed to the prefill worker
    d.prompts["lost"], d.tokens["lost"] = (prompt, params), []
    d.run(timeout_s=20)
    if policy == TransferFailurePolicy.FAIL:
        assert d.finished["lost"] == "error" and d.ids("lost") == []
    else:
        assert d.finished["lost"] == "length"
        assert d.ids("lost") == make_llm(model, page_size=16, num_pages=64).generate([prompt], params)[0].token_ids
        assert decode.load().num_reprefills == 1
    assert_no_pages_held(prefill, decode)
    prefill.close(), decode.close()


def test_async_workers_stream_tokens_per_channel(tiny_model, make_llm):
    """The asyncio host (engine.async_worker): engine threads own the workers, woken by calls and
    by the connector; a request's outputs come on the channel it was opened on."""
    import asyncio

    from engine.async_worker import AsyncWorker

    model = tiny_model("llama")
    prefill, decode = make_pair(model, decode_pages=8)
    prompts = random_prompts([30, 90, 90, 90], 256, seed=8)
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)

    async def main():
        pf, dc = AsyncWorker(prefill), AsyncWorker(decode)
        queues = {(h, f"r{i}"): asyncio.Queue() for h in (pf, dc) for i in range(len(prompts))}

        async def pump(host):
            async for outs in host.outputs("test"):
                for o in outs:
                    queues[host, o.request_id].put_nowait(o)

        pumps = [asyncio.create_task(pump(h)) for h in (pf, dc)]

        async def one(rid, prompt):
            adm = await dc.call("admit", rid, prompt, params, channel="test")
            if adm.stage == DecodeStage.QUEUED_FOR_PAGES:  # the last one waits for pages
                adm = await queues[dc, rid].get()
            assert adm.descriptors and len(adm.descriptors) == 1
            await pf.call("submit", PrefillTask(rid, prompt, params, adm.descriptors), channel="test")
            first = await queues[pf, rid].get()
            outs = []
            while not outs or not outs[-1].finished:
                outs.append(await queues[dc, rid].get())
            assert first.ok and outs[0].new_token_ids == [first.first_token]
            assert outs[0].source == TokenSource.PREFILL_WORKER
            return [t for o in outs for t in o.new_token_ids]

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(f"r{i}", p) for i, p in enumerate(prompts))), 60)
        finally:
            for t in pumps:
                t.cancel()
            done = await asyncio.to_thread(_settled, pf, dc)
            pf.close(), dc.close()
            assert done, "requests still open on a worker"

    got = asyncio.run(main())
    assert got == [o.token_ids for o in make_llm(model, page_size=16, num_pages=64).generate(prompts, params)]
    assert_no_pages_held(prefill, decode)


def test_a_worker_waiting_for_kv_sleeps_until_the_connector_wakes_it(tiny_model):
    """Nothing polls: a decode worker whose only request waits for its KV runs no step until the
    transfer's arrival wakes its engine thread; the prefill worker, holding pages for a send,
    runs none either until the send's release."""
    from engine.async_worker import AsyncWorker

    model = tiny_model("llama")
    prefill, decode = make_pair(model)
    pf, dc = AsyncWorker(prefill), AsyncWorker(decode)
    prompt = random_prompts([40], 256, seed=9)[0]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    try:
        adm = dc.engine.submit(lambda: decode.admit("w", prompt, params)).result(10)
        assert adm.stage == DecodeStage.WAITING_FOR_KV
        steps = dc.engine.num_steps
        time.sleep(0.3)  # a polling loop would have stepped (or spun) many times by now
        assert dc.engine.num_steps == steps
        pf.engine.submit(lambda: prefill.submit(PrefillTask("w", prompt, params, adm.descriptors))).result(10)
        assert _settled(pf, dc)
        assert dc.engine.num_steps > steps
        assert not decode.has_requests and prefill.num_prefilled == 1
    finally:
        pf.close(), dc.close()
    assert_no_pages_held(prefill, decode)


def _settled(*hosts, timeout_s: float = 10.0) -> bool:
    """Every host's worker has no open request (transfers released), asked on its own thread."""
    wait_until(lambda: not any(h.engine.submit(lambda h=h: h.worker.has_requests).result(10) for h in hosts),
               timeout_s, 0.01, "no request open on any worker")
    return True
