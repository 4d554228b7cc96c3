"""Prefill worker and decode worker in two OS processes, over nixl and grpc, driven from the
test process as a router would (descriptors as protobuf bytes): greedy output equal to the
colocated engine and to transformers for tiny llama, qwen2 and qwen3 (prefill page size 16,
decode page size 32) with requests arriving while others decode; seeded output equal to
colocated; first token from the prefill worker, the rest from the decode worker; the page
queue; cancellation in each stage; a killed prefill process during the transfer (fail /
re-prefill). Afterwards both sides report every page free."""
from __future__ import annotations

import dataclasses
import queue
import time

import pytest

from engine.sampling_params import SamplingParams
from tests.helpers import hf_greedy, random_prompts, wait_until
from tests.integration.worker_procs import WorkerProc

PREFILL_ENGINE = dict(page_size=16, num_pages=64, max_num_batched_tokens=64, max_num_seqs=8)
DECODE_ENGINE = dict(page_size=32, num_pages=32, max_num_batched_tokens=64, max_num_seqs=8, detokenize=False)
TIMEOUT_S = 60.0


class Cluster:
    """Two child processes and the router's bookkeeping for the requests it placed."""

    def __init__(self, transport: str) -> None:
        self.transport = transport
        self.events: queue.Queue = queue.Queue()
        self.prefill = WorkerProc("prefill", self.events)
        self.decode = WorkerProc("decode", self.events)

    def init(self, model, *, prefill=None, decode=None, **decode_opts) -> None:
        self.drain()
        self.requests: dict[str, tuple[list[int], dict]] = {}
        self.first: dict[str, int] = {}
        self.tokens: dict[str, list[tuple[str, int]]] = {}
        self.finished: dict[str, tuple[str, str | None]] = {}
        self.prefill_errors: dict[str, str] = {}
        self.model = str(model)
        self.prefill.call("init", role="prefill", model=self.model, transport=self.transport,
                          engine={**PREFILL_ENGINE, **(prefill or {})},
                          deadline_s=decode_opts.get("deadline_s", 10.0),
                          layer_delay_s=decode_opts.pop("layer_delay_s", 0.0))
        self.decode.call("init", role="decode", model=self.model, transport=self.transport,
                         engine={**DECODE_ENGINE, **(decode or {})}, **decode_opts)

    def drain(self) -> None:
        while not self.events.empty():
            self.events.get_nowait()

    def add(self, rid: str, prompt: list[int], params: SamplingParams) -> str:
        p = dataclasses.asdict(params)
        self.requests[rid] = (prompt, p)
        self.tokens[rid] = []
        reply = self.decode.call("admit", request_id=rid, prompt=prompt, params=p)
        if reply["descriptors"]:
            self._submit(rid, reply["descriptors"])
        return reply["stage"]

    def _submit(self, rid: str, descriptors: list[str]) -> None:
        prompt, p = self.requests[rid]
        self.prefill.call("submit", request_id=rid, prompt=prompt, params=p, descriptors=descriptors)

    def pump(self, until, timeout: float = TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"hung: finished={self.finished} tokens={ {r: len(t) for r, t in self.tokens.items()} } "
                                   f"prefill stderr: {self.prefill.log()[-1500:]} decode stderr: {self.decode.log()[-1500:]}")
            try:
                who, kind, ev = self.events.get(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            rid = ev["request_id"]
            if kind == "admission":
                self._submit(rid, ev["descriptors"])
            elif kind == "first_token":
                if ev["token"] is not None:
                    self.first[rid] = ev["token"]
                if not ev["ok"]:
                    self.prefill_errors[rid] = ev["error"]
            elif kind == "output":
                self.tokens[rid].extend((ev["source"], t) for t in ev["new"])
                if ev["finished"]:
                    self.finished[rid] = (ev["reason"], ev["error"])

    def all_finished(self) -> bool:
        return len(self.finished) == len(self.requests)

    def ids(self, rid: str) -> list[int]:
        return [t for _, t in self.tokens[rid]]

    def assert_all_pages_free(self, sides=("prefill", "decode"), timeout: float = 15.0) -> None:
        for side in sides:
            proc = getattr(self, side)

            def settled(proc=proc) -> bool:
                reply = proc.call("load")
                return reply["load"]["free_pages"] == reply["load"]["total_pages"] and reply["settled"]

            wait_until(settled, timeout, 0.05, f"{side}: every page free and nothing open")

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


@pytest.fixture(scope="module", params=["nixl", "grpc"])
def cluster(request):
    c = Cluster(request.param)
    yield c
    c.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_parity_with_arrivals_while_decoding(cluster, tiny_model, make_llm, arch):
    model = tiny_model(arch)
    cluster.init(model)
    vocab = 256
    prompts = random_prompts([7, 45, 100, 23], vocab, seed=10)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    # Plain temperature: a top-p cut can flip on the ~1e-6 logit noise between batch compositions.
    seeded = SamplingParams(temperature=0.8, seed=1234, max_tokens=10, ignore_eos=True)
    cluster.add("g0", prompts[0], greedy)
    cluster.add("g1", prompts[1], greedy)
    cluster.pump(lambda: len(cluster.tokens["g0"]) >= 3)  # g0 is decoding on the decode worker
    assert not cluster.all_finished()
    cluster.add("g2", prompts[2], greedy)
    cluster.add("s3", prompts[3], seeded)
    cluster.pump(cluster.all_finished)

    colocated = make_llm(model, page_size=16, num_pages=64).generate(prompts, [greedy] * 3 + [seeded])
    reference = hf_greedy(model, prompts[:3], greedy.max_tokens)
    for i, rid in enumerate(["g0", "g1", "g2", "s3"]):
        assert cluster.finished[rid] == ("length", None)
        assert cluster.ids(rid) == colocated[i].token_ids, rid
        if i < 3:
            assert cluster.ids(rid) == reference[i], rid
        sources = [s for s, _ in cluster.tokens[rid]]
        assert cluster.tokens[rid][0] == ("prefill", cluster.first[rid])
        assert sources[1:] == ["decode"] * (greedy.max_tokens - 1)
    assert cluster.decode.call("load")["computed_prompt_tokens"] == 0  # no prompt was prefilled there
    cluster.assert_all_pages_free()


def test_page_exhaustion_queues_then_completes(cluster, tiny_model):
    cluster.init(tiny_model("llama"), decode={"num_pages": 8})
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    stages = [cluster.add(f"q{i}", p, params) for i, p in enumerate(random_prompts([90, 90, 90], 256, seed=11))]
    assert stages == ["WAITING_FOR_KV", "WAITING_FOR_KV", "QUEUED_FOR_PAGES"]
    cluster.pump(cluster.all_finished)
    assert all(len(cluster.ids(r)) == 6 and cluster.finished[r][0] == "length" for r in cluster.requests)
    cluster.assert_all_pages_free()


def test_cancel_in_each_stage(cluster, tiny_model):
    cluster.init(tiny_model("llama"), decode={"num_pages": 12}, layer_delay_s=0.15)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    p = random_prompts([90, 90, 200], 256, seed=12)
    cluster.add("decoding", p[0], params)
    cluster.add("in_flight", p[1], params)
    assert cluster.add("queued", p[2], dataclasses.replace(params, max_tokens=20)) == "QUEUED_FOR_PAGES"
    assert cluster.decode.call("cancel", request_id="queued")["known"]
    cluster.pump(lambda: len(cluster.tokens["decoding"]) >= 2)
    assert cluster.decode.call("cancel", request_id="decoding")["known"]
    # "in_flight" was behind "decoding" on the slow prefill worker: cancel while its layers move
    wait_until(lambda: cluster.decode.call("stage", request_id="in_flight")["transfer"] == "TRANSFERRING",
               TIMEOUT_S, 0.01, "in_flight's layers moving")
    assert cluster.decode.call("cancel", request_id="in_flight")["known"]
    cluster.pump(cluster.all_finished)
    assert {r: f[0] for r, f in cluster.finished.items()} == {"queued": "abort", "in_flight": "abort",
                                                               "decoding": "abort"}
    assert 0 < len(cluster.ids("decoding")) < 200 and cluster.ids("in_flight") == []
    cluster.assert_all_pages_free()  # the prefill side saw the transfer fail and released its pages


def test_cancel_waiting_for_kv_before_prefill_starts(cluster, tiny_model):
    cluster.init(tiny_model("llama"), layer_delay_s=0.1)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    p = random_prompts([120, 50], 256, seed=13)
    cluster.add("first", p[0], params)
    cluster.add("later", p[1], params)  # queued on the prefill worker behind "first"
    assert cluster.decode.call("stage", request_id="later")["stage"] == "WAITING_FOR_KV"
    assert cluster.decode.call("cancel", request_id="later")["known"]
    cluster.prefill.call("cancel", request_id="later")  # the router tells both sides
    cluster.pump(cluster.all_finished)
    assert cluster.finished["later"][0] == "abort" and cluster.finished["first"][0] == "length"
    cluster.assert_all_pages_free()


def _kill_prefill_during_transfer(cluster, tiny_model, make_llm, policy):
    model = tiny_model("llama")
    cluster.init(model, layer_delay_s=0.5, deadline_s=6.0, policy=policy)
    prompt = random_prompts([100], 256, seed=14)[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cluster.add("doomed", prompt, params)
    wait_until(lambda: cluster.decode.call("stage", request_id="doomed")["transfer"] == "TRANSFERRING",
               TIMEOUT_S, 0.01, "doomed's layers moving")
    cluster.prefill.kill()
    try:
        cluster.pump(cluster.all_finished, timeout=20)
        if policy == "fail":
            reason, error = cluster.finished["doomed"]
            assert reason == "error" and error
            assert cluster.ids("doomed") == []
        else:
            assert cluster.finished["doomed"] == ("length", None)
            want = make_llm(model, page_size=16, num_pages=64).generate([prompt], params)[0].token_ids
            assert cluster.ids("doomed") == want
            assert cluster.decode.call("load")["load"]["num_reprefills"] == 1
        cluster.assert_all_pages_free(sides=("decode",))
    finally:
        cluster.prefill = WorkerProc("prefill", cluster.events)


DEFAULT_POLICY = {"nixl": "fail", "grpc": "reprefill"}  # each policy once by default; -m slow runs the rest


def test_killed_prefill_during_transfer(cluster, tiny_model, make_llm):
    _kill_prefill_during_transfer(cluster, tiny_model, make_llm, DEFAULT_POLICY[cluster.transport])


@pytest.mark.slow
def test_killed_prefill_during_transfer_other_policy(cluster, tiny_model, make_llm):
    other = "reprefill" if DEFAULT_POLICY[cluster.transport] == "fail" else "fail"
    _kill_prefill_during_transfer(cluster, tiny_model, make_llm, other)
