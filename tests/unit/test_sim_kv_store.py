"""The simulator's KV store tier (planning/sim_store.py): what a user buying store memory would
notice. A multi-turn workload (each turn's prompt is the earlier turn's prompt plus new blocks)
on prefill workers whose caches are too small to keep the conversations between turns."""
from __future__ import annotations

import hashlib
import json

import pytest

from loadgen.metrics import summarize
from loadgen.workloads import Workload, WorkloadRequest
from planning.latency import LatencyModel
from planning.sim_request import EngineLimits
from planning.sim_spec import SimCluster, SimPool
from planning.sim_store import PageStore
from planning.simulator import simulate

LM = LatencyModel(prefill=(0.002, 2e-4, 0.0, 0.0), decode=(0.004, 1e-4, 1e-7), transfer_overhead_s=1e-3,
                  transfer_bytes_per_s=1e9, kv_bytes_per_token=1024, num_layers=8)
PAGE_BYTES = 16 * 1024
SMALL = EngineLimits(16, 96, 2048, 64)    # a prefill worker's cache: less than two conversations
BIG = EngineLimits(16, 4000, 2048, 64)
MID = EngineLimits(16, 200, 2048, 64)     # a decode worker's cache: three conversations or so


def conversations(n: int = 30, turns: int = 4, block_tokens: int = 64, new_blocks: int = 4, out: int = 16) -> Workload:
    """n conversations of `turns` turns, 5 s apart; turn t's prompt holds every block of turn t-1's."""
    reqs, blocks, nb = [], {c: () for c in range(n)}, 0
    for t in range(turns):
        for c in range(n):
            blocks[c] = blocks[c] + tuple(range(nb, nb + new_blocks))
            nb += new_blocks
            reqs.append((t * 5.0 + c * 0.1, blocks[c]))
    reqs.sort()
    return Workload([WorkloadRequest(i, a, len(b) * block_tokens, out, b) for i, (a, b) in enumerate(reqs)],
                    block_tokens, "conversations")


def cluster(store_bytes: int = 0, fetch_min_pages: int = 1, prefill: EngineLimits = SMALL,
            policy: str = "round-robin", decode: EngineLimits = MID) -> SimCluster:
    """Fetches on (the config's default) unless `fetch_min_pages` is 0; the decode worker's cache
    keeps a few conversations only, so that its peers' offers leave the store's value to show."""
    return SimCluster([SimPool("p", "prefill", 2, LM, prefill), SimPool("d", "decode", 1, LM, decode)],
                      policy=policy, kv_store_bytes=store_bytes, fetch_min_pages=fetch_min_pages)


def digest(records) -> str:
    return hashlib.sha256(repr([(r.index, r.ok, r.ttft_s, r.chunk_times_s, r.cached_tokens, sorted(r.server.items()))
                                for r in records]).encode()).hexdigest()[:16]


def ttft(res, q: str = "p50") -> float:
    return summarize(res.records, res.duration_s)["ttft_ms"][q]


def test_a_store_serves_the_later_turns_faster():
    wl = conversations()
    off = simulate(cluster(0), wl)
    on = simulate(cluster(4000 * PAGE_BYTES), wl)
    assert all(r.ok for r in off.records + on.records)
    # the prefill workers' caches keep nothing between turns: off, every prompt is computed
    assert off.kv_tiers["hit_rate"]["total"] == 0.0
    # on, turns 2..4 take their earlier turn's prompt from the store: 4+8+12 of 4+8+12+16 blocks
    tiers = on.kv_tiers
    assert tiers["hit_rate"]["store"] == pytest.approx(24 / 40)
    assert tiers["fetches"] == {"peer": 0, "store": 90}
    assert tiers["tokens"]["computed"] == tiers["prompt_tokens"] - tiers["tokens"]["store"]
    assert ttft(on) < 0.6 * ttft(off) and ttft(on, "p90") < 0.5 * ttft(off, "p90")
    fetched = [r for r in on.records if r.server.get("fetched_from") == "store"]
    assert len(fetched) == 90 and all(r.cached_tokens == r.server["fetched_tokens"] for r in fetched)
    # the first turns found nothing anywhere
    assert {r.index for r in fetched}.isdisjoint(range(30))


def test_the_fetch_rule_declines_a_fetch_that_costs_more_than_it_saves():
    # a page that takes longer to move than its 16 tokens take to prefill: the rule computes them
    slow = LatencyModel(**{**{k: getattr(LM, k) for k in ("prefill", "decode", "kv_bytes_per_token", "num_layers",
                                                         "transfer_overhead_s")}, "transfer_bytes_per_s": 1e6})
    c = SimCluster([SimPool("p", "prefill", 2, slow, SMALL), SimPool("d", "decode", 1, slow, BIG)],
                   policy="round-robin", kv_store_bytes=4000 * PAGE_BYTES)
    res = simulate(c, conversations())
    assert res.kv_tiers["fetches"]["store"] == 0 and res.kv_tiers["hit_rate"]["total"] == 0.0


def test_size_zero_reproduces_the_records_of_before():
    # digests of the records of the simulator before the store tier (d2b4bd0) on the same runs;
    # recompute them there only if the simulator's model was changed on purpose
    assert digest(simulate(cluster(0, 0, decode=BIG), conversations()).records) == "8d6e57c2de5b688a"
    assert digest(simulate(cluster(0, 0, prefill=BIG, policy="prefix-aware", decode=BIG), conversations()).records) \
        == "dd9cf229df3ee70c"


def test_a_store_too_small_for_one_page_is_no_store():
    wl = conversations()
    off = simulate(cluster(0), wl)
    tiny = simulate(cluster(PAGE_BYTES - 1), wl)
    assert digest(tiny.records) == digest(off.records)
    assert tiny.kv_tiers["stores"]["store:d-0"]["capacity_pages"] == 0
    assert tiny.kv_tiers["hit_rate"]["total"] == 0.0


def test_the_store_holds_at_most_its_capacity_and_hits_more_the_larger_it_is():
    wl = conversations()   # 4,800 prompt pages in all; each conversation comes back after the 29 others
    rates = []
    for cap in (100, 500, 1000, 1500, 4000):
        res = simulate(cluster(cap * PAGE_BYTES), wl)
        st = res.kv_tiers["stores"]["store:d-0"]
        assert st["capacity_pages"] == cap and st["held_pages"] == min(cap, 1920)
        assert st["copied_pages"] >= st["held_pages"] + st["evicted_pages"]  # (pages held past a gap: copied again)
        rates.append(res.kv_tiers["hit_rate"]["store"])
    # 100 pages hold the last conversations only; 4,000 hold every turn (1,920 distinct pages)
    assert rates[0] == 0.0 and rates == sorted(rates) and len(set(rates)) == 5 and rates[-1] == pytest.approx(0.6)


def test_page_store_lru():
    st = PageStore("s", 5, 16, PAGE_BYTES)
    assert st.offload([1, 2, 3]) == 3 and st.leading([1, 2, 3, 4], 4) == 3
    assert st.offload([1, 2, 3, 4]) == 1          # only the pages after the leading ones held ...
    assert list(st.pages) == [4, 3, 2, 1]         # ... which are refreshed, the first page last (least recent first)
    assert st.offload([7, 8]) == 2                # over capacity: the least recent go, a prompt's tail first
    assert len(st.pages) == 5 and st.leading([1, 2, 3, 4], 4) == 3 and st.evicted == 1
    assert list(st.pages) == [3, 2, 1, 8, 7]
    assert st.offload([1, 2, 3]) == 0 and list(st.pages) == [8, 7, 3, 2, 1]  # all held: refreshed only
    st.read([1, 2])                               # a read makes them the most recent
    st.offload([9, 10])
    assert list(st.pages) == [3, 2, 1, 10, 9] and st.leading([1, 2], 2) == 2
    assert PageStore("z", 0, 16, PAGE_BYTES).offload([1, 2]) == 0


def test_peer_fetch_follows_fetch_min_pages():
    wl = conversations()
    assert simulate(cluster(0, fetch_min_pages=0, decode=BIG), wl).kv_tiers["fetches"]["peer"] == 0
    peers = simulate(cluster(0, fetch_min_pages=1, decode=BIG), wl).kv_tiers
    # the decode worker's cache holds every conversation: the later turns come from it
    assert peers["fetches"] == {"peer": 90, "store": 0} and peers["hit_rate"]["peer"] == pytest.approx(24 / 40)
    # a store and a peer that hold the same pages: the store's offer goes first
    both = simulate(cluster(4000 * PAGE_BYTES, fetch_min_pages=1, decode=BIG), wl).kv_tiers
    assert both["fetches"] == {"peer": 0, "store": 90}
    assert simulate(cluster(0, fetch_min_pages=40, decode=BIG), wl).kv_tiers["fetches"]["peer"] < 90


def test_colocated_workers_neither_offload_nor_fetch():
    wl = conversations()
    pools = [SimPool("c", "colocated", 2, LM, SMALL)]
    off = simulate(SimCluster(pools, policy="round-robin"), wl)
    on = simulate(SimCluster(pools, policy="round-robin", kv_store_bytes=4000 * PAGE_BYTES, fetch_min_pages=1), wl)
    assert digest(on.records) == digest(off.records) and on.kv_tiers["stores"] == {}


def test_plan_simulate_sweeps_store_sizes(tmp_path, capsys):
    from cluster.cli import main

    prof = tmp_path / "prof.json"
    LM.save(prof)
    trace = tmp_path / "conv.jsonl"
    wl = conversations(n=12, turns=3, block_tokens=512, new_blocks=1)
    trace.write_text("".join(json.dumps({"timestamp": int(r.arrival_s * 1000), "input_length": r.prompt_len,
                                         "output_length": r.output_len, "hash_ids": list(r.prefix_blocks)}) + "\n"
                             for r in wl.requests))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: tiny\nrouter: {policy: round-robin}\npools:\n"
                   "  - {name: pre, role: prefill, replicas: 2, engine: {num_pages: 96}}\n"
                   "  - {name: dec, role: decode, replicas: 1, engine: {num_pages: 200}}\n")
    out = tmp_path / "sweep.json"
    base = ["plan", "simulate", "--config", str(cfg), "--profile", str(prof), "--dataset", str(trace),
            "--length-scale", "1", "--max-model-len", "4096"]
    assert main([*base, "--kv-store-size", "0,1MiB,64MiB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "store/node" in text and "64MiB" in text
    rows = json.loads(out.read_text())["sweep"]
    assert [r["kv_store_bytes"] for r in rows] == [0, 1 << 20, 64 << 20]
    rates = [r["kv_tiers"]["hit_rate"]["store"] for r in rows]
    assert rates[0] == 0.0 and rates[2] > 0.3
    assert rows[2]["summary"]["ttft_ms"]["p50"] < rows[0]["summary"]["ttft_ms"]["p50"]
    # one size: the usual report, with the tiers
    assert main([*base, "--kv-store-size", "64MiB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "KV store" in text and "Serving Benchmark Result" in text
    assert json.loads(out.read_text())["config"]["kv_tiers"]["fetches"]["store"] > 0
    assert main([*base, "--kv-store-size", "lots"]) == 2
    assert "--kv-store-size must be" in capsys.readouterr().err


def test_runs_of_decode_steps_give_the_same_records_with_the_store_and_peers_on():
    wl = conversations()
    for c in (lambda: cluster(1000 * PAGE_BYTES), lambda: cluster(0, fetch_min_pages=1)):
        assert digest(simulate(c(), wl).records) == digest(simulate(c(), wl, exact_steps=True).records)
