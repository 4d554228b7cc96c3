"""The simulator's runs of decode steps (EngineSim._plan_run) against the exact step-by-step
path (`exact_steps=True`): identical per-request records (TTFT, every token's time, finish,
placement, errors), identical worker statistics, and identical steps, each step the batch the
engine's own Scheduler built on the exact path; and the planner's early stop and process
parallelism against its plain search."""
import random

import pytest

from engine.scheduler import Scheduler
from loadgen.workloads import Workload, WorkloadRequest, data_dir
from planning.latency import LatencyModel
from planning.sim_engine import EngineLimits, EngineSim
from planning.sim_spec import SimCluster, SimPool
from planning.simulator import Simulator

LM = LatencyModel(prefill=(0.02, 0.08 / 512, 0.0, 0.0), decode=(0.01, 0.001, 1e-6), kv_bytes_per_token=1000,
                  transfer_bytes_per_s=1e9, transfer_overhead_s=0.002)
BIG = EngineLimits(page_size=16, num_pages=1 << 20, max_num_batched_tokens=512, max_num_seqs=4096)
TIGHT = EngineLimits(page_size=16, num_pages=300, max_num_batched_tokens=256, max_num_seqs=16)


def poisson(n, rate, inp, out, seed=0, blocks=0):
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        prompt = rng.randint(*inp)
        prefix = tuple(rng.randrange(blocks) for _ in range(1)) if blocks else ()
        reqs.append(WorkloadRequest(i, t, prompt, rng.randint(*out), prefix_blocks=(prefix + (i + 1000,)) if blocks else ()))
    return Workload(reqs, 64 if blocks else 0, "t")


def run(cluster, workload, exact, **kw):
    """(records, workers, steps per worker, scheduler batches per worker on the exact path)."""
    sim = Simulator(cluster, exact_steps=exact)
    traces = {}
    for v in sim._order:
        v.worker.trace = traces.setdefault(v.worker.name, [])
    batches = []
    real = Scheduler.schedule

    def recording(self):
        batch = real(self)
        if not batch.empty:
            batches.append((id(self), tuple((r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens))))
        return batch

    Scheduler.schedule = recording
    try:
        res = sim.run(workload, **kw)
    finally:
        Scheduler.schedule = real
    by_sched = {}
    for v in sim._order:
        by_sched[v.worker.name] = [b for s, b in batches if s == id(v.worker.scheduler)]
    return res, traces, by_sched


def key(rec):
    return (rec.index, rec.ok, rec.error, rec.ttft_s, rec.e2e_s, tuple(rec.chunk_times_s), rec.output_tokens,
            rec.cached_tokens, tuple(sorted(rec.server.items())) if rec.server else None)


def assert_same(cluster, workload, min_saved=0.3, **kw):
    fast, fast_trace, fast_batches = run(cluster, workload, False, **kw)
    exact, exact_trace, exact_batches = run(cluster, workload, True, **kw)
    assert [key(r) for r in fast.records] == [key(r) for r in exact.records]
    assert fast.workers == exact.workers  # steps, busy time, batch sizes, preemptions, cached tokens
    # the same steps, each at the same time with the same batch, and on the exact path every
    # step is a batch the engine's Scheduler built
    assert fast_trace == exact_trace
    for name, trace in exact_trace.items():
        assert [b for _, b in trace] == exact_batches[name]
        assert len(trace) == exact.workers[name]["steps"]
    # the fast path really ran runs: most decode steps were never scheduled one by one
    scheduled = sum(len(b) for b in fast_batches.values())
    steps = sum(w["steps"] for w in exact.workers.values())
    assert scheduled <= (1 - min_saved) * steps, (scheduled, steps)
    return fast, exact


def test_disaggregated_poisson_load_is_identical_step_for_step():
    c = SimCluster([SimPool("p", "prefill", 2, LM, BIG), SimPool("d", "decode", 2, LM, BIG)],
                   max_inflight=1 << 20, max_queue=1 << 20, policy="least-loaded")
    assert_same(c, poisson(400, 6.0, (32, 900), (1, 300)))


def test_decode_pages_running_out_preemptions_and_page_queue_are_identical():
    c = SimCluster([SimPool("p", "prefill", 1, LM, BIG), SimPool("d", "decode", 2, LM, TIGHT)],
                   max_inflight=1 << 20, max_queue=1 << 20, busy_admit_s=0.003, kv_handoff_s=0.001)
    fast, _ = assert_same(c, poisson(200, 8.0, (64, 600), (50, 400), seed=1), min_saved=0.1)
    assert sum(w["preemptions"] for w in fast.workers.values()) > 0


def test_colocated_mixed_steps_load_terms_and_router_limits_are_identical():
    c = SimCluster([SimPool("c", "colocated", 2, LM, TIGHT)], max_inflight=24, max_queue=30, load_base=0.1,
                   load_same=0.02, first_token_delay_s=0.004)
    fast, _ = assert_same(c, poisson(300, 12.0, (16, 400), (1, 200), seed=2), min_saved=0.1)
    assert any(r.error == "RESOURCE_EXHAUSTED" for r in fast.records)


def test_shared_prefixes_the_prefix_cache_and_a_client_cap_are_identical():
    c = SimCluster([SimPool("p", "prefill", 2, LM, BIG), SimPool("d", "decode", 1, LM, EngineLimits(16, 3000, 512, 64),
                                                                local_prefill_threshold=128)],
                   max_inflight=1 << 20, max_queue=1 << 20, policy="prefix-aware")
    fast, _ = assert_same(c, poisson(250, 5.0, (100, 500), (2, 250), seed=3, blocks=6), max_concurrency=40,
                          min_saved=0.1)
    assert sum(r.cached_tokens for r in fast.records) > 0


def test_zero_time_decode_steps_as_the_planner_uses_them():
    free = EngineLimits(16, 1 << 30, 8192, 1 << 20)
    c = SimCluster([SimPool("p", "prefill", 1, LM, BIG), SimPool("d", "decode", 1, LatencyModel(), free)],
                   max_inflight=1 << 20, max_queue=1 << 20)
    assert_same(c, poisson(200, 5.0, (32, 512), (1, 300), seed=4))


@pytest.mark.skipif(not (data_dir() / "traces").is_dir(), reason="shared traces absent")
@pytest.mark.parametrize("dataset,n", [("azure-conv", 800), ("mooncake-conv", 100)])
def test_trace_prefixes_on_roofline_workers_are_identical(dataset, n):
    from loadgen.workloads import build_workload
    from planning.hardware import get_gpu
    from planning.roofline import model_shape, roofline_latency_model

    lm = roofline_latency_model(model_shape("Llama-3-8B"), get_gpu("H100"))
    limits = EngineLimits(16, 30000, 8192, 256)
    c = SimCluster([SimPool("p", "prefill", 2, lm, limits), SimPool("d", "decode", 2, lm, limits)],
                   max_inflight=4096, max_queue=1 << 20)
    assert_same(c, build_workload(dataset, num_requests=n), min_saved=0.5)


def test_a_worker_with_a_neighbour_on_its_host_steps_one_by_one():
    """Interference reads a neighbour's streams at every step: no runs there (exact by construction)."""
    pools = [SimPool("p", "prefill", 1, LM, BIG, host="h"), SimPool("d", "decode", 1, LM, BIG, host="h")]
    c = SimCluster(pools, host_interference=0.5)
    w = poisson(40, 4.0, (32, 300), (20, 100))
    fast, _, batches = run(c, w, False)
    exact, _, _ = run(c, w, True)
    assert [key(r) for r in fast.records] == [key(r) for r in exact.records]
    assert sum(len(b) for b in batches.values()) == sum(x["steps"] for x in fast.workers.values())


def test_search_stops_replays_early_and_in_processes_finds_the_same_plans():
    from planning import search as S

    inst = [S.Instance("H100", 1, LM, 4096, 4.0), S.Instance("A100-80GB", 1,
            LatencyModel(prefill=(0.03, 0.12 / 512, 0.0, 0.0), decode=(0.008, 0.0015, 2e-6), kv_bytes_per_token=1000,
                         transfer_bytes_per_s=1e9), 8192, 2.0)]
    space = S.SearchSpace(inst, {"H100": 2, "A100-80GB": 2}, 3)
    wl = poisson(80, 3.0, (64, 600), (8, 120), seed=5)
    slo = {"ttft": 400.0, "tpot": 30.0}

    def plans(**kw):
        out = S.search(space, wl, slo, verify=3, **kw)
        return [(p.describe(), p.estimate, p.goodput, p.attainment) for p in out]

    calls = []
    real = S.simulate

    def counting(*a, **kw):
        res = real(*a, **kw)
        calls.append(res.stopped)
        return res

    S.simulate = counting
    try:
        fast = plans()
    finally:
        S.simulate = real
    assert any(calls), "no replay was stopped early"
    space.exact_steps = True
    assert plans(jobs=2) == fast
    # a stopped replay's attainment is below the target, as the whole replay's is
    c = S.plan_cluster(S.Plan("colocated", [("colocated", 1, inst[0])], 0.0), space)
    long = S.rescale(wl, 40.0, 60.0)
    whole = real(c, long)
    cut = real(c, long, stop_after_misses=(slo, S.max_misses(len(long.requests), 0.9)))
    assert cut.stopped and len(cut.records) == len(whole.records)
    att = lambda res: sum(S.meets_slo(r, slo) for r in res.records) / len(res.records)  # noqa: E731
    assert att(cut) <= att(whole) < 0.9


def test_max_misses_is_the_exact_boundary():
    from planning.search import max_misses

    for n in (1, 7, 10, 99, 1000, 40000):
        for target in (0.5, 0.9, 0.95, 0.99, 1.0):
            m = max_misses(n, target)
            assert (n - m) / n >= target and (m + 1 > n or (n - m - 1) / n < target)


def test_decode_step_times_are_step_times_bit_for_bit():
    rng = random.Random(7)
    models = [LM, LatencyModel(), LatencyModel(decode=(-0.002, 0.0004, 3e-7)), LatencyModel(decode=(0.0, -1e-4, 1e-9))]
    models += [LatencyModel(decode=(rng.uniform(-0.01, 0.03), rng.uniform(-1e-3, 1e-3), rng.uniform(-1e-6, 1e-5)))
               for _ in range(20)]
    for lm in models:
        for b in (1, 2, 7, 256):
            ctx = rng.randrange(0, 1 << 20)
            got = lm.decode_step_times(b, ctx, 50)
            assert got == [lm.step_time((), b, ctx + k * b) for k in range(50)]
            assert [x.hex() for x in got] == [lm.step_time((), b, ctx + k * b).hex() for k in range(50)]


def test_page_hashes_by_block_are_the_per_page_formula():
    from planning.sim_request import SimRequest

    rng = random.Random(3)
    for bt, ps in ((64, 16), (512, 16), (48, 16), (16, 16), (40, 16)):
        for _ in range(30):
            keys = tuple(rng.randrange(1000) for _ in range(rng.randrange(0, 6)))
            prompt = rng.randrange(1, len(keys) * bt + 100)
            r = SimRequest(rng.randrange(100), 0.0, prompt, 5, keys, bt)
            shared = min(len(keys) * bt, prompt) // ps
            want = [((keys[((j + 1) * ps - 1) // bt] + 1) << 24) + j for j in range(shared)]
            own = (1 << 63) + (r.index << 24)
            want += range(own + shared, own + prompt // ps)
            assert r.page_hashes(ps) == want


def test_the_simulated_routers_bulk_remember_is_the_routers_remember():
    from planning.sim_router import RouterView
    from router.policy import WorkerView

    rng = random.Random(11)
    mine, theirs = RouterView("w", "p", "prefill"), WorkerView("w", "p", "prefill")
    for _ in range(300):
        keys = rng.sample(range(400), rng.randrange(0, 60))
        cap = rng.choice((1, 50, 120, 1000))
        mine.remember(keys, cap)
        theirs.remember(keys, cap)
        assert list(mine.cached) == list(theirs.cached)


def test_joins_and_last_tokens_inside_runs_are_identical_to_exact_steps():
    """A decode worker with long streams: a request whose KV arrives ends the run with its step
    in flight (nothing applied until then), joins at the first step of the next run (built by
    the scheduler), and the step that samples a stream's last token closes a run; the records,
    steps and batches are the exact path's, and the decode worker's scheduler builds little
    more than one batch per join and per finish."""
    c = SimCluster([SimPool("p", "prefill", 1, LM, BIG), SimPool("d", "decode", 1, LM, BIG)],
                   max_inflight=1 << 20, max_queue=1 << 20)
    w = poisson(120, 3.0, (32, 400), (150, 400), seed=8)
    ended = []
    real_end = EngineSim.end_run

    def counting(self):
        if self.run is not None:
            ended.append(self.name)
        real_end(self)

    EngineSim.end_run = counting
    try:
        assert_same(c, w, min_saved=0.7)
    finally:
        EngineSim.end_run = real_end
    assert ended.count("d-0") > 50  # joins landed inside runs
    _, _, batches = run(c, w, False)
    assert len(batches["d-0"]) <= 2.5 * len(w.requests)


def test_runs_with_every_sequence_slot_taken_and_requests_waiting_are_identical():
    """Decode and colocated workers whose sequence slots are all taken, with requests ready to
    join or waiting: nothing can change the batch before a request finishes, so runs go on."""
    slots = EngineLimits(page_size=16, num_pages=1 << 16, max_num_batched_tokens=512, max_num_seqs=6)
    c = SimCluster([SimPool("p", "prefill", 1, LM, BIG), SimPool("d", "decode", 1, LM, slots)],
                   max_inflight=1 << 20, max_queue=1 << 20)
    assert_same(c, poisson(150, 6.0, (32, 300), (20, 200), seed=9), min_saved=0.5)
    c = SimCluster([SimPool("c", "colocated", 1, LM, slots)], max_inflight=1 << 20, max_queue=1 << 20)
    assert_same(c, poisson(150, 6.0, (32, 300), (20, 200), seed=10), min_saved=0.5)
