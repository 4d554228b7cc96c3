"""The router's KV index against the workers' real prefix caches: real in-process workers (tiny
llama, local transport) behind the real gRPC router. After serving, the index holds exactly
each engine's cached block hashes, also under eviction pressure and after a worker resets its
cache; ClusterStatus and /metrics say it is exact; prefix-aware placement sends a repeated
prefix to the worker that holds it, and follows the caches (not the router's own guess of
what it sent where) when a worker's cache was reset."""
from __future__ import annotations

import pytest

from decode_worker import DecodeWorker
from kv_transfer.config import TransferConfig
from kv_transfer.local import LocalHub
from prefill_worker.worker import PrefillWorker
from proto.pdcluster.v1 import inference_pb2 as pb
from router.app import build_router
from tests.helpers import ENGINE, Loop, close, collect, in_process, local_pair, random_prompts, scrape, stub, value

S = pb.SamplingParams
NUM_PAGES = 40  # a 150-token prompt takes 10: a few distinct prompts evict


@pytest.fixture(scope="module")
def cluster(tiny_model):
    model = tiny_model("llama")
    hub = LocalHub()
    prefill0, decode, ph0, dh = local_pair(model, NUM_PAGES, hub=hub)
    prefill1 = PrefillWorker(model, transport="local", transfer_config=TransferConfig(deadline_s=20),
                             transport_kwargs={"hub": hub}, page_size=16, num_pages=NUM_PAGES, **ENGINE)
    ph1 = in_process(prefill1, "prefill-1", "prefill")
    loop = Loop()
    server = build_router(model, [ph0, ph1], [dh], max_model_len=256, policy="prefix-aware")
    server.metrics_port = 0
    loop.run(server.start())
    yield dict(server=server, loop=loop, workers={"prefill-0": prefill0, "prefill-1": prefill1, "decode-0": decode},
               handles={"prefill-0": ph0, "prefill-1": ph1, "decode-0": dh})
    loop.run(server.stop(1.0))
    close(ph0, ph1, dh)
    loop.close()


def cached_on_engine(c, wid) -> set[int]:
    """The engine's prefix cache, read on its own thread (between steps)."""
    pool = c["workers"][wid].core.kv.pool
    return c["loop"].run(c["handles"][wid].remote.host.engine.run(lambda: set(pool._by_hash)))


def synced(c) -> dict[str, set[int]]:
    """One load refresh (which pulls every worker's events), then the index per worker."""
    c["loop"].run(c["server"].service.dispatcher.refresh_loads())
    index = c["server"].service.dispatcher.kv_index
    return {wid: index.blocks(wid) for wid in c["workers"]}


def assert_index_is_the_caches(c):
    got = synced(c)
    want = {wid: cached_on_engine(c, wid) for wid in c["workers"]}
    assert got == want
    index = c["server"].service.dispatcher.kv_index
    assert all(index.exact(wid) for wid in c["workers"]), {w: index.workers[w].reason for w in c["workers"]}
    return want


def ask(c, prompt, max_tokens=2):
    _, _, last = collect(stub(c["server"]), pb.GenerateRequest(prompt_token_ids=prompt, sampling=S(
        max_tokens=max_tokens, temperature=0, ignore_eos=True)))
    return last.placement.prefill_worker, last.usage.cached_prompt_tokens


def test_the_index_equals_every_engines_prefix_cache(cluster):
    c = cluster
    for p in random_prompts([40, 70, 100], 256, seed=1):
        ask(c, p)
    caches = assert_index_is_the_caches(c)
    assert sum(len(v) for v in caches.values()) >= 10  # pages were cached (prefill and decode side)
    st = stub(c["server"]).ClusterStatus(pb.ClusterStatusRequest())
    assert st.kv_index_exact and st.kv_index_blocks == len(set().union(*caches.values()))
    by_id = {w.worker_id: w for w in st.workers}
    for wid, blocks in caches.items():
        assert by_id[wid].kv_index_state == "exact" and by_id[wid].kv_index_blocks == len(blocks)
        assert by_id[wid].kv_index_reason == ""
    samples = scrape(c["server"].metrics_url)
    assert value(samples, "pdcluster_kv_index_exact", worker="prefill-0", pool="prefill", role="prefill") == 1
    assert value(samples, "pdcluster_kv_index_blocks") == st.kv_index_blocks
    assert value(samples, "pdcluster_kv_index_snapshots_total", reason="first") == 3


def test_the_index_follows_evictions(cluster):
    c = cluster
    index = c["server"].service.dispatcher.kv_index
    synced(c)
    # (counted before the prompts: the router's own refresh, every 0.1 s, may pull their events
    # before the test's sync does)
    before = {wid: index.workers[wid].events for wid in c["workers"]}
    for p in random_prompts([150, 140, 150, 130, 150, 145], 256, seed=2):  # ~50 pages each side: evictions
        ask(c, p)
    assert_index_is_the_caches(c)
    assert any(index.workers[wid].events > before[wid] for wid in c["workers"])
    for wid, w in c["workers"].items():
        assert w.core.kv.pool.num_cached_pages <= NUM_PAGES


def test_the_index_follows_a_reset_prefix_cache(cluster):
    c = cluster
    ask(c, random_prompts([90], 256, seed=3)[0])
    assert any(synced(c).values())
    for wid in c["workers"]:
        core = c["workers"][wid].core
        c["loop"].run(c["handles"][wid].remote.host.engine.run(core.reset_prefix_cache))
    assert synced(c) == {wid: set() for wid in c["workers"]}  # no stale entries
    assert_index_is_the_caches(c)
    assert c["server"].service.dispatcher.kv_index.num_blocks == 0


def test_a_repeated_prefix_goes_to_the_prefill_worker_that_holds_it(cluster):
    c = cluster
    prefix = random_prompts([96], 256, seed=4)[0]
    tails = random_prompts([20, 24, 28, 30], 256, seed=5)
    first, cached = ask(c, prefix + tails[0])
    assert cached == 0 and first
    synced(c)
    for tail in tails[1:]:
        where, cached = ask(c, prefix + tail)
        assert where == first and cached == 96  # six pages of the prefix from its cache


@pytest.fixture
def colocated(tiny_model):
    model = tiny_model("llama")
    workers = [DecodeWorker(model, transport=None, page_size=16, num_pages=64, **ENGINE) for _ in range(2)]
    handles = [in_process(w, f"colocated-{i}", "colocated") for i, w in enumerate(workers)]
    loop = Loop()
    server = build_router(model, [], handles, max_model_len=256, policy="prefix-aware")
    loop.run(server.start())
    yield server, loop, workers, handles
    loop.run(server.stop(1.0))
    close(*handles)
    loop.close()


def test_placement_follows_the_caches_not_the_routers_guess(colocated):
    """colocated-0 served the prefix, then reset its cache; colocated-1 served it since. The
    router's LRU of what it sent where still names colocated-0 first (it has it for both, and
    colocated-0 comes first); the index knows only colocated-1 holds it."""
    server, loop, workers, handles = colocated
    prefix = random_prompts([96], 256, seed=6)[0]
    a, b, d = random_prompts([20, 22, 24], 256, seed=7)
    s = stub(server)
    run = lambda prompt, pin="": collect(s, pb.GenerateRequest(prompt_token_ids=prompt, decode_worker=pin, sampling=S(
        max_tokens=2, temperature=0, ignore_eos=True)))[2]
    refresh = lambda: loop.run(server.service.dispatcher.refresh_loads())
    assert run(prefix + a, "colocated-0").placement.decode_worker == "colocated-0"
    refresh()
    loop.run(handles[0].remote.host.engine.run(workers[0].core.reset_prefix_cache))
    refresh()
    assert run(prefix + b, "colocated-1").usage.cached_prompt_tokens == 0
    refresh()
    index = server.service.dispatcher.kv_index
    assert index.exact("colocated-0") and index.exact("colocated-1")
    last = run(prefix + d)
    assert last.placement.decode_worker == "colocated-1" and last.usage.cached_prompt_tokens == 96
