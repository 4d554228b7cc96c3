"""Resizing a pool at run time on a real local Ray (loopback), through the Scale RPC, under open
greedy streams: scale-out 1 -> 2 (a worker starts, warms up, then takes requests) and scale-in
2 -> 1 (the least loaded worker drains; with a short grace its open streams move to the other
worker through the migration path). No request fails, every stream's tokens equal engine.LLM
greedy, every page is free after; ClusterStatus shows the pool's target and current replicas
and each worker's state through the transitions. Invalid Scale requests are INVALID_ARGUMENT
naming the field; with API keys configured, a call without one is UNAUTHENTICATED."""
from __future__ import annotations

import argparse
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from cluster.serve import add_arguments, load_config
from engine.sampling_params import SamplingParams
from proto.pdcluster.v1 import inference_pb2 as pb
from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc
from tests.helpers import CLUSTER_ENGINE, our_ray_processes, random_prompts, wait_until

WAVE1_TOKENS = 100  # streams open while the pool scales out
WAVE2_TOKENS = 500  # streams open while it scales in: long enough to outlast a short grace
ENGINE = {**CLUSTER_ENGINE, "max_model_len": 1024, "num_pages": 1024}


def scale_config(mode: str, pool_args: list[str], api_key: str | None = None):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = load_config(parser.parse_args(["--mode", mode, *pool_args, "--model", "tiny", "--port", "0",
                                         "--policy", "round-robin"]))
    pools = [p.model_copy(update={"engine": p.engine.model_copy(update=ENGINE)}) for p in cfg.pools]
    router = cfg.router.model_copy(update={"api_keys": [api_key]}) if api_key else cfg.router
    return cfg.model_copy(update={"pools": pools, "router": router})


class Watch:
    """Polls ClusterStatus in a thread and keeps every (pool target, pool current) and (worker,
    state) it saw, so a transition is asserted as seen, not guessed with sleeps."""

    def __init__(self, stub, pool: str, metadata=()) -> None:
        self.stub, self.pool, self.md = stub, pool, metadata
        self.pool_seen: set[tuple[int, int]] = set()
        self.states: set[tuple[str, str]] = set()
        self.placed: dict[str, int] = {}
        self.last: pb.ClusterStatusResponse | None = None
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                st = self.stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10, metadata=self.md)
            except grpc.RpcError:
                continue
            for p in st.pools:
                if p.name == self.pool:
                    self.pool_seen.add((p.target_replicas, p.current_replicas))
            self.states.update((w.worker_id, w.state) for w in st.workers)
            for w in st.workers:
                self.placed[w.worker_id] = max(self.placed.get(w.worker_id, 0), w.requests_placed)
            self.last = st
            self._stop.wait(0.02)

    def close(self) -> None:
        self._stop.set()
        self._t.join(10)


def open_streams(stub, prompts, max_tokens, metadata=()):
    """Start one greedy stream per prompt; returns (futures, started) where `started` counts the
    streams that got their first token."""
    started = [0]
    lock = threading.Lock()

    def one(p):
        ids, text, last, first = [], "", None, True
        for c in stub.Generate(pb.GenerateRequest(prompt_token_ids=p, sampling=pb.SamplingParams(
                max_tokens=max_tokens, temperature=0, ignore_eos=True)), timeout=300, metadata=metadata):
            ids += c.token_ids
            text += c.text
            last = c
            if first and c.token_ids:
                first = False
                with lock:
                    started[0] += 1
        return ids, text, last

    ex = ThreadPoolExecutor(len(prompts))
    futs = [ex.submit(one, p) for p in prompts]
    ex.shutdown(wait=False)
    return futs, started


def pool_of(st, name):
    return next(p for p in st.pools if p.name == name)


def check_equal(got, llm, prompts, max_tokens):
    want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    for (ids, text, last), w in zip(got, want):
        assert ids == w.token_ids and text == w.text
        assert last.finish_reason == "length" and last.usage.completion_tokens == max_tokens


def scale_out_in(c, pool: str, workers: tuple[str, str], make_llm, model, metadata=(), n=16, seed=0):
    """The whole scenario on a started cluster; returns the figures it measured."""
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(c.router_address))
    md = tuple(metadata)
    watch = Watch(stub, pool, md)
    old, new = workers
    try:
        st = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10, metadata=md)
        p = pool_of(st, pool)
        assert (p.target_replicas, p.current_replicas) == (1, 1), p
        # wave 1 open while the pool scales out
        prompts1 = random_prompts([5 + 2 * i for i in range(n)], 2048, seed=seed)
        futs1, started1 = open_streams(stub, prompts1, WAVE1_TOKENS, md)
        wait_until(lambda: started1[0] == n, 60, 0.01, "wave 1 streaming")
        t0 = time.monotonic()
        resp = stub.Scale(pb.ScaleRequest(pool=pool, replicas=2), timeout=10, metadata=md)
        assert (resp.previous_target, resp.target, resp.current) == (1, 2, 1), resp
        wait_until(lambda: (2, 1) in watch.pool_seen, 30, 0.01, "target 2, current 1")
        wait_until(lambda: (new, "starting") in watch.states, 30, 0.01, f"{new} starting")
        wait_until(lambda: (2, 2) in watch.pool_seen, 120, 0.01, "the pool scaled out to 2")
        out_s = time.monotonic() - t0
        got1 = [f.result(timeout=300) for f in futs1]
        # wave 2 lands on both workers; the pool scales in while it streams
        prompts2 = random_prompts([6 + 2 * i for i in range(n)], 2048, seed=seed + 1)
        futs2, started2 = open_streams(stub, prompts2, WAVE2_TOKENS, md)
        wait_until(lambda: started2[0] == n, 60, 0.01, "wave 2 streaming")
        t1 = time.monotonic()
        resp = stub.Scale(pb.ScaleRequest(pool=pool, replicas=1), timeout=10, metadata=md)
        assert (resp.previous_target, resp.target) == (2, 1), resp
        wait_until(lambda: any(s == "draining" for _, s in watch.states), 30, 0.01, "a worker draining")
        wait_until(lambda: any(s == "stopped" for _, s in watch.states), 120, 0.01, "a worker stopped")
        in_s = time.monotonic() - t1
        got2 = [f.result(timeout=300) for f in futs2]
        victim = next(w for w, s in watch.states if s == "stopped")
        llm = make_llm(model, page_size=16, num_pages=2048, max_model_len=1024)
        check_equal(got1, llm, prompts1, WAVE1_TOKENS)
        check_equal(got2, llm, prompts2, WAVE2_TOKENS)
        # requests were placed on the new worker; every stream ended on the worker that stayed
        assert watch.placed.get(new, 0) > 0, watch.placed
        survivor = old if victim == new else new
        ends = [(last.placement.decode_worker, last.placement.migrations) for _, _, last in got2]
        print("wave 2 (worker it ended on, migrations):", ends, "victim:", victim)
        # a stream either finished where it was (within the grace) or moved once to the survivor
        assert all(m == 0 or (w == survivor and m == 1) for w, m in ends), ends
        moved = sum(last.placement.migrations for _, _, last in got2)
        # every page free on the workers left; the pool at 1; the stopped worker shown as such
        st = wait_until(lambda: _all_free(stub, md), 30, 0.05, "every page free")
        p = pool_of(st, pool)
        assert (p.target_replicas, p.current_replicas, p.start_failures) == (1, 1, 0), p
        states = {w.worker_id: w.state for w in st.workers}
        assert states[victim] == "stopped" and list(states.values()).count("serving") == len(states) - 1, states
        assert st.requests_failed == 0 and st.requests_served >= 2 * n, st
        assert (victim, "draining") in watch.states
        return {"scale_out_s": out_s, "scale_in_s": in_s, "moved": moved, "victim": victim}
    finally:
        watch.close()


def _all_free(stub, md):
    st = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10, metadata=md)
    live = [w for w in st.workers if w.state != "stopped"]
    return st if all(w.total_pages and w.free_pages == w.total_pages for w in live) else None


def test_scale_colocated_pool_out_and_in_under_streams(tiny_model, make_llm):
    """Default run: a colocated pool 1 -> 2 -> 1 under 16 open streams, short drain grace (the
    victim's 500-token streams move), invalid requests refused."""
    from cluster.runtime import Cluster

    cfg = scale_config("colocated", ["--decode", "1"])
    model = tiny_model("llama")
    events: list[str] = []
    c = Cluster(cfg, drain_grace_s=0.3, on_event=events.append)
    c.start()
    try:
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(c.router_address))
        for req, field_ in ((pb.ScaleRequest(pool="nope", replicas=2), "pool must be one of ['colocated']"),
                            (pb.ScaleRequest(pool="colocated", replicas=0), "replicas must be in [1, 16], got 0"),
                            (pb.ScaleRequest(pool="colocated", replicas=17), "replicas must be in [1, 16], got 17")):
            with pytest.raises(grpc.RpcError) as e:
                stub.Scale(req, timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field_ in e.value.details(), e.value
        figures = scale_out_in(c, "colocated", ("colocated-0", "colocated-1"), make_llm, model)
        print("figures:", figures)
        print("\n".join(events))
        # a 0.3 s grace: the victim's streams (500 tokens each) moved to the other worker
        assert figures["moved"] > 0, figures
        assert any(f"worker {figures['victim']} removed" in e and "moved" in e for e in events), events
    finally:
        c.stop()
    assert not our_ray_processes(), "Ray processes left after stop"


@pytest.mark.slow
def test_scale_decode_pool_disaggregated_with_api_key(tiny_model, make_llm):
    """1 prefill + a decode pool 1 -> 2 -> 1 behind an API key: the new decode worker is warmed
    up with the prefill worker before it serves; the drain's grace (default) lets the streams
    finish in place; Scale without the key is UNAUTHENTICATED."""
    from cluster.runtime import Cluster

    key = "scale-test-key"
    cfg = scale_config("disaggregated", ["--prefill", "1", "--decode", "1"], api_key=key)
    decode_pool = next(p.name for p in cfg.pools if p.role == "decode")
    model = tiny_model("llama")
    c = Cluster(cfg)
    c.start()
    try:
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(c.router_address))
        with pytest.raises(grpc.RpcError) as e:
            stub.Scale(pb.ScaleRequest(pool=decode_pool, replicas=2), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
        md = (("authorization", f"Bearer {key}"),)
        with pytest.raises(grpc.RpcError) as e:
            stub.Scale(pb.ScaleRequest(pool=decode_pool, replicas=-1), timeout=10, metadata=md)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "replicas" in e.value.details()
        figures = scale_out_in(c, decode_pool, (f"{decode_pool}-0", f"{decode_pool}-1"), make_llm, model,
                               metadata=md, seed=3)
        assert figures["moved"] == 0, figures  # a 30 s grace: every stream finished where it was
        print("figures:", figures)
    finally:
        c.stop()
    assert not our_ray_processes(), "Ray processes left after stop"


@pytest.mark.slow
def test_scale_out_beyond_resources_is_reported_and_retried_with_backoff(tiny_model):
    """A local cluster started with no room for more workers (scale_headroom 0): the new
    worker's placement group waits for resources, fails after start_timeout_s and is reported
    (pool error, start_failures, the worker `failed`), then retried after a back-off (1 s, then
    2 s), not in a loop; setting the target back to 1 stops the tries."""
    from cluster.runtime import Cluster

    cfg = scale_config("colocated", ["--decode", "1"])
    tiny_model("llama")
    events: list[str] = []
    c = Cluster(cfg, scale_headroom=0, start_timeout_s=2.0, on_event=events.append)
    c.start()
    try:
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(c.router_address))

        def pool():
            return pool_of(stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10), "colocated")
        stub.Scale(pb.ScaleRequest(pool="colocated", replicas=2), timeout=10)
        p = wait_until(lambda: (lambda p: p if p.start_failures >= 1 else None)(pool()), 60, 0.05, "a failed start")
        assert p.current_replicas == 1 and "failed to start" in p.error and "next try in 1 s" in p.error, p
        st = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=10)
        failed = [w for w in st.workers if w.state == "failed"]
        assert failed and "GetTimeoutError" in failed[0].error, st.workers
        assert [w.worker_id for w in st.workers if w.state == "serving"] == ["colocated-0"], st.workers
        p = wait_until(lambda: (lambda p: p if p.start_failures >= 2 else None)(pool()), 60, 0.05, "a second try")
        assert "next try in 2 s" in p.error, p
        stub.Scale(pb.ScaleRequest(pool="colocated", replicas=1), timeout=10)
        p = wait_until(lambda: (lambda p: p if p.target_replicas == 1 else None)(pool()), 10, 0.05, "target 1")
        wait_until(lambda: all(w.state not in ("starting", "warming") for w in stub.ClusterStatus(
            pb.ClusterStatusRequest(), timeout=10).workers), 30, 0.05, "no worker starting")
        tries = sum("failed to start" in e for e in events)
        assert 2 <= tries <= 3, events
        # settled at its target: no further tries (an absence, seen only by waiting past the back-off)
        threading.Event().wait(3.0)
        assert sum("failed to start" in e for e in events) == tries, events
        assert pool().current_replicas == 1
        # a placement that would wait long (a joined cluster waiting for a node) is given up as soon
        # as the target comes back down, not after start_timeout_s, and counts as no failure
        c.start_timeout_s = 300.0
        stub.Scale(pb.ScaleRequest(pool="colocated", replicas=2), timeout=10)
        wait_until(lambda: any(w.state == "starting" for w in stub.ClusterStatus(
            pb.ClusterStatusRequest(), timeout=10).workers), 30, 0.05, "a worker starting")
        t0 = time.monotonic()
        stub.Scale(pb.ScaleRequest(pool="colocated", replicas=1), timeout=10)
        wait_until(lambda: any("given up" in e for e in events), 10, 0.05, "the waiting scale-out given up")
        assert time.monotonic() - t0 < 10 and sum("failed to start" in e for e in events) == tries, events
        assert (pool().current_replicas, pool().target_replicas) == (1, 1)
    finally:
        c.stop()
    assert not our_ray_processes(), "Ray processes left after stop"
