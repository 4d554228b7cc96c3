"""Prefill and decode workers whose engines are tensor-parallel groups of different sizes, in
process (their followers are real subprocesses), over real NIXL (UCX on host memory) and real
gRPC on 127.0.0.1: every rank sends or receives its own KV heads (kv_transfer/tp_connector.py),
the sender ranks cover the receiver ranks' heads per kv_transfer/reshard.py.

Covered: prefill TP x decode TP in {1, 2}^2 on both transports, and KV heads replicated on the
ranks of either side (a 1-KV-head llama at TP=2): greedy tokens equal a colocated TP=1
engine's (the near-tie rule of test_tensor_parallel.py), for prompts of 1..100 tokens and
different page sizes on the two sides; 32 concurrent streams over 2 -> 1 and 1 -> 2 with none
lost; a request cancelled mid-transfer; a decode follower killed with SIGKILL mid-transfer (the
request fails naming the lost rank, no hang; the prefill side's pages come back), and a prefill
follower killed; an impossible head pairing refused with the plan's message; close() mid-
transfer returning every page. After every
test: free pages equal the total on both leaders' block pools, and every follower's sender and
receiver track no pages (`TPConnector.follower_reports`).
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from decode_worker import Admission, DecodeWorker
from engine.sampling_params import SamplingParams
from kv_transfer.config import TransferConfig
from prefill_worker import PrefillTask, PrefillWorker
from tests.helpers import random_prompts, wait_until
from tests.integration.test_tensor_parallel import TIE_GAP, followers_gone, one_kv_head_llama, top2_gap

NEW_TOKENS = 12
LENGTHS = (1, 5, 17, 40, 100, 33)
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
TP_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 2)]


@pytest.fixture(scope="module")
def kv1_model(tiny_model, tmp_path_factory):
    return one_kv_head_llama(tiny_model("llama"), tmp_path_factory.mktemp("kv1") / "llama-1kv")


@pytest.fixture
def workers():
    """make(model, transport, p_tp, d_tp, ...) -> (prefill, decode); on exit both are closed,
    their followers gone, and (while they ran) every follower tracked no pages."""
    made = []

    def make(model, transport, p_tp, d_tp, *, prefill_page=16, decode_page=8, num_pages=96, deadline_s=20.0,
             max_num_seqs=8, handshake_timeout_s=5.0):
        cfg = TransferConfig(deadline_s=deadline_s, liveness_interval_s=0.1, handshake_timeout_s=handshake_timeout_s)
        engine = dict(num_pages=num_pages, max_num_batched_tokens=256, max_num_seqs=max_num_seqs,
                      tp_transport="socket")
        prefill = PrefillWorker(model, transport=transport, transfer_config=cfg, page_size=prefill_page,
                                tensor_parallel_size=p_tp, **engine)
        made.append(prefill)
        decode = DecodeWorker(model, transport=transport, transfer_config=cfg, page_size=decode_page,
                              detokenize=False, tensor_parallel_size=d_tp, **engine)
        made.append(decode)
        return prefill, decode

    yield make
    for w in made:
        pids = w.core.tensor_parallel_pids
        w.close()
        assert followers_gone(pids), f"followers {pids} still running after close()"


class Driver:
    """Plays the router: admit on decode, hand every rank's descriptor to prefill, step both."""

    def __init__(self, prefill: PrefillWorker, decode: DecodeWorker) -> None:
        self.prefill, self.decode = prefill, decode
        self.prompts: dict[str, tuple[list[int], SamplingParams]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, tuple[str, str | None]] = {}
        self.prefill_results: dict = {}

    def add(self, rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> Admission:
        self.prompts[rid] = (prompt, params)
        self.tokens[rid] = []
        adm = self.decode.admit(rid, prompt, params)
        self._route(adm)
        return adm

    def _route(self, adm: Admission) -> None:
        if adm.descriptors:
            assert len(adm.descriptors) == self.decode.core.tensor_parallel_size
            prompt, params = self.prompts[adm.request_id]
            self.prefill.submit(PrefillTask(adm.request_id, prompt, params, list(adm.descriptors)))

    def step(self) -> None:
        for r in self.prefill.step():
            self.prefill_results[r.request_id] = r
        for out in self.decode.step():
            if isinstance(out, Admission):
                self._route(out)
                continue
            self.tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                self.finished[out.request_id] = (out.finish_reason, out.error)

    def settled(self) -> bool:
        return (len(self.finished) == len(self.prompts) and not self.prefill.num_transferring
                and not self.prefill.has_requests and not self.decode.has_requests)

    def run(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.settled():
            assert time.monotonic() < deadline, (f"hung: finished {self.finished}, stages "
                                                 f"{ {r: self.decode.stage(r) for r in self.prompts} }")
            self.step()
            if not (self.prefill.has_work or self.decode.has_work):
                time.sleep(0.001)  # waiting for the transports' events (the loops would park here)


def assert_nothing_held(*ws) -> None:
    """Both leaders' block pools whole, and every follower's sender and receiver empty."""
    for w in ws:
        assert w.core.num_free_pages == w.core.num_pages, f"{type(w).__name__}: {w.load()}"
        if w.core.tensor_parallel_size > 1:
            for rep in w.core.connector.follower_reports():
                assert rep["sender_pages"] == [] and rep["receiver_pages"] == [] and rep["requests"] == [], rep


def assert_greedy_equal(model, prompts, got: list[list[int]], want: list[list[int]]) -> None:
    """Equal, or parted where transformers' top-2 logits are a near-tie (test_tensor_parallel.py)."""
    for i, (prompt, g, w) in enumerate(zip(prompts, got, want)):
        assert len(g) == len(w) == NEW_TOKENS, (i, g, w)
        k = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if k is not None:
            gap = top2_gap(model, prompt + w[:k])
            assert gap < TIE_GAP, f"prompt {i} ({len(prompt)} tokens) diverges at token {k}: {g} vs {w} (gap {gap:.3g})"


@pytest.fixture(scope="module")
def colocated(tiny_model):
    """TP=1 colocated greedy tokens, per (model, prompts)."""
    from engine import LLM

    cache = {}

    def get(model, prompts):
        key = (str(model), tuple(map(tuple, prompts)))
        if key not in cache:
            llm = LLM(model, page_size=16, num_pages=96)
            cache[key] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
            llm.close()
        return cache[key]

    return get


def _greedy_round(make, colocated, model, transport, p_tp, d_tp, **kw) -> None:
    prefill, decode = make(model, transport, p_tp, d_tp, **kw)
    assert prefill.core.tensor_parallel_size == p_tp and decode.core.tensor_parallel_size == d_tp
    prompts = random_prompts(LENGTHS, 256, seed=7)
    d = Driver(prefill, decode)
    for i, p in enumerate(prompts):
        adm = d.add(f"r{i}", p)
        assert len(adm.descriptors) == d_tp
    d.run()
    assert all(f == ("length", None) for f in d.finished.values()), d.finished
    assert decode.core.num_computed_prompt_tokens == 0  # every prompt's KV came over the transfer
    assert_greedy_equal(model, prompts, [d.tokens[f"r{i}"] for i in range(len(prompts))], colocated(model, prompts))
    assert_nothing_held(prefill, decode)


@pytest.mark.parametrize("transport", ["nixl", "grpc"])
@pytest.mark.parametrize("p_tp, d_tp", TP_PAIRS)
def test_greedy_matches_colocated(transport, p_tp, d_tp, tiny_model, workers, colocated):
    # tiny llama: 2 KV heads, one per rank at TP=2; pages of 16 tokens on the prefill side, 8 on
    # the decode side (and 8/16 in one case), so the transfer also re-pages
    pages = dict(prefill_page=8, decode_page=16) if (p_tp, d_tp) == (2, 2) else {}
    _greedy_round(workers, colocated, tiny_model("llama"), transport, p_tp, d_tp, **pages)


@pytest.mark.parametrize("transport, p_tp, d_tp", [("nixl", 2, 1), ("grpc", 1, 2),
                                                   pytest.param("grpc", 2, 2, marks=pytest.mark.slow)])
def test_replicated_kv_head(transport, p_tp, d_tp, kv1_model, workers, colocated):
    # one KV head: at TP=2 both ranks hold it. A replicated sender sends it once (from one
    # rank); a replicated receiver gets it on each of its ranks.
    _greedy_round(workers, colocated, kv1_model, transport, p_tp, d_tp)


@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2)])
def test_32_concurrent_streams(p_tp, d_tp, tiny_model, workers):
    model = tiny_model("llama")
    prefill, decode = workers(model, "grpc", p_tp, d_tp, num_pages=512, max_num_seqs=32)
    prompts = random_prompts([3 + (i * 7) % 60 for i in range(32)], 256, seed=11)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    d = Driver(prefill, decode)
    start = time.monotonic()
    for i, p in enumerate(prompts):
        d.add(f"s{i}", p, params)
    d.run()
    print(f"\n32 streams over prefill TP={p_tp} -> decode TP={d_tp}: {time.monotonic() - start:.1f} s")
    lost = [r for r, f in d.finished.items() if f != ("length", None) or len(d.tokens[r]) != 6]
    assert not lost and len(d.finished) == 32
    assert all(r.ok for r in d.prefill_results.values()) and len(d.prefill_results) == 32
    assert_nothing_held(prefill, decode)


def test_cancel_mid_transfer_frees_everything(tiny_model, workers):
    prefill, decode = workers(tiny_model("llama"), "grpc", 2, 2)
    d = Driver(prefill, decode)
    prompts = random_prompts([90, 60, 30], 256, seed=5)
    for i, p in enumerate(prompts):
        d.add(f"c{i}", p)
    d.add("keep", random_prompts([20], 256, seed=6)[0])
    # step the prefill side only: its sends start and move (the decode side takes no step)
    wait_until(lambda: (prefill.step() or True) and prefill.num_transferring > 0, timeout_s=30)
    for i in range(len(prompts)):
        assert decode.cancel(f"c{i}")
        prefill.cancel(f"c{i}")
    d.run()
    assert {r: f[0] for r, f in d.finished.items()} == {"c0": "abort", "c1": "abort", "c2": "abort", "keep": "length"}
    assert_nothing_held(prefill, decode)


def test_killed_decode_follower_fails_the_transfer(tiny_model, workers):
    prefill, decode = workers(tiny_model("llama"), "grpc", 2, 2, deadline_s=8.0, handshake_timeout_s=2.0)
    d = Driver(prefill, decode)
    prompt = random_prompts([70], 256, seed=9)[0]
    d.add("k", prompt)
    (pid,) = decode.core.tensor_parallel_pids
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    d.run(timeout_s=60)
    reason, error = d.finished["k"]
    print(f"\nkilled decode rank 1: the request ended after {time.monotonic() - start:.2f} s: {error}")
    assert reason == "error" and "rank 1" in error, d.finished
    assert prefill.core.num_free_pages == prefill.core.num_pages
    assert decode.core.num_free_pages == decode.core.num_pages
    for rep in prefill.core.connector.follower_reports():
        assert rep["sender_pages"] == [] and rep["requests"] == [], rep
    assert decode.core.tensor_parallel_error is not None
    # a later admission cannot get rank 1's descriptor: it fails at once, nothing kept
    from engine.parallel import TPGroupError

    with pytest.raises(TPGroupError, match="no expect reply from rank 1"):
        decode.admit("after", prompt, GREEDY)
    assert decode.core.num_free_pages == decode.core.num_pages and not decode.has_requests


def test_killed_prefill_follower_fails_both_sides(tiny_model, workers):
    # nixl: the decode ranks read from the prefill ranks. Prefill rank 1 dies before the prefill
    # step: rank 0's send is cancelled with the failed step, the decode side hears the abort on
    # its rank 0 and ends the receive on its rank 1 too.
    prefill, decode = workers(tiny_model("llama"), "nixl", 2, 2, deadline_s=8.0, handshake_timeout_s=2.0)
    d = Driver(prefill, decode)
    d.add("k", random_prompts([70], 256, seed=10)[0])
    (pid,) = prefill.core.tensor_parallel_pids
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: prefill.core.tensor_parallel_error is not None, 10, what="the prefill leader sees the loss")
    d.run(timeout_s=60)
    assert not d.prefill_results["k"].ok and "rank 1" in d.prefill_results["k"].error
    assert d.finished["k"][0] == "error", d.finished
    assert prefill.core.num_free_pages == prefill.core.num_pages
    assert_nothing_held(decode)


def test_impossible_pairing_is_refused_naming_the_heads(tiny_model, workers):
    import dataclasses

    from kv_transfer.descriptor import DestinationDescriptor

    prefill, decode = workers(tiny_model("llama"), "grpc", 2, 1)
    prompt = random_prompts([10], 256, seed=4)[0]
    d = Driver(prefill, decode)
    d.prompts["x"], d.tokens["x"] = (prompt, GREEDY), []  # admitted here, routed by hand below
    (raw,) = decode.admit("x", prompt, GREEDY).descriptors
    desc = DestinationDescriptor.from_bytes(raw)
    alien = dataclasses.replace(desc, layout=dataclasses.replace(desc.layout, head_start=5, num_heads=1))
    with pytest.raises(ValueError, match="impossible pairing: receiver rank 0 holds KV head 5"):
        prefill.submit(PrefillTask("x", prompt, GREEDY, [alien.to_bytes()]))
    assert decode.cancel("x")
    d.run()
    assert d.finished["x"][0] == "abort"
    assert_nothing_held(prefill, decode)


def test_close_mid_transfer_returns_every_page(tiny_model, workers):
    # close() fails the transfers in flight on every rank (the followers' connectors too) and
    # the pages come back before it returns
    prefill, decode = workers(tiny_model("llama"), "nixl", 2, 2)
    d = Driver(prefill, decode)
    for i, p in enumerate(random_prompts([80, 50, 20], 256, seed=8)):
        d.add(f"x{i}", p)
    wait_until(lambda: (prefill.step() or True) and prefill.num_transferring > 0, timeout_s=30)
    assert decode.core.num_free_pages < decode.core.num_pages
    for w in (decode, prefill):
        pids = w.core.tensor_parallel_pids
        w.close()
        assert w.core.num_free_pages == w.core.num_pages and not w.core.has_requests
        assert followers_gone(pids)
