"""The cluster simulator against closed forms (M/D/1 queueing, fixed-batch decode, transfer
overlap), the engine's own scheduler it runs (prefix cache, pages and preemption, admission
limits, colocated stalls), and the `plan simulate` command line."""
import json

import pytest

from loadgen.metrics import summarize
from loadgen.workloads import Workload, WorkloadRequest, data_dir, gamma_arrivals
from planning.latency import LatencyModel
from planning.sim_engine import EngineLimits
from planning.sim_spec import SimCluster, SimPool
from planning.simulator import simulate

LM = LatencyModel(prefill=(0.02, 0.08 / 512, 0.0, 0.0), decode=(0.01, 0.001, 1e-6), kv_bytes_per_token=1000,
                  transfer_bytes_per_s=1e12)
BIG = EngineLimits(page_size=16, num_pages=1 << 20, max_num_batched_tokens=512, max_num_seqs=4096)


def disagg(lm=LM, prefill_limits=BIG, decode_limits=BIG, **kw) -> SimCluster:
    return SimCluster([SimPool("p", "prefill", 1, lm, prefill_limits), SimPool("d", "decode", 1, lm, decode_limits)],
                      max_inflight=1 << 20, max_queue=1 << 20, **kw)


def wl(specs, block_tokens=0) -> Workload:
    return Workload([WorkloadRequest(i, *s) for i, s in enumerate(specs)], block_tokens, "t")


def test_single_prefill_worker_ttft_is_md1():
    """Poisson arrivals, one prefill worker taking one 512-token prompt per step (D = 0.1 s):
    mean TTFT = D + rho*D / (2(1 - rho)), the M/D/1 mean sojourn time."""
    lam, d = 6.0, LM.prefill_time(512)
    arrivals = gamma_arrivals(20000, lam, 1.0, seed=3)
    res = simulate(disagg(), wl([(t, 512, 2) for t in arrivals]))
    s = summarize(res.records, res.duration_s)
    rho = lam * d
    want_ms = (d + rho * d / (2 * (1 - rho))) * 1e3
    assert s["failed"] == 0
    assert s["ttft_ms"]["mean"] == pytest.approx(want_ms, rel=0.04)
    assert res.workers["p-0"]["busy_fraction"] == pytest.approx(rho, rel=0.03)


def test_fixed_batch_decode_throughput_is_closed_form():
    """b requests of P prompt tokens and O outputs, all at t=0 on one colocated worker: one
    prefill step, then O-1 decode steps with batch b and context b*(P+k)."""
    b, p, o = 8, 100, 50
    d0, d1, d2 = LM.decode
    limits = EngineLimits(16, 1 << 20, b * p, b)
    res = simulate(SimCluster([SimPool("c", "colocated", 1, LM, limits)]), wl([(0.0, p, o)] * b))
    decode_s = sum(d0 + d1 * b + d2 * b * (p + k) for k in range(1, o))
    prefill_s = LM.step_time([(p, 0)] * b)
    assert res.duration_s == pytest.approx(prefill_s + decode_s, rel=1e-9)
    s = summarize(res.records, res.duration_s)
    assert s["tpot_ms"]["mean"] == pytest.approx(decode_s / (o - 1) * 1e3, rel=1e-9)
    assert s["total_output_tokens"] == b * o and res.workers["c-0"]["mean_decode_batch"] > b * 0.95


def test_transfer_hides_behind_the_last_prefill_step_layer_by_layer():
    step = LM.prefill_time(512)
    for transfer_s, want in ((0.5 * step, 0.5 * step / 8), (3 * step, 2 * step)):
        lm = LatencyModel(prefill=LM.prefill, decode=LM.decode, kv_bytes_per_token=1000, num_layers=8,
                          transfer_bytes_per_s=512 * 1000 / transfer_s)
        rec = simulate(disagg(lm), wl([(0.0, 512, 3)])).records[0]
        assert rec.server["transfer_s"] == pytest.approx(want, rel=1e-6)
        assert rec.server["kv_bytes"] == 512 * 1000
        assert rec.chunk_times_s[1] == pytest.approx(step + want + lm.decode_time(1, 513), rel=1e-6)


def test_shared_prefix_blocks_hit_the_cache_and_route_to_it():
    """Two prefill workers; requests sharing Mooncake blocks go where the blocks are cached and
    compute only their new tokens."""
    reqs = [(float(i), 300, 4, (1, 2, 3)) for i in range(6)]
    c = SimCluster([SimPool("p", "prefill", 2, LM, BIG), SimPool("d", "decode", 1, LM, BIG)])
    res = simulate(c, wl(reqs, block_tokens=64))
    recs = res.records
    assert recs[0].cached_tokens == 0
    assert all(r.cached_tokens == 192 for r in recs[1:])  # 3 blocks of 64 tokens, whole pages
    assert len({r.server["prefill_worker"] for r in recs}) == 1
    computed = sum(w["computed_prompt_tokens"] for w in res.workers.values())
    assert computed == 300 + 5 * (300 - 192)


def test_colocated_workers_route_shared_prefixes_to_the_cache_as_the_router_does():
    """Two colocated workers under the prefix-aware policy (the router's own objects): requests
    sharing Mooncake blocks all go to the worker holding them; a request without shared blocks
    goes to the other one."""
    reqs = [(float(i), 300, 4, (1, 2, 3)) for i in range(5)] + [(5.0, 300, 4, (7, 8, 9))]
    res = simulate(SimCluster([SimPool("c", "colocated", 2, LM, BIG)]), wl(reqs, block_tokens=64))
    recs = res.records
    assert [r.cached_tokens for r in recs] == [0, 192, 192, 192, 192, 0]
    assert len({r.server["decode_worker"] for r in recs[:5]}) == 1
    assert recs[5].server["decode_worker"] != recs[0].server["decode_worker"]


def test_decode_pages_run_out_preempt_and_every_request_still_completes():
    limits = EngineLimits(page_size=16, num_pages=40, max_num_batched_tokens=512, max_num_seqs=64)
    res = simulate(disagg(decode_limits=limits), wl([(0.0, 100, 200)] * 4))
    s = summarize(res.records, res.duration_s)
    assert s["failed"] == 0 and s["total_output_tokens"] == 4 * 200
    assert res.workers["d-0"]["preemptions"] > 0
    assert all(len(r.chunk_times_s) == 200 for r in res.records)


def test_the_simulated_steps_are_the_engine_schedulers_batches(monkeypatch):
    """Every simulated step is a batch `engine.scheduler.Scheduler.schedule` built, and a change
    of the scheduler's limit changes the simulated steps with it: at a budget of 512 tokens a
    1,000-token prompt takes two chunks, at 128 it takes eight, and its TTFT grows by the extra
    steps' fixed cost."""
    from engine.scheduler import Scheduler

    def run(budget: int):
        batches = []
        real = Scheduler.schedule

        def recording(self):
            batch = real(self)
            if not batch.empty:
                batches.append(list(batch.num_new_tokens))
            return batch

        monkeypatch.setattr(Scheduler, "schedule", recording)
        limits = EngineLimits(page_size=16, num_pages=1024, max_num_batched_tokens=budget, max_num_seqs=8)
        res = simulate(disagg(prefill_limits=limits, decode_limits=limits), wl([(0.0, 1000, 3)]))
        monkeypatch.undo()
        steps = sum(w["steps"] for w in res.workers.values())
        return batches, steps, res.records[0]

    wide, wide_steps, wide_rec = run(512)
    narrow, narrow_steps, narrow_rec = run(128)
    assert len(wide) == wide_steps and len(narrow) == narrow_steps
    assert wide[:2] == [[512], [488]] and narrow[:8] == [[128]] * 7 + [[104]]
    assert wide[2:] == narrow[8:] == [[1], [1]]  # the decode worker's two steps
    assert narrow_rec.ttft_s - wide_rec.ttft_s == pytest.approx(6 * LM.prefill[0], rel=1e-6)


def test_router_queue_limits_reject_with_resource_exhausted():
    c = SimCluster([SimPool("c", "colocated", 1, LM, BIG)], max_inflight=2, max_queue=3)
    res = simulate(c, wl([(0.0, 64, 8)] * 10))
    s = summarize(res.records, res.duration_s)
    assert s["completed"] == 5 and s["errors"] == {"RESOURCE_EXHAUSTED": 5}
    assert max(r.server["queue_s"] for r in res.records if r.ok) > 0


def test_colocated_prefill_stalls_running_streams_and_disaggregation_does_not():
    """A long prompt arriving mid-stream: on a colocated worker the stream's gap is the mixed
    step; on a decode worker it never sees the prefill."""
    reqs = [(0.0, 32, 60), (0.3, 512, 2)]
    colo = simulate(SimCluster([SimPool("c", "colocated", 1, LM, BIG)]), wl(reqs)).records[0]
    dis = simulate(disagg(), wl(reqs)).records[0]
    mixed = LM.step_time([(512, 0)], 1, 0)
    assert max(colo.itls_s) >= mixed * 0.99
    assert max(dis.itls_s) < LM.decode_time(2, 1200) * 1.01


def test_client_concurrency_cap_is_respected():
    res = simulate(SimCluster([SimPool("c", "colocated", 1, LM, BIG)]), wl([(0.0, 64, 8)] * 10), max_concurrency=3)
    assert max(s[1] for s in res.timeline.samples) == 3
    assert all(r.ok for r in res.records)


@pytest.mark.skipif(not (data_dir() / "traces").is_dir(), reason="shared traces absent")
@pytest.mark.timeout(300)  # a hang guard: this takes ~11 s on one core of a 2-core VM (docs/capacity-planning.md)
def test_an_hour_of_azure_conversation_runs_every_request_through_the_engine_scheduler():
    from loadgen.workloads import build_workload
    from planning.hardware import get_gpu
    from planning.roofline import model_shape, roofline_latency_model

    lm = roofline_latency_model(model_shape("Llama-3-8B"), get_gpu("H100"))
    limits = EngineLimits(16, 30000, 8192, 256)
    c = SimCluster([SimPool("p", "prefill", 2, lm, limits), SimPool("d", "decode", 2, lm, limits)],
                   max_inflight=4096, max_queue=1 << 20)
    w = build_workload("azure-conv")
    res = simulate(c, w)
    assert res.duration_s > 3500 and all(r.ok for r in res.records)
    assert sum(r.output_tokens for r in res.records) == sum(q.output_len for q in w.requests)
    # every prompt token computed on a prefill worker (no cache hits without shared blocks), once
    # unless a preemption made it compute some again
    prefills = [res.workers[f"p-{i}"] for i in range(2)]
    computed, prompts = sum(p["computed_prompt_tokens"] for p in prefills), sum(q.prompt_len for q in w.requests)
    assert computed == prompts if not any(p["preemptions"] for p in prefills) else computed > prompts


def test_plan_simulate_cli_with_a_config_and_a_profile(tmp_path, capsys):
    from cluster.cli import main

    prof = tmp_path / "prof.json"
    LatencyModel(prefill=(0.02, 1e-4, 0, 0), decode=(0.01, 1e-3, 0), kv_bytes_per_token=4096, num_layers=4,
                 meta={"max_model_len": 1024}).save(prof)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: tiny\npools:\n"
                   "  - {name: pre, role: prefill, replicas: 2}\n"
                   "  - {name: dec, role: decode, replicas: 1, engine: {num_pages: 500}}\n")
    out = tmp_path / "sim.json"
    rc = main(["plan", "simulate", "--config", str(cfg), "--profile", str(prof), "--dataset", "random",
               "--num-requests", "40", "--request-rate", "5", "--goodput", "ttft:500", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "pre-1" in text and "dec-0" in text
    doc = json.loads(out.read_text())
    assert doc["summary"]["completed"] == 40 and len(doc["requests"]) == 40
    assert doc["config"]["simulated"] is True


@pytest.mark.parametrize("argv, needle", [
    (["--num-requests", "0"], "--num-requests must be >= 1"),
    (["--prefill", "0"], "--prefill must be >= 1"),
    (["--max-model-len", "1"], "--max-model-len must be >= 2"),
    ([], "no latency model"),
])
def test_plan_simulate_cli_rejects_bad_input(argv, needle, capsys):
    from cluster.cli import main

    assert main(["plan", "simulate", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_a_prefill_slows_a_worker_sharing_its_host_only_while_it_runs():
    """While a prefill runs on another worker of the same host, a decode stream's steps take
    (1 + interference) x longer; the prefill itself is not slowed by a neighbour that only
    decodes (a modelling choice: docs/capacity-planning.md); before and after, nothing is
    slowed. A KV hand-off delays the second token."""
    lm = LatencyModel(prefill=(0.0, 0.001, 0.0, 0.0), decode=(0.01, 0.0, 0.0), kv_bytes_per_token=1,
                      transfer_bytes_per_s=1e12)
    pools = [SimPool("p", "prefill", 1, lm, BIG, host="h"), SimPool("d", "decode", 1, lm, BIG, host="h")]
    reqs = [(0.0, 10, 400), (0.5, 1000, 1)]  # a 1 s prefill arrives while the stream decodes
    alone = simulate(SimCluster(pools), wl(reqs)).records
    shared = simulate(SimCluster(pools, host_interference=0.5, kv_handoff_s=0.005), wl(reqs)).records
    assert max(alone[0].itls_s[1:]) == pytest.approx(0.01) and alone[1].ttft_s == pytest.approx(1.0)
    assert shared[1].ttft_s == pytest.approx(1.0, abs=0.011)
    slow = [g for g in shared[0].itls_s[1:] if g > 0.0101]
    assert all(g == pytest.approx(0.015) for g in slow)
    assert len(slow) == pytest.approx(1.0 / 0.015, abs=2)  # the prefill's 1 s, no more
    assert shared[0].itls_s[0] == pytest.approx(alone[0].itls_s[0] + 0.005)


def test_load_factors_slow_steps_by_streams_alongside_on_the_worker_and_on_its_neighbours():
    """load_same: a step decoding b sequences takes (1 + load_same x (b - 1)) x the model's
    time, a lone stream none; load_other: a worker's steps take (1 + load_other) x longer per
    sequence a neighbour on the same host is decoding, and nothing when it is alone."""
    lm = LatencyModel(prefill=(0.0, 1e-6, 0.0, 0.0), decode=(0.01, 0.0, 0.0))
    two = [(0.0, 4, 101), (0.0, 4, 101)]
    base = simulate(SimCluster([SimPool("c", "colocated", 1, lm, BIG)]), wl(two)).records
    slow = simulate(SimCluster([SimPool("c", "colocated", 1, lm, BIG)], load_same=0.3), wl(two)).records
    assert slow[0].tpot_s == pytest.approx(1.3 * base[0].tpot_s, rel=1e-6)
    one = [(0.0, 4, 101)]
    assert simulate(SimCluster([SimPool("c", "colocated", 1, lm, BIG)], load_same=0.3), wl(one)).records[0].tpot_s \
        == pytest.approx(0.01, rel=1e-6)
    # two colocated workers on one host, one stream each (placement spreads them)
    pools = [SimPool("c", "colocated", 2, lm, BIG, host="h")]
    apart = simulate(SimCluster(pools, load_other=0.25), wl(two)).records
    assert {r.server["decode_worker"] for r in apart} == {"c-0", "c-1"}
    assert all(r.tpot_s == pytest.approx(0.0125, rel=0.02) for r in apart)
    # a neighbour's streams cost a decode step load_other, a step that prefills load_other_prefill
    split = simulate(SimCluster(pools, load_other=0.25, load_other_prefill=0.0), wl(two)).records
    assert all(r.tpot_s == pytest.approx(0.0125, rel=0.02) for r in split)
    prefill_only = simulate(SimCluster(pools, load_other=0.0, load_other_prefill=0.25), wl(two)).records
    assert all(r.tpot_s == pytest.approx(0.01, rel=1e-6) for r in prefill_only)
    no_host = [SimPool("c", "colocated", 2, lm, BIG)]
    assert all(r.tpot_s == pytest.approx(0.01, rel=1e-6)
               for r in simulate(SimCluster(no_host, load_other=0.25), wl(two)).records)



def test_load_base_slows_a_step_that_only_decodes():
    """load_base: under load a step that only decodes takes (1 + load_base) x the model's time,
    alone or not; a step that prefills does not (the first token has its own offset)."""
    lm = LatencyModel(prefill=(0.02, 1e-6, 0.0, 0.0), decode=(0.01, 0.0, 0.0))
    one = [(0.0, 4, 101)]
    base = simulate(SimCluster([SimPool("c", "colocated", 1, lm, BIG)]), wl(one)).records[0]
    slow = simulate(SimCluster([SimPool("c", "colocated", 1, lm, BIG)], load_base=0.07), wl(one)).records[0]
    assert slow.ttft_s == pytest.approx(base.ttft_s, rel=1e-9)
    assert slow.tpot_s == pytest.approx(1.07 * base.tpot_s, rel=1e-6)
    two = [(0.0, 4, 101), (0.0, 4, 101)]
    both = simulate(SimCluster([SimPool("c", "colocated", 1, lm, BIG)], load_base=0.07, load_same=0.3),
                    wl(two)).records
    assert both[0].tpot_s == pytest.approx(1.07 * 1.3 * 0.01, rel=1e-6)

def test_disaggregated_prefill_beside_a_decoding_stream_pays_load_other():
    """1P+1D on one host: a prompt arriving while the decode worker decodes a stream is
    dispatched to the prefill worker between two decode steps (the decode worker takes calls
    then), and its prefill still takes (1 + load_other) x longer per stream decoding beside it;
    alone on the host it takes the model's time."""
    lm = LatencyModel(prefill=(0.0, 1e-3, 0.0, 0.0), decode=(0.01, 0.0, 0.0))
    reqs = wl([(0.0, 4, 201), (0.5, 100, 2), (3.0, 100, 2)])  # the third comes when all is quiet

    def run(load_other, load_other_prefill=None):
        pools = [SimPool("prefill", "prefill", 1, lm, BIG, host="h"), SimPool("decode", "decode", 1, lm, BIG, host="h")]
        return simulate(SimCluster(pools, load_other=load_other, load_other_prefill=load_other_prefill,
                                   busy_admit_s=0.001), reqs).records

    base, slow = run(0.0), run(0.5)
    assert base[1].ttft_s == pytest.approx(0.1 + 0.001, abs=0.011)  # its prefill waits for a decode step's end
    assert slow[1].ttft_s - base[1].ttft_s == pytest.approx(0.5 * 0.1, rel=0.02)
    # a prefill step pays load_other_prefill where it is given (the load fit's TTFT term)
    assert run(0.0, 0.5)[1].ttft_s == pytest.approx(slow[1].ttft_s, rel=1e-9)
    assert run(0.5, 0.0)[1].ttft_s == pytest.approx(base[1].ttft_s, rel=1e-9)
    assert slow[2].ttft_s == pytest.approx(base[2].ttft_s, rel=1e-9) == pytest.approx(0.1, rel=1e-6)



def test_a_long_prefill_pays_only_for_the_part_a_neighbours_stream_overlaps():
    """A 1,000-token prompt (1 s) arrives when the stream next door has about six 10-ms steps
    left: its prefill pays load_other_prefill for the ~6 % of its length that stream decodes,
    not for all of it, as the load fit reads streams (time-averaged over a prompt's TTFT)."""
    lm = LatencyModel(prefill=(0.0, 1e-3, 0.0, 0.0), decode=(0.01, 0.0, 0.0))

    def run(k, arrival):
        pools = [SimPool("prefill", "prefill", 1, lm, BIG, host="h"), SimPool("decode", "decode", 1, lm, BIG, host="h")]
        reqs = wl([(0.0, 4, 21), (arrival, 1000, 2)])
        return simulate(SimCluster(pools, load_other_prefill=k), reqs).records[1]

    base, slow = run(0.0, 0.15), run(0.5, 0.15)
    left = 0.21 - 0.15  # the stream's remaining decode time when the prompt arrives (~6 steps)
    assert slow.ttft_s - base.ttft_s == pytest.approx(0.5 * left, abs=0.015)
    assert slow.ttft_s - base.ttft_s < 0.1 * 0.5  # the whole step slowed would be +0.5 s
    # a stream that outlasts the prefill slows all of it
    long = [SimPool("prefill", "prefill", 1, lm, BIG, host="h"), SimPool("decode", "decode", 1, lm, BIG, host="h")]
    reqs = wl([(0.0, 4, 401), (0.15, 1000, 2)])
    r = simulate(SimCluster(long, load_other_prefill=0.5), reqs).records[1]
    assert r.ttft_s - base.ttft_s == pytest.approx(0.5, rel=0.02)

@pytest.mark.skipif(not (data_dir() / "traces").is_dir(), reason="shared traces absent")
def test_disagg_vs_colocated_predicted_shows_colocated_prefill_stalls(tmp_path, capsys):
    """`bench disagg-vs-colocated --simulate` runs both arms on the same requests without a
    cluster. With prefill at 1 ms a token, a colocated worker's long prompt freezes its streams
    for about a second, so the colocated ITL tail is far above the disaggregated one."""
    from cluster.cli import main

    prof = tmp_path / "prof.json"
    LatencyModel(prefill=(0.01, 1e-3, 0, 0), decode=(0.02, 1e-3, 0), kv_bytes_per_token=4096, num_layers=4,
                 meta={"max_model_len": 2048}).save(prof)
    out = tmp_path / "dvc.json"
    rc = main(["bench", "disagg-vs-colocated", "--simulate", str(prof), "--model", "tiny", "--dtype", "float32",
               "--rates", "0.5,1", "--num-requests", "24", "--json", str(out)])
    assert rc == 0
    assert "[colocated] rate 1.0" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["config"]["simulated"] is True
    assert sorted((r["arm"], r["rate"]) for r in doc["runs"]) == [
        ("colocated", 0.5), ("colocated", 1.0), ("disaggregated", 0.5), ("disaggregated", 1.0)]
    assert all(r["summary"]["completed"] == 24 and r["summary"]["failed"] == 0 for r in doc["runs"])
    assert doc["ratios"]["rate"] == 1.0 and doc["ratios"]["itl_p99_disagg_over_colocated"] < 0.5


@pytest.mark.skipif(not (data_dir() / "traces").is_dir(), reason="shared traces absent")
def test_disagg_vs_colocated_one_arm_for_ab_runs(tmp_path, capsys):
    """`--arms disaggregated` runs that arm alone (an A/B of one arm across commits): its rows,
    no ratios; an unknown arm is refused naming the allowed ones before anything runs."""
    from cluster.cli import main

    prof = tmp_path / "prof.json"
    LatencyModel(prefill=(0.01, 1e-3, 0, 0), decode=(0.02, 1e-3, 0), kv_bytes_per_token=4096, num_layers=4,
                 meta={"max_model_len": 2048}).save(prof)
    out = tmp_path / "one.json"
    rc = main(["bench", "disagg-vs-colocated", "--simulate", str(prof), "--model", "tiny", "--dtype", "float32",
               "--arms", "disaggregated", "--rates", "1", "--num-requests", "12", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [(r["arm"], r["rate"]) for r in doc["runs"]] == [("disaggregated", 1.0)]
    assert doc["ratios"] == {} and "colocated" not in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--arms must list distinct arms of disaggregated, colocated"):
        main(["bench", "disagg-vs-colocated", "--simulate", str(prof), "--arms", "decode", "--json", str(out)])
