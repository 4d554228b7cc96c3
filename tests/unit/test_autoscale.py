"""The SLA planner's decision logic (cluster.autoscale.Planner) on synthetic loads, its window
statistics on a real RouterMetrics, the Autoscaler's advisory/on split on a real PoolTargets,
and the `autoscale` config's validation messages."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from cluster.autoscale import Autoscaler, Planner, PoolSignal
from cluster.autoscale_window import Window, percentile
from cluster.config import ClusterConfig
from router.metrics import RouterMetrics
from router.service import PoolTargets

SLO = {"ttft_s": 1.0, "itl_s": 0.1, "percentile": 90}


def config(pools=None, mode="on", **auto):
    pools = pools or [{"name": "colocated", "role": "colocated", "replicas": 1}]
    a = {"mode": mode, "pools": {p["name"]: {"min_replicas": 1, "max_replicas": 3} for p in pools},
         "slo": SLO, "interval_s": 1, "up_cooldown_s": 10, "down_cooldown_s": 30, **auto}
    return ClusterConfig.model_validate({"model": "tiny", "pools": pools, "autoscale": a})


def planner(cfg=None, applies=True):
    cfg = cfg or config()
    return Planner(cfg.autoscale, cfg.pools, applies=applies)


def busy(target=1, current=None, **kw):
    base = dict(target=target, current=target if current is None else current, running=8, requests=20,
                ttft_s=0.2, itl_s=0.02, kv_used=0.2)
    return PoolSignal(**{**base, **kw})


def idle(target=1, current=None):
    return PoolSignal(target=target, current=target if current is None else current)


def test_up_on_itl_slo_miss_after_the_up_cooldown_from_start():
    # the first tick starts the cooldown clock (a start is a change)
    p = planner()
    assert [d.direction for d in p.tick({"colocated": busy(itl_s=0.5)}, 0.0)] == ["hold"]  # cooldown, logged once
    assert p.tick({"colocated": busy(itl_s=0.5)}, 5.0) == []  # the same hold is not logged again
    (d,) = p.tick({"colocated": busy(itl_s=0.5)}, 10.0)
    assert (d.direction, d.reason, d.target, d.desired) == ("up", "itl_slo", 1, 2)
    assert d.inputs["itl_s"] == 0.5 and d.inputs["slo_itl_s"] == 0.1


@pytest.mark.parametrize("kw,reason", [({"ttft_s": 3.0}, "ttft_slo"), ({"step_itl_s": 0.4}, "itl_slo"),
                                       ({"kv_used": 0.95}, "kv_pressure"), ({"waiting": 4}, "queue")])
def test_up_reasons(kw, reason):
    p = planner()
    p.tick({"colocated": busy()}, 0.0)
    (d,) = p.tick({"colocated": busy(**kw)}, 10.0)
    assert (d.direction, d.reason, d.desired) == ("up", reason, 2)


def test_one_step_per_tick_and_none_while_the_scaler_moves():
    p = planner()
    p.tick({"colocated": busy()}, 0.0)
    (d,) = p.tick({"colocated": busy(itl_s=0.5)}, 10.0)
    assert d.desired == 2
    # the target is 2, one worker serves: the scaler is moving it, the planner waits
    assert p.tick({"colocated": busy(target=2, current=1, itl_s=0.5)}, 30.0) == []
    # serving at 2: the up cooldown counts from the second worker serving (31 s)
    assert [x.reason for x in p.tick({"colocated": busy(target=2, itl_s=0.5)}, 31.0)] == ["cooldown"]
    assert p.tick({"colocated": busy(target=2, itl_s=0.5)}, 40.0) == []
    (d,) = p.tick({"colocated": busy(target=2, itl_s=0.5)}, 41.0)
    assert (d.target, d.desired) == (2, 3)


def test_max_is_respected_and_logged_once():
    p = planner()
    p.tick({"colocated": busy(target=3)}, 0.0)
    (d,) = p.tick({"colocated": busy(target=3, itl_s=0.5)}, 100.0)
    assert (d.direction, d.reason, d.desired) == ("hold", "at_max", 3)
    assert p.tick({"colocated": busy(target=3, itl_s=0.5)}, 200.0) == []
    assert p.wanted["colocated"] == 3


def test_budget_is_respected_across_pools():
    pools = [{"name": "prefill", "role": "prefill", "replicas": 1, "resources": {"num_cpus": 2}},
             {"name": "decode", "role": "decode", "replicas": 1, "resources": {"num_cpus": 1}}]
    cfg = config(pools, budget_cpus=4)
    p = planner(cfg)
    sig = {"prefill": busy(), "decode": busy()}
    p.tick(sig, 0.0)
    # both miss: prefill (2 CPUs) fits 3 + 2 > 4? 2 + 1 used, +2 = 5 > 4: held; decode +1 = 4 fits
    ds = p.tick({"prefill": busy(ttft_s=5.0), "decode": busy(itl_s=0.5)}, 10.0)
    assert [(d.pool, d.direction, d.reason) for d in ds] == [("prefill", "hold", "budget"), ("decode", "up", "itl_slo")]
    # a decode pool is not held to TTFT (the prefill pool's), a prefill pool not to ITL
    p2 = planner(cfg)
    p2.tick(sig, 0.0)
    assert p2.tick({"prefill": busy(itl_s=5.0), "decode": busy(ttft_s=50.0)}, 10.0) == []


def test_down_to_min_at_zero_traffic_after_the_down_cooldown():
    p = planner()
    p.tick({"colocated": idle(target=3)}, 0.0)
    assert p.tick({"colocated": idle(target=3)}, 29.0) == []
    (d,) = p.tick({"colocated": idle(target=3)}, 30.0)
    assert (d.direction, d.reason, d.target, d.desired) == ("down", "idle", 3, 2)
    assert p.tick({"colocated": idle(target=2)}, 31.0) == []  # cooldown from that change
    (d,) = p.tick({"colocated": idle(target=2)}, 60.0)
    assert (d.direction, d.desired) == ("down", 1)
    assert p.tick({"colocated": idle(target=1)}, 1000.0) == []  # at min: stays


def test_down_only_when_well_under_the_slo_with_one_fewer():
    p = planner()
    p.tick({"colocated": busy(target=2)}, 0.0)
    # 0.03 * 2/1 = 0.06 > 0.5 * 0.1: one worker fewer would be too close to the SLO
    assert p.tick({"colocated": busy(target=2, itl_s=0.03)}, 100.0) == []
    (d,) = p.tick({"colocated": busy(target=2, itl_s=0.02)}, 100.0)
    assert (d.direction, d.reason) == ("down", "under_slo")
    # requests waiting: no scale-in
    p = planner()
    p.tick({"colocated": busy(target=2)}, 0.0)
    assert p.tick({"colocated": busy(target=2, itl_s=0.01, waiting=1)}, 100.0) == []


def test_below_min_and_above_max_are_corrected_at_once():
    p = planner()
    p.tick({"colocated": idle(target=5)}, 0.0)
    (d,) = p.tick({"colocated": idle(target=5)}, 0.5)
    assert (d.direction, d.reason, d.desired) == ("down", "max", 4)
    cfg = config(**{"pools": None})
    cfg.autoscale.pools["colocated"].min_replicas = 2
    p = planner(cfg)
    (d,) = p.tick({"colocated": idle(target=1)}, 0.0)
    assert (d.direction, d.reason, d.desired) == ("up", "min", 2)


def test_slow_loop_floor_by_littles_law():
    cfg = config([{"name": "prefill", "role": "prefill", "replicas": 1, "engine": {"max_num_batched_tokens": 256}},
                  {"name": "decode", "role": "decode", "replicas": 1, "engine": {"max_num_seqs": 8}}])
    p = planner(cfg)
    # 2 req/s, 10 s each in the system: 20 in the system, 8 per batch -> 3 decode workers;
    # prompts of 128 tokens: 2 per prefill step, 2 req/s * 1.5 s prefill = 3 -> 2 prefill workers
    floors = p.set_floors({"rate": 2.0, "e2e_s": 10.0, "prompt_tokens": 128.0, "prefill_s": 1.5})
    assert floors == {"prefill": 2, "decode": 3}
    p.tick({"prefill": idle(), "decode": idle()}, 0.0)
    ds = p.tick({"prefill": idle(), "decode": idle()}, 1.0)
    assert [(d.pool, d.direction, d.reason) for d in ds] == [("prefill", "up", "floor"), ("decode", "up", "floor")]
    assert p.set_floors({"rate": 0.0}) == {"prefill": 1, "decode": 1}
    assert p.set_floors({"rate": 100.0, "e2e_s": 100.0, "prompt_tokens": 10, "prefill_s": 1}) == {"prefill": 3,
                                                                                                   "decode": 3}


def test_a_scale_call_restarts_the_cooldown():
    p = planner()
    p.tick({"colocated": idle(target=2)}, 0.0)
    p.tick({"colocated": idle(target=3)}, 25.0)  # someone called Scale
    assert p.tick({"colocated": idle(target=3)}, 35.0) == []
    assert [d.desired for d in p.tick({"colocated": idle(target=3)}, 55.0)] == [2]


def test_percentile_and_window_over_real_histograms():
    assert percentile([0.1, 0.2, float("inf")], [0, 10, 10], 50) == pytest.approx(0.15)
    assert percentile([0.1, 0.2, float("inf")], [0, 0, 10], 99) == 0.2
    assert percentile([0.1, float("inf")], [0, 0], 90) is None
    m = RouterMetrics()
    w = Window(m, keep_s=100)
    w.snapshot(0.0)
    for _ in range(10):
        m.ttft.observe(3.0)
        m.itl.observe(0.03)
    m.requests.labels(finish_reason="length").inc(10)
    m.prompt_tokens.inc(1000)
    m.generation_tokens.inc(500)
    for _ in range(10):
        m.e2e.observe(4.0)
        m.prefill.observe(0.5)
    w.snapshot(10.0)
    f = w.fast(10.0, 30.0, 90)
    assert 2.5 <= f["ttft_s"] <= 5.0 and 0.025 <= f["itl_s"] <= 0.05 and f["requests"] == 10
    s = w.slow(10.0, 60.0)
    assert s["rate"] == pytest.approx(1.0) and s["prompt_tokens"] == 100 and s["output_tokens"] == 50
    assert s["e2e_s"] == pytest.approx(4.0) and s["prefill_s"] == pytest.approx(0.5)
    # nothing new over the last 5 s: no sample in the fast window
    w.snapshot(20.0)
    assert w.fast(20.0, 5.0, 90) == {"ttft_s": None, "itl_s": None, "requests": 0}


class _Dispatcher:
    def __init__(self):
        self.views = {}


class _Service:
    """The two attributes the Autoscaler reads of router.service.InferenceService."""
    def __init__(self):
        self.metrics = RouterMetrics()
        self.dispatcher = _Dispatcher()


@pytest.mark.parametrize("mode", ["advisory", "on"])
def test_advisory_changes_no_target_and_on_sets_it_as_scale_does(mode, caplog):
    cfg = config(mode=mode, up_cooldown_s=0)
    svc = _Service()
    targets = PoolTargets({"colocated": "colocated"}, {"colocated": 1})
    # what the driver pushes (cluster.runtime.Cluster.scale_status): one worker serving
    targets.status = {"pools": {"colocated": {"target": 1, "stamp": 0.0, "current": 1, "start_failures": 0,
                                              "error": ""}}, "workers": []}
    now = [0.0]
    a = Autoscaler(cfg, svc, targets, clock=lambda: now[0])
    a.step()
    for _ in range(20):
        svc.metrics.itl.observe(0.5)
    now[0] = 1.0
    with caplog.at_level("INFO", logger="pdcluster.autoscale"):
        (d,) = a.step()
    assert (d.direction, d.reason, d.desired) == ("up", "itl_slo", 2)
    line = json.loads(caplog.records[-1].getMessage())
    assert line["event"] == "autoscale" and line["direction"] == "up" and line["reason"] == "itl_slo"
    assert line["applied"] == (mode == "on") and line["inputs"]["router_itl_s"] > 0.1
    assert a.since(0)[-1][1] == caplog.records[-1].getMessage()
    text = __import__("prometheus_client").generate_latest(svc.metrics.registry).decode()
    assert 'pdcluster_autoscale_desired_replicas{pool="colocated"} 2.0' in text
    assert 'pdcluster_autoscale_decisions_total{direction="up",pool="colocated",reason="itl_slo"} 1.0' in text
    if mode == "advisory":
        assert targets.target("colocated") == 1 and targets.requests == {}
    else:
        assert targets.target("colocated") == 2 and targets.requests["colocated"][1] == 2


@pytest.mark.parametrize("auto,field_", [
    ({"interval_s": 10}, "autoscale.interval_s\n  Input should be less than or equal to 5"),
    ({"mode": "maybe"}, "autoscale.mode\n  Input should be 'off', 'advisory' or 'on'"),
    ({"slo": {"percentile": 100}}, "autoscale.slo.percentile\n  Input should be less than 100"),
    ({"slo": {"ttft_s": 0}}, "autoscale.slo.ttft_s\n  Input should be greater than 0"),
    ({"pools": {"colocated": {"max_replicas": 17}}},
     "autoscale.pools.colocated.max_replicas\n  Input should be less than or equal to 16"),
    ({"pools": {"colocated": {"min_replicas": 3, "max_replicas": 2}}},
     "autoscale.pools.colocated.min_replicas must be in [1, max_replicas 2], got 3"),
    ({"pools": {"nope": {}}}, "autoscale.pools: 'nope' is not a pool"),
    ({"budget_cpus": 0.5, "pools": {"colocated": {"min_replicas": 2, "max_replicas": 3}}},
     "autoscale.budget_cpus must be >= 2"),
])
def test_config_errors_name_the_field_and_range(auto, field_):
    with pytest.raises(ValidationError) as e:
        ClusterConfig.model_validate({"model": "tiny", "pools": [{"name": "colocated", "role": "colocated"}],
                                      "autoscale": auto})
    assert field_ in str(e.value), str(e.value)


def test_config_default_is_off():
    assert ClusterConfig.model_validate({"pools": [{"name": "c", "role": "colocated"}]}).autoscale.mode == "off"


# ---- the slow loop's simulator floor (config autoscale.floor: simulator) ---------------------------
def test_floors_are_computed_apart_from_being_applied_and_kept_in_bounds():
    p = planner()
    assert p.littles_law_floors({"rate": 100.0, "e2e_s": 100.0}) == {"colocated": 3}
    assert p.state["colocated"].floor == 1  # not applied
    assert p.apply_floors({"colocated": 9}) == {"colocated": 3} and p.state["colocated"].floor == 3
    assert p.apply_floors({}) == {"colocated": 1}
    p.apply_floors({"colocated": 2})
    p.tick({"colocated": idle()}, 0.0)
    (d,) = p.tick({"colocated": idle()}, 1.0)
    assert (d.direction, d.reason, d.desired) == ("up", "floor", 2)


def _profile(tmp_path, **lm):
    from planning.latency import LatencyModel

    path = tmp_path / "profile.json"
    model = LatencyModel(prefill=(0.01, 1.5e-4, 1e-8, 0.0), decode=(0.015, 0.002, 2e-7), **lm)
    path.write_text(json.dumps({"latency_model": model.to_json(), "model": "test"}))
    return str(path)


def test_request_samples_give_the_window_spread_and_prefix_hits():
    import logging

    from cluster.autoscale_window import RequestSamples
    from router.metrics import log_request

    logger = logging.getLogger("pdcluster.requests")
    before = (logger.level, logger.propagate)
    now = [0.0]
    s = RequestSamples(lambda: now[0])
    s.attach()
    try:
        for i, (p, o, c) in enumerate([(100, 10, 0), (300, 30, 100), (200, 20, 100)]):
            now[0] = float(i)
            log_request({"request_id": str(i), "prompt_tokens": p, "completion_tokens": o, "cached_tokens": c})
        log_request({"request_id": "x", "prompt_tokens": 5000, "completion_tokens": 0, "error": "CANCELLED"})
    finally:
        s.detach()
    assert (logger.level, logger.propagate) == before
    assert s.spread(2.0, 60.0) == {"samples": 3, "prompt_cv": 0.5, "output_cv": 0.5, "prefix_hit": 0.3333}
    assert s.spread(2.0, 0.5) == {"samples": 1, "prompt_cv": None, "output_cv": None, "prefix_hit": 0.5}
    log_request({"request_id": "late", "prompt_tokens": 1, "completion_tokens": 1})  # detached: not kept
    assert len(s.samples) == 3


def _drive(a, svc, now, rate_s=0.5, n=40):
    """n finished requests of 512-token prompts and 64 outputs, one every rate_s seconds, through
    the router's metrics and request log, as the service records them."""
    from router.metrics import log_request

    for i in range(n):
        now[0] += rate_s
        svc.metrics.requests.labels(finish_reason="length").inc()
        svc.metrics.prompt_tokens.inc(512)
        svc.metrics.generation_tokens.inc(64)
        svc.metrics.e2e.observe(2.0)
        svc.metrics.prefill.observe(0.1)
        log_request({"request_id": str(i), "prompt_tokens": 512, "completion_tokens": 64, "cached_tokens": 128})


def test_autoscaler_runs_the_simulator_floor_in_a_process(tmp_path, caplog):
    import asyncio

    from types import SimpleNamespace

    cfg = config(floor="simulator", profile=_profile(tmp_path), slow_interval_s=20, floor_timeout_s=15)
    svc = _Service()
    # one serving worker reporting its KV pages: the simulated replicas get as many
    load = SimpleNamespace(running_requests=0, waiting_requests=0, queued_tokens=0, tokens_per_s=0.0,
                           total_pages=4096, free_pages=4096)
    svc.dispatcher.views["w"] = SimpleNamespace(pool="colocated", state="serving", load=load)
    targets = PoolTargets({"colocated": "colocated"}, {"colocated": 1})
    now = [0.0]
    a = Autoscaler(cfg, svc, targets, clock=lambda: now[0])

    async def go():
        a.samples.attach()
        try:
            a.step()
            _drive(a, svc, now, rate_s=0.1, n=200)  # 10 req/s over 20 s
            with caplog.at_level("INFO", logger="pdcluster.autoscale"):
                a.step()
                assert a.floor_task is not None and a.floors == {}  # evaluating; the floors stay meanwhile
                await a.floor_task
        finally:
            a.samples.detach()
    asyncio.run(go())
    line = json.loads(caplog.records[-1].getMessage())
    assert line["event"] == "autoscale_floor" and line["source"] == "simulator", line
    assert line["window"]["rate"] == pytest.approx(10.0) and line["window"]["prefix_hit"] == 0.25
    assert line["window"]["prompt_cv"] == 0.0 and line["window"]["samples"] == 200
    sim = line["simulator"]
    assert sim["floors"] == line["floors"] == a.floors and sim["meets"] and sim["candidates"][-1]["meets"]
    # Little's law saw 20 requests in the system, one batch's worth; the simulated steps need more
    assert a.floors["colocated"] > 1 and a.planner.state["colocated"].floor == a.floors["colocated"]
    assert 0 < sim["seconds"] <= sim["process_s"] <= sim["wall_s"] and line["littles_law"] == {"colocated": 1}
    text = __import__("prometheus_client").generate_latest(svc.metrics.registry).decode()
    assert f'pdcluster_autoscale_floor_replicas{{pool="colocated"}} {a.floors["colocated"]:.1f}' in text
    assert 'pdcluster_autoscale_floor_evaluations_total{outcome="ok"} 1.0' in text


def test_a_failed_evaluation_keeps_littles_law_and_says_why(tmp_path, caplog):
    import asyncio

    # a profile the simulator cannot use (prefill_table not ascending) passes the config's check
    path = _profile(tmp_path)
    data = json.loads(open(path).read())
    data["latency_model"]["prefill_table"] = [[10, 1.0], [5, 1.0]]
    open(path, "w").write(json.dumps(data))
    cfg = config(floor="simulator", profile=path, slow_interval_s=20, floor_timeout_s=15)
    svc = _Service()
    now = [0.0]
    a = Autoscaler(cfg, svc, PoolTargets({"colocated": "colocated"}, {"colocated": 1}), clock=lambda: now[0])

    async def go():
        a.step()
        _drive(a, svc, now)
        with caplog.at_level("INFO", logger="pdcluster.autoscale"):
            a.step()
            await a.floor_task
            now[0] = 60.0  # no request in this window: nothing to simulate, Little's law's min
            a.step()
    asyncio.run(go())
    failed, idle_ = (json.loads(r.getMessage()) for r in caplog.records if "autoscale_floor" in r.getMessage())
    assert failed["source"] == "littles_law" and failed["floors"] == failed["littles_law"] == {"colocated": 1}
    assert failed["simulator"]["error"].startswith("error: exit 1: ValueError: prefill_table")
    assert any(r.levelname == "WARNING" and "Little's law" in r.getMessage() for r in caplog.records)
    assert idle_["simulator"] == {"skipped": "no request finished in the window"}
    text = __import__("prometheus_client").generate_latest(svc.metrics.registry).decode()
    assert 'pdcluster_autoscale_floor_evaluations_total{outcome="error"} 1.0' in text


@pytest.mark.parametrize("auto,field_", [
    ({"floor": "simulator"}, "autoscale.profile is required by autoscale.floor: simulator"),
    ({"floor": "magic"}, "autoscale.floor\n  Input should be 'littles_law' or 'simulator'"),
    ({"profile": "/nonexistent/profile.json"}, "autoscale.profile: cannot read '/nonexistent/profile.json' as JSON"),
    ({"floor": "simulator", "profile": "PROFILE", "floor_timeout_s": 200},
     "autoscale.floor_timeout_s must be in (floor_budget_s 2, slow_interval_s 120), got 200"),
    ({"floor_budget_s": 0}, "autoscale.floor_budget_s\n  Input should be greater than or equal to 0.1"),
])
def test_floor_config_errors_name_the_field(tmp_path, auto, field_):
    auto = {k: _profile(tmp_path) if v == "PROFILE" else v for k, v in auto.items()}
    with pytest.raises(ValidationError) as e:
        ClusterConfig.model_validate({"model": "tiny", "pools": [{"name": "colocated", "role": "colocated"}],
                                      "autoscale": auto})
    assert field_ in str(e.value), str(e.value)


def test_floor_profile_is_read_at_load_and_travels_with_the_config(tmp_path):
    import pickle

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"latency_model": {"prefill": [1, 2]}}))
    with pytest.raises(ValidationError, match="is not a profile: expected `pdcluster plan profile`'s JSON"):
        config(floor="simulator", profile=str(bad))
    path = _profile(tmp_path)
    cfg = config(floor="simulator", profile=path)
    (tmp_path / "profile.json").unlink()  # router 0 need not see the file: its content came along
    back = pickle.loads(pickle.dumps(cfg))
    assert back.autoscale.profile_json["latency_model"]["decode"] == [0.015, 0.002, 2e-7]


def test_the_planner_side_imports_neither_planning_nor_torch():
    """The router's process hosts the planner: the simulator floor runs in a process of its own."""
    import subprocess
    import sys

    code = ("import sys, cluster.autoscale; print(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('planning', 'torch', 'loadgen')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_stopping_the_planner_ends_an_evaluation_in_flight(tmp_path, caplog):
    import asyncio
    import time

    cfg = config(floor="simulator", profile=_profile(tmp_path), slow_interval_s=20, floor_timeout_s=15)
    svc = _Service()
    now = [0.0]
    a = Autoscaler(cfg, svc, PoolTargets({"colocated": "colocated"}, {"colocated": 1}), clock=lambda: now[0])

    async def go():
        a.step()
        _drive(a, svc, now)
        with caplog.at_level("INFO", logger="pdcluster.autoscale"):
            a.step()
            task = a.floor_task
            await asyncio.sleep(0.2)  # its process is starting
            t0 = time.monotonic()
            await a.stop()
            return task, time.monotonic() - t0
    task, took = asyncio.run(go())
    assert task.cancelled() and a.floor_task is None and took < 5.0
    assert not [r for r in caplog.records if "autoscale_floor" in r.getMessage()]  # no floors from it


PD = [{"name": "prefill", "role": "prefill", "replicas": 1}, {"name": "decode", "role": "decode", "replicas": 2}]


def test_a_pool_that_needs_a_replica_takes_one_from_a_pool_that_can_spare_it():
    """The decode pool is well under its SLO with one worker fewer; the prefill pool misses
    TTFT: one decode worker moves (no process started, no CPU more), not an up and a down."""
    p = planner(config(PD))
    calm = {"prefill": busy(), "decode": busy(target=2, itl_s=0.01, ttft_s=None, kv_used=0.1)}
    p.tick(calm, 0.0)
    ds = p.tick({**calm, "prefill": busy(ttft_s=5.0)}, 10.0)
    assert [(d.pool, d.direction, d.reason, d.target, d.desired) for d in ds] == [("prefill", "move", "ttft_slo", 1, 2)]
    assert ds[0].inputs["from"] == "decode" and ds[0].inputs["from_target"] == 2
    assert p.wanted == {"prefill": 2, "decode": 1}
    # both pools settle; the donor's cooldown counts from the move: it gives nothing back at once
    assert p.tick({"prefill": busy(target=2, current=1), "decode": busy(target=1, current=2)}, 11.0) == []


def test_no_move_from_a_busy_pool_nor_between_pools_built_differently():
    p = planner(config(PD))
    hot = {"prefill": busy(), "decode": busy(target=2, itl_s=0.08)}  # decode near its ITL SLO: nothing to spare
    p.tick(hot, 0.0)
    ds = p.tick({**hot, "prefill": busy(ttft_s=5.0)}, 10.0)
    assert [(d.pool, d.direction) for d in ds] == [("prefill", "up")]
    other = [PD[0], {**PD[1], "engine": {"page_size": 32}}]
    p = planner(config(other))
    calm = {"prefill": busy(), "decode": busy(target=2, itl_s=0.01, kv_used=0.1)}
    p.tick(calm, 0.0)
    ds = p.tick({**calm, "prefill": busy(ttft_s=5.0)}, 10.0)
    assert [(d.pool, d.direction) for d in ds] == [("prefill", "up")]


def test_a_move_gets_past_the_budget_that_holds_a_scale_out():
    p = planner(config(PD, budget_cpus=3))  # 3 workers of 1 CPU: no room for a fourth
    calm = {"prefill": busy(), "decode": busy(target=2, itl_s=0.01, kv_used=0.1)}
    p.tick(calm, 0.0)
    (d,) = p.tick({**calm, "prefill": busy(ttft_s=5.0)}, 10.0)
    assert (d.pool, d.direction, d.inputs["from"]) == ("prefill", "move", "decode")


@pytest.mark.parametrize("mode", ["advisory", "on"])
def test_the_autoscaler_applies_a_move_in_mode_on_and_only_logs_it_in_advisory(mode):
    from cluster.autoscale import Decision

    targets = PoolTargets({"prefill": "prefill", "decode": "decode"}, {"prefill": 1, "decode": 2})
    a = Autoscaler(config(PD, mode=mode), _Service(), targets)
    a.apply([Decision("prefill", "move", "ttft_slo", 1, 2, {"from": "decode"})])
    line = json.loads(a.since(0)[-1][1])
    assert line["direction"] == "move" and line["applied"] == (mode == "on"), line
    assert (targets.target("prefill"), targets.target("decode")) == ((2, 1) if mode == "on" else (1, 2))
    # a move the targets no longer allow (the donor at one worker) is logged as refused
    a.apply([Decision("prefill", "move", "ttft_slo", 2, 3, {"from": "decode"})])
    line = json.loads(a.since(0)[-1][1])
    assert not line["applied"] and ("refused" in line) == (mode == "on"), line
