"""The slow loop's simulator floor (planning/floor.py): the synthetic workload follows the window's
fit, a heavier load gets a higher floor, the floor holds the SLO in its own simulation and one
replica fewer does not, the misses grow the pool that causes them, the search keeps to its time
budget, and the `python -m planning.floor` protocol (stdin/stdout JSON, errors, the timeout)."""
from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from cluster.autoscale_floor import FloorFailed, floor_request, run_floor
from cluster.config import ClusterConfig
from planning.floor import Lengths, Slo, WindowFit, find_floors, judge, synthesize
from planning.latency import LatencyModel
from planning.sim_engine import EngineLimits
from planning.sim_spec import SimCluster, SimPool
from planning.simulator import simulate

# a CPU-like model: 10 ms + 150 us per prompt token; a decode step 15 ms + 2 ms per sequence
LM = LatencyModel(prefill=(0.01, 1.5e-4, 1e-8, 0.0), decode=(0.015, 0.002, 2e-7), kv_bytes_per_token=20000,
                  num_layers=8, source="test")
LIMITS = EngineLimits(page_size=16, num_pages=4096, max_num_batched_tokens=2048, max_num_seqs=64)
SLO = Slo(ttft_s=2.0, itl_s=0.2, percentile=90)


def fit(rate, prompt=512, output=128, cv=1.0, hit=0.0):
    return WindowFit(rate, Lengths(prompt, cv), Lengths(output, cv), hit)


def colocated(lm=LM, replicas=1):
    return SimCluster([SimPool("colocated", "colocated", replicas, lm, LIMITS)], max_inflight=256, max_queue=1024)


def disagg(prefill_lm=LM, decode_lm=LM):
    return SimCluster([SimPool("prefill", "prefill", 1, prefill_lm, LIMITS),
                       SimPool("decode", "decode", 1, decode_lm, LIMITS)], max_inflight=256, max_queue=1024)


def test_synthetic_workload_follows_the_fit():
    wl = synthesize(fit(4.0, prompt=400, output=100, cv=0.5, hit=0.5), page_size=16, max_model_len=8192)
    reqs = wl.requests
    assert len(reqs) == 240  # rate x 60 s, within [60, 240]
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    assert (len(reqs) - 1) / span == pytest.approx(4.0, rel=0.2)
    prompts = [r.prompt_len for r in reqs]
    assert statistics.fmean(prompts) == pytest.approx(400, rel=0.15)
    assert statistics.stdev(prompts) / statistics.fmean(prompts) == pytest.approx(0.5, rel=0.3)
    # half of each prompt (whole pages) is one shared prefix
    shared = sum(len(r.prefix_blocks) * 16 for r in reqs) / sum(prompts)
    assert 0.4 < shared <= 0.5 and wl.block_tokens == 16
    assert all(r.prefix_blocks == tuple(range(len(r.prefix_blocks))) for r in reqs)
    # constant lengths, capped by the context
    wl = synthesize(fit(0.1, prompt=9000, output=100, cv=0.0), page_size=16, max_model_len=4096)
    assert len(wl.requests) == 60 and {(r.prompt_len, r.output_len) for r in wl.requests} == {(3996, 100)}


def test_a_heavier_load_gets_a_higher_floor():
    bounds = {"colocated": (1, 16)}
    light = find_floors(colocated(), bounds, fit(1.0), SLO, budget_s=30)
    heavy = find_floors(colocated(), bounds, fit(8.0), SLO, budget_s=30)
    assert light.floors == {"colocated": 1} and light.meets and light.complete
    assert heavy.floors["colocated"] > 1 and heavy.meets and heavy.complete
    # one candidate per count, smallest first, every one's figures there for the log
    assert [c.replicas["colocated"] for c in heavy.candidates] == list(range(1, heavy.floors["colocated"] + 1))
    assert all(not c.meets and c.grow == "colocated" for c in heavy.candidates[:-1])
    assert heavy.candidates[-1].ttft_s <= SLO.ttft_s and heavy.candidates[-1].itl_s <= SLO.itl_s


def test_the_floor_meets_the_slo_and_one_fewer_does_not():
    res = find_floors(colocated(), {"colocated": (1, 16)}, fit(8.0), SLO, budget_s=30)
    n = res.floors["colocated"]
    wl = synthesize(fit(8.0), page_size=16, max_model_len=8192)
    assert judge(simulate(colocated(replicas=n), wl).records, SLO)[2]
    stop = ({"ttft": SLO.ttft_s * 1e3}, len(wl.requests) // 10)  # its verdict known, the rest is not run
    assert not judge(simulate(colocated(replicas=n - 1), wl, stop_after_misses=stop).records, SLO)[2]
    # the min is a floor even where fewer would do; the max one where none would
    assert find_floors(colocated(), {"colocated": (3, 16)}, fit(1.0), SLO).floors == {"colocated": 3}
    top = find_floors(colocated(), {"colocated": (1, 2)}, fit(20.0), SLO)
    assert top.floors == {"colocated": 2} and not top.meets and top.complete


def test_the_misses_grow_the_pool_that_causes_them():
    # prefill 10x slower: TTFT misses, prefill grows; decode steps 2x slower: ITL misses, decode grows
    slow_prefill = replace(LM, prefill=(0.1, 1.5e-3, 1e-7, 0.0))
    slow_decode = replace(LM, decode=(0.03, 0.004, 0.0))
    bounds = {"prefill": (1, 8), "decode": (1, 8)}
    a = find_floors(disagg(prefill_lm=slow_prefill), bounds, fit(2.0), SLO, budget_s=30)
    assert a.floors["prefill"] > 1 and a.floors["decode"] == 1 and a.meets
    b = find_floors(disagg(decode_lm=slow_decode), bounds, fit(2.0, prompt=128, output=256),
                    replace(SLO, ttft_s=30.0), budget_s=30)
    assert b.floors["decode"] > 1 and b.floors["prefill"] == 1 and b.meets
    # ITL misses with decode at its max: growing prefill would not help, the search ends there
    c = find_floors(disagg(decode_lm=slow_decode), {"prefill": (1, 8), "decode": (1, b.floors["decode"] - 1)},
                    fit(2.0, 128, 256), replace(SLO, ttft_s=30.0))
    assert c.floors == {"prefill": 1, "decode": b.floors["decode"] - 1} and not c.meets and c.complete
    # a pool not being sized keeps its replicas
    d = find_floors(disagg(prefill_lm=slow_prefill), {"decode": (1, 8)}, fit(2.0), SLO)
    assert set(d.floors) == {"decode"} and not d.meets


def test_the_search_keeps_to_its_budget_and_returns_a_lower_bound():
    t0 = time.perf_counter()
    res = find_floors(colocated(), {"colocated": (1, 16)}, fit(12.0), SLO, budget_s=0.05)
    took = time.perf_counter() - t0
    assert not res.complete and not res.meets
    # every candidate tried missed: the floor is the next count, above all of them
    assert res.floors["colocated"] == res.candidates[-1].replicas["colocated"] + 1
    assert took < 0.05 + 3 * max(c.sim_s for c in res.candidates) + 0.5
    # the default bound on requests keeps one candidate well under a second here
    full = find_floors(colocated(), {"colocated": (1, 16)}, fit(12.0), SLO, budget_s=30)
    assert full.requests == 240 and max(c.sim_s for c in full.candidates) < 2.0


def test_no_traffic_is_the_min():
    res = find_floors(colocated(), {"colocated": (2, 4)}, fit(0.0), SLO)
    assert res.floors == {"colocated": 2} and res.candidates == [] and res.meets


# ---- the process protocol ---------------------------------------------------------------------------
def _config(tmp_path, pools=None):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"latency_model": LM.to_json(), "model": "test"}))
    pools = pools or [{"name": "colocated", "role": "colocated", "replicas": 1}]
    return ClusterConfig.model_validate({
        "model": "tiny", "pools": pools,
        "autoscale": {"mode": "on", "floor": "simulator", "profile": str(path),
                      "pools": {p["name"]: {"min_replicas": 1, "max_replicas": 8} for p in pools},
                      "slo": {"ttft_s": 2.0, "itl_s": 0.2, "percentile": 90}}})


def _window(rate):
    return {"rate": rate, "prompt": {"mean": 512, "cv": 1.0}, "output": {"mean": 128, "cv": 1.0}, "prefix_hit": 0.2}


def test_process_protocol_answers_on_stdout(tmp_path):
    pools = [{"name": "prefill", "role": "prefill", "replicas": 1}, {"name": "decode", "role": "decode", "replicas": 2}]
    req = floor_request(_config(tmp_path, pools), {"prefill": 1, "decode": 2}, {"prefill": 4096, "decode": 4096},
                        _window(8.0), budget_s=10.0)
    assert req["config"]["pools"][1]["replicas"] == 2 and req["config"]["pools"][0]["engine"]["num_pages"] == 4096
    assert "autoscale" not in req["config"] and req["bounds"] == {"prefill": [1, 8], "decode": [1, 8]}
    out = subprocess.run([sys.executable, "-m", "planning.floor"], input=json.dumps(req), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    ans = json.loads(out.stdout)
    assert set(ans["floors"]) == {"prefill", "decode"} and ans["floors"]["decode"] > 1 and ans["meets"]
    last = ans["candidates"][-1]
    assert last["replicas"] == ans["floors"] and last["meets"] and last["ttft_s"] <= 2.0
    assert ans["process_s"] >= ans["seconds"] > 0
    # a request it cannot read: one error line, exit 1
    bad = subprocess.run([sys.executable, "-m", "planning.floor"], input='{"config": {}}', capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 1 and "error" in json.loads(bad.stdout)


def test_run_floor_reports_errors_and_kills_on_timeout(tmp_path):
    cfg = _config(tmp_path)
    req = floor_request(cfg, {"colocated": 1}, {"colocated": 4096}, _window(2.0), budget_s=2.0)
    ans = asyncio.run(run_floor(req, timeout_s=60))
    assert ans["floors"] == {"colocated": 1} and ans["meets"]
    with pytest.raises(FloorFailed) as e:
        asyncio.run(run_floor({**req, "window": {"rate": -1}}, timeout_s=60))
    assert e.value.outcome == "error" and "KeyError" in str(e.value)
    with pytest.raises(FloorFailed) as e:
        asyncio.run(run_floor(req, timeout_s=0.05))
    assert e.value.outcome == "timeout" and "killed" in str(e.value)
