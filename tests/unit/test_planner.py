"""The planner finds the known-best configuration on a constructed case, sizes pools from
instance capacities that the end-to-end simulation confirms, and its CLI validates input."""
import pytest

from loadgen.workloads import Workload, WorkloadRequest, gamma_arrivals
from planning.latency import LatencyModel
from planning.search import (Instance, Plan, SearchSpace, enumerate_plans, max_goodput, pareto_front,
                                     plan_cluster, search)
from planning.sim_engine import EngineLimits

# "compute-rich": fast prefill, decode steps far over the TPOT SLO.
COMPUTE = LatencyModel(prefill=(0.01, 0.0005, 0.0, 0.0), decode=(0.2, 0.0, 0.0), kv_bytes_per_token=100)
# "memory-rich": prefills take over the TTFT SLO, decode steps are fast.
MEMORY = LatencyModel(prefill=(0.05, 0.005, 0.0, 0.0), decode=(0.01, 0.0001, 0.0), kv_bytes_per_token=100)
SLO = {"ttft": 500.0, "tpot": 50.0}


def workload(n=300, rate=1.0) -> Workload:
    return Workload([WorkloadRequest(i, t, 200, 20) for i, t in enumerate(gamma_arrivals(n, rate, 1.0, seed=5))],
                    0, "constructed")


def space(**kw) -> SearchSpace:
    insts = [Instance("C", 1, COMPUTE, 10000, 1.0), Instance("M", 1, MEMORY, 10000, 1.0)]
    limits = EngineLimits(16, 1, 4096, 4)
    return SearchSpace(insts, {"C": 2, "M": 2}, 4, prefill_limits=limits, decode_limits=limits, **kw)


def test_planner_puts_prefill_on_compute_and_decode_on_memory_sized_by_capacity():
    plans = search(space(), workload(), SLO, objective="per-dollar", verify=3)
    best = plans[0]
    assert best.verified and best.mode == "disaggregated"
    assert [(role, n, inst.gpu) for role, n, inst in best.pools] == [("prefill", 2, "C"), ("decode", 1, "M")]
    # every colocated plan, and every plan with a phase on the wrong hardware, has no goodput
    for p in plans:
        wrong = any((role == "prefill" and inst.gpu == "M") or (role in ("decode", "colocated") and inst.gpu == "C")
                    for role, _, inst in p.pools)
        if wrong:
            assert p.best_goodput == 0.0, p.describe()
    # the whole-cluster simulation confirms the estimate from instance capacities, or beats it
    # a little: two prefill workers behind one queue wait less than two separate ones (M/D/2)
    assert best.estimate * 0.95 <= best.goodput <= best.estimate * 1.4
    assert best.attainment == 1.0  # at the workload's own 1 req/s


def test_max_goodput_matches_the_single_server_capacity():
    """One prefill instance of D = 0.11 s per prompt under a 0.5 s TTFT SLO at 90 %: M/D/1
    sojourn <= 0.5 s at the 90th percentile needs rho well below 1, far above 1/D/2."""
    sp = space()
    plan = Plan("disaggregated", [("prefill", 1, sp.instances[0]), ("decode", 1, sp.instances[1])], 0.0)
    g = max_goodput(plan_cluster(plan, sp), workload(), {"ttft": 500.0}, 0.9, 1.0)
    d = COMPUTE.prefill_time(200)
    assert 0.5 / d < g < 1.0 / d


def test_enumeration_respects_the_inventory_and_pareto_front_is_monotone():
    sp = space()
    caps = {(r, i): 1.0 + i for r in ("prefill", "decode", "colocated") for i in range(2)}
    plans = enumerate_plans(sp, caps)
    assert plans and all(p.gpus <= 4 and all(n <= 2 for n in p.gpus_by_type().values()) for p in plans)
    front = pareto_front(plans)
    prices = [p.price_per_hour for p in front]
    goodputs = [p.best_goodput for p in front]
    assert prices == sorted(prices) and goodputs == sorted(goodputs) and len(set(goodputs)) == len(goodputs)


def test_search_rejects_bad_input():
    with pytest.raises(ValueError, match="objective"):
        search(space(), workload(), SLO, objective="cheapest")
    with pytest.raises(ValueError, match="at least one SLO"):
        search(space(), workload(), {})
    with pytest.raises(ValueError, match="attainment"):
        search(space(), workload(), SLO, target=1.5)


def test_plan_search_cli_on_gpu_rooflines(tmp_path, capsys):
    from cluster.cli import main

    out, png = tmp_path / "plans.json", tmp_path / "pareto.png"
    rc = main(["plan", "search", "--inventory", "2xH100,2xA100", "--tp", "1", "--dataset", "random",
               "--num-requests", "150", "--request-rate", "4", "--random-input-len", "200:800",
               "--random-output-len", "20:100", "--goodput", "ttft:1000", "tpot:50", "--verify", "2",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "goodput" in text and ("xP[H100]" in text or "xC[H100]" in text)
    import json

    doc = json.loads(out.read_text())
    assert sum(p["verified"] for p in doc["plans"]) == 2 and png.stat().st_size > 1000


@pytest.mark.parametrize("argv, needle", [
    (["--inventory", "8xQ100", "--goodput", "ttft:100"], "unknown"),
    (["--inventory", "8xH100", "--tp", "0", "--goodput", "ttft:100"], "--tp values must be >= 1"),
    (["--inventory", "8xH100"], "--goodput needs at least one SLO"),
    (["--goodput", "ttft:100"], "give --inventory"),
    (["--inventory", "8xH100", "--goodput", "ttft:100", "--attainment", "2"], "--attainment must be in (0, 1]"),
])
def test_plan_search_cli_rejects_bad_input(argv, needle, capsys):
    from cluster.cli import main

    assert main(["plan", "search", "--dataset", "random", *argv]) == 2
    assert needle in capsys.readouterr().err
