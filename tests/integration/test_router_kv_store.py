"""The router with a node KV store (router/kv_tier.py, issue 37): real in-process workers and a real
store (tiny llama, one local KV hub) behind the real gRPC router. Turn 1 of a conversation ends on
the decode worker; the router offloads its prompt + answer pages into the store in the
background. The workers then forget everything (their prefix caches reset, as after eviction):
turn 2's prefill worker fetches those pages from the store and computes only the rest. Tokens
equal engine.LLM greedy with the store, without it, and with a store that fails to send (the
prompt is computed instead, the client sees nothing). Every page is back on every worker and in
the store after each test (tests/conftest.py), and the store's KV index entry is exact."""
from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from kv_store import KVStore
from kv_transfer.config import TransferConfig
from kv_transfer.local import LocalHub
from proto.pdcluster.v1 import inference_pb2 as pb
from router.app import build_router
from tests.helpers import Loop, close, collect, in_process, local_pair, random_prompts, stub, wait_until

ANSWER = 30
PAGE = 16


@pytest.fixture
def cluster(tiny_model):
    made = []

    def make(with_store: bool = True, local_prefill_threshold: int = 0):
        model = tiny_model("llama")
        hub = LocalHub()
        if local_prefill_threshold:
            from decode_worker.types import DecodeConfig
            from decode_worker.worker import DecodeWorker
            from prefill_worker.worker import PrefillWorker
            from tests.helpers import ENGINE

            kw = dict(transport="local", transfer_config=TransferConfig(deadline_s=20), transport_kwargs={"hub": hub},
                      page_size=PAGE, num_pages=128, **ENGINE)
            p, d = PrefillWorker(model, **kw), DecodeWorker(model, config=DecodeConfig(
                local_prefill_threshold=local_prefill_threshold), **kw)
            ph, dh = in_process(p, "prefill-0", "prefill"), in_process(d, "decode-0", "decode")
        else:
            p, d, ph, dh = local_pair(model, 128, hub=hub)
        handles = [ph, dh]
        store = None
        if with_store:
            store = KVStore(model, size_bytes=KVStore.page_bytes_of(model, PAGE) * 64, page_size=PAGE,
                            transport="local", transfer_config=TransferConfig(deadline_s=20),
                            transport_kwargs={"hub": hub})
            handles.append(in_process(store, "kv-store-0", "store", "kv-store"))
        loop = Loop()
        server = build_router(model, [ph], [dh], max_model_len=256, policy="prefix-aware", fetch_min_pages=1,
                              stores=handles[2:])
        # the tiny model computes a few pages about as fast as a fetch's fixed cost: the tests are
        # of the mechanism, so fetches are made free of it (the rule: tests/unit/test_fetch_rule.py)
        costs = server.service.dispatcher.fetch_costs
        costs.overhead_s, costs.source_overhead_s = 0.0, dict.fromkeys(costs.source_overhead_s, 0.0)
        loop.run(server.start())
        server.test_loop = loop
        made.append((server, loop, handles))
        return server, model, (p, d, store), handles

    yield make
    for server, loop, handles in made:
        loop.run(server.stop(1.0))
        close(*handles)
        loop.close()


def turn(server, prompt):
    ids, _, last = collect(stub(server), pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
        max_tokens=ANSWER, temperature=0, ignore_eos=True)))
    return ids, last


def forget(*handles) -> None:
    """Reset the workers' prefix caches on their engine threads (as if evicted)."""
    for h in handles:
        w = h.remote.host.worker
        h.remote.host.engine.submit(lambda w=w: w.core.reset_prefix_cache()).result(10)


def greedy(make_llm, model, prompts):
    llm = make_llm(model, page_size=PAGE, num_pages=256)
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=ANSWER,
                                                                       ignore_eos=True))]


def test_turn_2_fetches_from_the_store(cluster, make_llm):
    server, model, (p, d, store), (ph, dh, sh) = cluster()
    first, new = random_prompts([100, 10], 256, seed=5)
    ids1, _ = turn(server, first)
    held = (len(first) + ANSWER - 1) // PAGE  # full pages of prompt + answer (the last token's KV is never computed)
    disp = server.service.dispatcher
    index = disp.kv_index
    wait_until(lambda: store.kv.pool.num_cached_pages == held, what="the offload stored in the store")
    forget(ph, dh)
    second = first + ids1 + new
    from engine.block_hash import page_hashes
    hashes = page_hashes(second, PAGE, [])
    wait_until(lambda: index.matched_pages("kv-store-0", hashes) == held and index.exact("kv-store-0")
               and index.matched_pages("prefill-0", hashes) == 0 and index.matched_pages("decode-0", hashes) == 0,
               what="the index: only the store holds turn 1")
    ids2, last = turn(server, second)
    assert [ids1, ids2] == greedy(make_llm, model, [first, second])
    assert disp.fetch_counts == {"fetched": 1, "recomputed": 0}, disp.fetch_counts
    assert disp.fetched_tokens == held * PAGE and last.usage.cached_prompt_tokens == held * PAGE
    assert disp.tier.offloads["stored"] >= 1 and store.stats()["exported_tokens"] == held * PAGE
    # what the fetch cost, as the prefill worker waited for it, is what the router learns from
    assert disp.fetch_costs.fetches_seen == 1 and disp.fetch_costs._source_seen == {"store": 1, "worker": 0}
    wait_until(lambda: index.blocks("kv-store-0") == set(store.kv.pool.cached_hashes()), what="index exact")
    st = stub(server).ClusterStatus(pb.ClusterStatusRequest())
    (k,) = st.kv_stores
    assert (k.store_id, k.healthy, k.kv_index_state, k.hit_rate) == ("kv-store-0", True, "exact", 1.0), k
    assert k.total_pages == 64 and k.free_pages == 64 and k.kv_index_blocks == len(store.kv.pool.cached_hashes())
    assert st.kv_fetched_tokens == held * PAGE and st.kv_offloaded_tokens >= held * PAGE
    text = __import__("prometheus_client").generate_latest(server.service.metrics.registry).decode()
    assert f'pdcluster_kv_fetched_tokens_by_source_total{{source="store"}} {held * PAGE}.0' in text
    assert 'pdcluster_kv_store_healthy{node="",store="kv-store-0"} 1.0' in text
    assert 'pdcluster_kv_store_offloads_total{outcome="stored"}' in text


def test_a_store_that_fails_to_send_is_computed_instead(cluster, make_llm):
    server, model, (p, d, store), (ph, dh, sh) = cluster()

    async def refuse(fetch, prompt):
        raise RuntimeError("the store's process is gone")
    first, new = random_prompts([100, 10], 256, seed=6)
    ids1, _ = turn(server, first)
    held = (len(first) + ANSWER - 1) // PAGE
    wait_until(lambda: store.kv.pool.num_cached_pages == held, what="offloaded")
    forget(ph, dh)
    sh.export_prefix = refuse
    second = first + ids1 + new
    from engine.block_hash import page_hashes
    hashes = page_hashes(second, PAGE, [])
    index = server.service.dispatcher.kv_index
    wait_until(lambda: index.matched_pages("prefill-0", hashes) == 0 and index.matched_pages("decode-0", hashes) == 0,
               what="the workers' resets in the index")
    ids2, last = turn(server, second)
    assert [ids1, ids2] == greedy(make_llm, model, [first, second])
    disp = server.service.dispatcher
    assert disp.fetch_counts == {"fetched": 0, "recomputed": 1}, disp.fetch_counts
    assert last.usage.cached_prompt_tokens == 0


def test_without_a_store_the_same_tokens(cluster, make_llm):
    server, model, _, (ph, dh) = cluster(with_store=False)
    first, new = random_prompts([100, 10], 256, seed=5)
    ids1, _ = turn(server, first)
    forget(ph, dh)
    ids2, last = turn(server, first + ids1 + new)
    assert [ids1, ids2] == greedy(make_llm, model, [first, first + ids1 + new])
    assert server.service.dispatcher.tier is None and last.usage.cached_prompt_tokens == 0


def test_a_prompt_of_whole_pages_held_everywhere_fetches_all_but_its_last_page(cluster, make_llm):
    """The store holds every page of a prompt whose length is a whole number of pages: the
    fetch stops a page short (the last prompt token is always computed)."""
    server, model, (p, d, store), (ph, dh, sh) = cluster()
    prompt = random_prompts([8 * PAGE], 256, seed=7)[0]
    ids1, _ = turn(server, prompt)
    wait_until(lambda: store.kv.pool.num_cached_pages == (8 * PAGE + ANSWER - 1) // PAGE, what="offloaded")
    forget(ph, dh)
    from engine.block_hash import page_hashes
    index = server.service.dispatcher.kv_index
    hashes = page_hashes(prompt, PAGE, [])
    wait_until(lambda: index.matched_pages("kv-store-0", hashes) == 8 and index.matched_pages("prefill-0", hashes) == 0
               and index.matched_pages("decode-0", hashes) == 0, what="the index: only the store")
    ids2, last = turn(server, prompt)
    assert ids1 == ids2 == greedy(make_llm, model, [prompt])[0]
    assert last.usage.cached_prompt_tokens == 7 * PAGE
    assert server.service.dispatcher.fetch_counts == {"fetched": 1, "recomputed": 0}


def test_a_decode_worker_prefilling_locally_fetches_from_the_store(cluster, make_llm):
    """With local_prefill_threshold 64 the decode worker prefills a turn whose uncached part is
    short itself; when only the store holds the conversation, it fetches it from there first."""
    server, model, (p, d, store), (ph, dh, sh) = cluster(local_prefill_threshold=64)
    first, new = random_prompts([100, 10], 256, seed=8)
    ids1, _ = turn(server, first)  # 100 uncached tokens: prefilled by the prefill worker
    held = (len(first) + ANSWER - 1) // PAGE
    wait_until(lambda: store.kv.pool.num_cached_pages == held, what="offloaded")
    forget(ph, dh)
    second = first + ids1 + new
    from engine.block_hash import page_hashes
    index = server.service.dispatcher.kv_index
    hashes = page_hashes(second, PAGE, [])
    wait_until(lambda: index.matched_pages("decode-0", hashes) == 0 and index.matched_pages("prefill-0", hashes) == 0
               and index.matched_pages("kv-store-0", hashes) == held, what="the index: only the store")
    before = d.num_local_prefills
    ids2, last = turn(server, second)
    assert [ids1, ids2] == greedy(make_llm, model, [first, second])
    disp = server.service.dispatcher
    assert d.num_local_prefills == before + 1, "prefilled on the decode worker"
    assert disp.fetch_counts == {"fetched": 1, "recomputed": 0} and disp.fetched_by_source["store"] == held * PAGE
    assert last.usage.cached_prompt_tokens == held * PAGE


def test_refreshes_at_once_share_the_stores_calls(cluster):
    """The background refresh and ClusterStatus calls refresh at the same time: one load call per
    store, applied once, and no refresh fails (a KeyError here once broke ClusterStatus)."""
    import asyncio

    server, model, (p, d, store), handles = cluster()
    disp = server.service.dispatcher

    async def many():
        await asyncio.gather(*(disp.refresh_loads() for _ in range(8)))
    for _ in range(3):
        server.test_loop.run(many(), timeout=10)
    for _ in range(4):
        st = stub(server).ClusterStatus(pb.ClusterStatusRequest())
        assert [k.store_id for k in st.kv_stores] == ["kv-store-0"] and st.kv_stores[0].healthy
