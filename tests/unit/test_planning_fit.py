"""Fits recover known coefficients; a quick real profile of the tiny model gives a loadable model."""
import json
import random

import pytest

from planning.fit import fit_decode, fit_prefill, fit_transfer
from planning.latency import LatencyModel
from planning.profile_cli import add_arguments, run


def test_fit_recovers_coefficients_with_noise():
    rng = random.Random(0)
    p = (2e-3, 5e-5, 1e-8, 2e-8)
    pts = [(t, c, (p[0] + p[1] * t + p[2] * t * t + p[3] * t * c) * (1 + rng.gauss(0, 0.01)))
           for t in (16, 64, 256, 1024, 2048) for c in (0, 512, 2048)]
    res = fit_prefill(pts)
    assert res.r2 > 0.99 and res.max_rel_err < 0.05
    for got, want in zip(res.coef[1:3], p[1:3]):
        assert got == pytest.approx(want, rel=0.2)
    d = fit_decode([(b, b * L, 3e-3 + 1e-4 * b + 1e-7 * b * L) for b in (1, 4, 16) for L in (100, 1000)])
    assert d.coef == pytest.approx((3e-3, 1e-4, 1e-7), rel=1e-6)
    x = fit_transfer([(n, 1e-3 + n / 5e9) for n in (1 << 10, 1 << 20, 1 << 26)])
    assert x.coef == pytest.approx((1e-3, 5e9), rel=1e-6)


def test_fit_rejects_too_few_points():
    with pytest.raises(ValueError, match="at least 4 points"):
        fit_prefill([(1, 0, 1.0)])


def test_quick_profile_of_tiny_model_is_loadable(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "p.json"
    assert run(parser.parse_args(["--model", "tiny", "--quick", "--transports", "nixl", "--out", str(out)])) == 0
    lm = LatencyModel.load(out)
    # the KV transfer of this model's pages between two processes was timed and fitted
    assert set(lm.transfers) == {"nixl"} and lm.num_layers == 4
    assert 0 < lm.transfer_time(1 << 20, "nixl") < 1.0
    assert lm.kv_bytes_per_token == 2 * 4 * 2 * 32 * 2  # tiny: 4 layers, 2 kv heads, head_dim 32, bf16
    assert lm.prefill_time(512) > 1.5 * lm.prefill_time(16) > 0  # prefill time grows with tokens


def test_profile_grid_keeps_only_shapes_the_model_can_take():
    """A 2,048-position model (the built-in small preset) is profiled without its 2,048-token
    prompts or prompts whose cached prefix would overflow, but up to the longest prompt it takes;
    8,192 positions keep the whole grid."""
    from planning.profile import FULL, fit_grid

    g = fit_grid(FULL, 2048)
    assert g["prefill_shapes"] and all(t + c + 80 <= 2048 for t, c in g["prefill_shapes"])
    assert (1024, 512) in g["prefill_shapes"] and (2048, 0) not in g["prefill_shapes"]
    assert (1968, 0) in g["prefill_shapes"]  # the longest prompt the context takes, timed instead
    assert g["budget"] + 64 <= 2048 and max(g["ctx_per_seq"]) < g["budget"] + 64
    assert len(fit_grid(FULL, 8192)["prefill_shapes"]) == len(FULL["prefill_tokens"]) * len(FULL["cached"])
    with pytest.raises(ValueError, match="max_model_len=64"):
        fit_grid(FULL, 64)


def _rec(start_s: float, chunk_times_s: list[float]):
    from loadgen.metrics import RequestRecord

    return RequestRecord(index=0, request_id="r", scheduled_s=0.0, start_s=start_s, prompt_len=100, max_tokens=10,
                         ok=True, chunk_times_s=chunk_times_s)


def test_served_decode_point_uses_only_the_gaps_while_every_stream_decodes():
    """Two streams of 10 ms steps, the second starting 50 ms later and stepping at 20 ms while
    both decode: the point is the 20 ms gaps of the shared window, not the lone stretches;
    streams that never decode together give no point."""
    from planning.serving_profile import _all_decoding

    a = _rec(0.0, [0.01 * i for i in range(6)] + [0.05 + 0.02 * i for i in range(1, 6)])  # to 0.15 s
    b = _rec(0.05, [0.0, 0.02, 0.04, 0.06, 0.08, 0.10, 0.11, 0.12])  # decodes 0.07-0.17 s
    b_s, ctx, step = _all_decoding([a, b], [100, 100], min_gaps=2)
    assert b_s == 2 and step == pytest.approx(0.02)
    assert 2 * 100 < ctx < 2 * 110
    late = _rec(1.0, [0.0, 0.01, 0.02, 0.03])
    assert _all_decoding([a, late], [100, 100], min_gaps=1) is None


def test_decode_shape_lengths_spread_around_the_shape_and_fit_the_context():
    from planning.serving_profile import _spread

    assert _spread(400, 1, 2000) == [400]
    assert _spread(400, 2, 2000) == [200, 600]
    assert _spread(400, 5, 2000) == [200, 300, 400, 500, 600]
    assert _spread(1536, 2, 1896) == [768, 1896]


def test_two_calibrations_merge_into_every_sample_and_the_mean_interference():
    from planning.serving_profile import merge_points

    a = {"prefill": [(16, 0, 0.02)], "decode": [(1, 100, 0.007)], "first_gaps": [(64, 0.01)], "busy_ttft": [0.03],
         "interference": {"factor": 0.1}}
    b = {"prefill": [(16, 0, 0.03)], "decode": [(2, 200, 0.009)], "first_gaps": [], "busy_ttft": None,
         "interference": {"factor": 0.3}}
    m = merge_points(a, b)
    assert m["prefill"] == [(16, 0, 0.02), (16, 0, 0.03)] and m["decode"] == [(1, 100, 0.007), (2, 200, 0.009)]
    assert m["first_gaps"] == [(64, 0.01)] and m["busy_ttft"] == [0.03]
    assert m["interference"]["factor"] == pytest.approx(0.2)
    assert merge_points({**a, "interference": None}, {**b, "interference": None})["interference"] is None


def _load_record(index, worker, start, ratio=1.0, gap=0.1, tokens=11):
    """A request decoding for one second from `start` on `worker` (its window: TTFT to TTFT +
    TPOT x (tokens - 1)): the measured side's later gaps at `ratio` x the predicted ones."""
    rec = {"index": index, "ok": True, "start_s": start, "ttft_s": 0.0, "output_tokens": tokens,
           "server": {"decode_worker": worker}}
    return ({**rec, "tpot_s": 1.0 / (tokens - 1), "mean_later_gap_s": gap * ratio},
            {**rec, "tpot_s": gap, "mean_later_gap_s": gap})


def test_load_fit_recovers_the_slow_down_per_stream_alongside():
    """Streams decoding together on one worker, and on a neighbour, slower than predicted by
    0.3 per stream on the same worker and 0.1 per stream next door: the fit finds both; a lone
    stream's ratio is what it is measured against (through the origin)."""
    from planning.load_run import fit_load

    k_same, k_other = 0.3, 0.1
    specs = [(0, "a", 0.0, 1.0),                                      # alone
             (1, "a", 2.0, 1 + k_same + k_other), (2, "a", 2.0, 1 + k_same + k_other),
             (3, "b", 2.0, 1 + 2 * k_other),                          # next to two streams on a
             (4, "b", 5.0, 1.0),
             (5, "b", 8.0, 1 + k_other), (6, "a", 8.0, 1 + k_other)]
    pairs = [_load_record(*s) for s in specs]
    fit = fit_load([m for m, _ in pairs], [p for _, p in pairs])
    assert fit["requests"] == 7
    assert fit["load_same"] == pytest.approx(k_same, abs=1e-9) and fit["load_other"] == pytest.approx(k_other, abs=1e-9)
    assert fit["load_other_gap"] == fit["load_other"] and "load_other_ttft" not in fit
    assert fit["load_other_prefill"] == fit["load_other"]  # no prompt prefilled beside a stream: the gaps' term
    # one decode worker: nothing next door to fit, load_other stays 0
    one = [_load_record(i, "d", s, r) for i, (s, r) in enumerate([(0, 1.0), (2, 1.3), (2, 1.3), (5, 1.0)])]
    fit = fit_load([m for m, _ in one], [p for _, p in one])
    assert fit["load_same"] == pytest.approx(0.3) and fit["load_other"] == 0.0
    # faster than predicted under load: no negative slow-down; too short streams do not count
    fast = [_load_record(i, "d", s, r) for i, (s, r) in enumerate([(0, 1.0), (2, 0.8), (2, 0.8), (5, 1.0)])]
    assert fit_load([m for m, _ in fast], [p for _, p in fast])["load_same"] == 0.0
    short = [_load_record(i, "d", 0.0, 1.5, tokens=5) for i in range(6)]
    fit = fit_load([m for m, _ in short], [p for _, p in short])
    assert (fit["requests"], fit["load_same"], fit["load_other"], fit["ttft_offset_s"]) == (0, 0.0, 0.0, 0.0)



def test_load_fit_takes_an_intercept_where_enough_streams_decoded_alone():
    """Under a load's arrivals a lone stream may itself run slower than the idle calibration:
    ten lone streams 7 % over, pairs 7 % + 0.3 over. With MIN_LONE_STREAMS lone requests the fit
    has an intercept (load_base) and the per-stream factor is only what a second stream adds;
    through the origin it would have put the lone streams' 7 % on every stream alongside."""
    from planning.load_run import MIN_LONE_STREAMS, fit_load, with_load

    specs = [(i, "d", 20.0 * i, 1.07) for i in range(10)]  # apart in time: alone
    specs += [(10, "d", 500.0, 1.37), (11, "d", 500.0, 1.37), (12, "d", 600.0, 1.37), (13, "d", 600.0, 1.37)]
    pairs = [_load_record(*s) for s in specs]
    fit = fit_load([m for m, _ in pairs], [p for _, p in pairs])
    assert fit["lone_streams"] == 10 >= MIN_LONE_STREAMS
    assert fit["load_base"] == pytest.approx(0.07, abs=1e-9) and fit["load_same"] == pytest.approx(0.3, abs=1e-9)
    lm = with_load(LatencyModel(), fit, 0.8)
    assert lm.meta["load_base"] == pytest.approx(0.07)
    # too few lone streams: no intercept, as before
    few = [_load_record(*s) for s in specs[MIN_LONE_STREAMS - 1:]]
    fit = fit_load([m for m, _ in few], [p for _, p in few])
    assert fit["lone_streams"] < MIN_LONE_STREAMS and fit["load_base"] == 0.0

def test_load_fit_reads_prefills_beside_decoding_streams_and_the_quiet_first_token():
    """Disaggregated: prompts prefilled on the prefill worker while streams decode on the decode
    worker take load_other x their prefill longer per stream; prompts on a quiet host a fixed
    offset longer than predicted. The fit finds both, the prefill being the predicted TTFT less
    the first-token delay."""
    from planning.load_run import fit_load

    delay, offset, k = 0.02, 0.005, 0.3
    measured, predicted = [], []
    # four quiet prompts, then two streams decoding from t=10 to 20 with prompts prefilled beside them
    for i, (start, ttft) in enumerate([(0.0, 0.05), (2.0, 0.12), (4.0, 0.07), (6.0, 0.2)]):
        rec = {"index": i, "ok": True, "start_s": start, "output_tokens": 1,
               "server": {"prefill_worker": "p", "decode_worker": "d"}}
        predicted.append({**rec, "ttft_s": ttft, "tpot_s": None, "mean_later_gap_s": None})
        measured.append({**rec, "ttft_s": ttft + offset, "tpot_s": None, "mean_later_gap_s": None})
    for i in (4, 5):
        rec = {"index": i, "ok": True, "start_s": 9.9, "output_tokens": 101, "server": {"prefill_worker": "p",
                                                                                         "decode_worker": "d"}}
        predicted.append({**rec, "ttft_s": 0.1, "tpot_s": 0.1, "mean_later_gap_s": 0.1})
        measured.append({**rec, "ttft_s": 0.1, "tpot_s": 0.1, "mean_later_gap_s": 0.1})
    for i, ttft in zip((6, 7, 8), (0.05, 0.1, 0.3)):
        rec = {"index": i, "ok": True, "start_s": 2.0 * i, "output_tokens": 1,  # 12-16 s
               "server": {"prefill_worker": "p", "decode_worker": "d"}}
        predicted.append({**rec, "ttft_s": ttft, "tpot_s": None, "mean_later_gap_s": None})
        slow = offset + k * 2 * (ttft - delay)
        measured.append({**rec, "ttft_s": ttft + slow, "tpot_s": None, "mean_later_gap_s": None})
    fit = fit_load(measured, predicted, first_token_delay_s=delay)
    assert fit["ttft_offset_s"] == pytest.approx(offset) and fit["load_other_prefill"] == pytest.approx(k)
    assert fit["ttft_requests"] == 9
    # no stream decoded beside another worker's stream: decode steps take the prefills' term
    assert "load_other_gap" not in fit and fit["load_other"] == fit["load_other_prefill"]


def test_load_fit_pools_the_load_runs_of_several_repeats():
    """Two load runs of one cluster: each has four quiet prompts and one pair of streams decoding
    together on a worker. Alone, a run's two streams are too few to fit load_same (at least four
    are needed) and its quiet offset is its own median; pooled, the fit reads 0.3 per stream off
    all four streams and the offset is the median of all eight prompts."""
    from planning.load_run import fit_load, fit_samples, request_samples

    def run(offsets_ms):
        measured, predicted = [], []
        for i, off in enumerate(offsets_ms):
            rec = {"index": i, "ok": True, "start_s": 2.0 * i, "output_tokens": 1, "server": {"decode_worker": "c"}}
            predicted.append({**rec, "ttft_s": 0.05, "tpot_s": None, "mean_later_gap_s": None})
            measured.append({**rec, "ttft_s": 0.05 + off / 1e3, "tpot_s": None, "mean_later_gap_s": None})
        pairs = [_load_record(10 + j, "c", 20.0, 1.3) for j in range(2)]
        return measured + [m for m, _ in pairs], predicted + [p for _, p in pairs]

    a, b = run([1, 2, 3, 4]), run([5, 6, 7, 8])
    for one, median_ms in ((a, 2.5), (b, 6.5)):
        fit = fit_load(*one)
        assert (fit["requests"], fit["load_same"]) == (2, 0.0)
        assert fit["ttft_offset_s"] == pytest.approx(median_ms / 1e3)
    pooled = fit_samples([request_samples(*a), request_samples(*b)])
    assert (pooled["runs"], pooled["requests"], pooled["ttft_requests"]) == (2, 4, 8)
    assert pooled["load_same"] == pytest.approx(0.3) and pooled["ttft_offset_s"] == pytest.approx(4.5e-3)


def test_load_run_follows_the_length_distribution_of_the_workload_not_its_requests():
    import math

    from loadgen.workloads import Workload, WorkloadRequest
    from planning.load_run import load_workload

    like = Workload([WorkloadRequest(i, 0.0, 100 * (1 + i % 5), 20 + i % 3) for i in range(40)], 0, "t")
    wl = load_workload(2.0, 600, seed=5, num_requests=400, like=like)
    assert len(wl.requests) == 400 and wl.meta["request_rate"] == 2.0
    mean_log = lambda xs: sum(math.log(x) for x in xs) / len(xs)  # noqa: E731
    assert mean_log([r.prompt_len for r in wl.requests]) == pytest.approx(mean_log([r.prompt_len for r in like.requests]),
                                                                        abs=0.1)
    assert mean_log([r.output_len for r in wl.requests]) == pytest.approx(mean_log([r.output_len for r in like.requests]),
                                                                        abs=0.05)
    assert all(r.prompt_len + r.output_len < 600 and r.output_len >= 1 for r in wl.requests)
    assert wl.requests[-1].arrival_s / 399 == pytest.approx(0.5, rel=0.15)  # Poisson at 2 req/s
    assert [(r.prompt_len, r.output_len) for r in wl.requests] != [(r.prompt_len, r.output_len) for r in
                                                                   load_workload(2.0, 600, 6, 400, like=like).requests]
    # without a workload to follow: the uniform ranges, fitted to the context
    plain = load_workload(0.5, 512, seed=1)
    assert len(plain.requests) == 30 and all(128 <= r.prompt_len <= 512 - 128 - 2 for r in plain.requests)
    with pytest.raises(ValueError, match="rate > 0"):
        load_workload(0.0, 512, seed=1)


def test_a_prefill_table_makes_the_model_pass_through_every_measured_length():
    from dataclasses import replace

    lm = LatencyModel(prefill=(0.005, 1e-4, 5e-8, 1e-7))
    # a kernel whose time is not smooth in the length: 1,000 tokens slower, 1,500 faster than the quadratic
    table = ((500, 0.060), (1000, 0.200), (1500, 0.250))
    t = replace(lm, prefill_table=table)
    for n, s in table:
        assert t.prefill_time(n) == pytest.approx(s)
        assert t.step_time([(n, 0)]) == pytest.approx(s)  # one sequence's step is its prefill
    # between two lengths the quadratic is scaled by the ratio interpolated linearly: 750 tokens
    # sit halfway between ratios 0.060/0.0675 and 0.200/0.155
    ratio = (0.060 / 0.0675 + 0.200 / 0.155) / 2
    assert t.prefill_time(750) == pytest.approx(lm.prefill_time(750) * ratio)
    # past either end the nearest ratio holds; a cached prefix still costs p3 per token pair
    assert t.prefill_time(2000) == pytest.approx(lm.prefill_time(2000) * 0.250 / lm.prefill_time(1500))
    assert t.prefill_time(100) == pytest.approx(lm.prefill_time(100) * 0.060 / lm.prefill_time(500))
    assert t.prefill_time(1000, 200) == pytest.approx(0.200 + 1e-7 * 1000 * 200)
    # two sequences in one step pay the fixed cost once
    assert t.step_time([(1000, 0), (500, 0)]) == pytest.approx(0.200 + 0.060 - 0.005)
    # saved and loaded with the profile; without a table nothing changes
    assert LatencyModel.from_json(json.loads(json.dumps(t.to_json()))) == t
    assert LatencyModel.from_json(lm.to_json()).prefill_time(1000) == pytest.approx(lm.prefill_time(1000))
    for bad in (((500, 0.06), (500, 0.07)), ((0, 0.1),), ((500, -0.1),)):
        with pytest.raises(ValueError, match="prefill_table"):
            replace(lm, prefill_table=bad)


def _served_points(prefill_s, delay=0.015):
    """Synthetic served calibration points: fresh prompts timed twice each, decode steps."""
    prefill = [(t, 0, prefill_s(t) + delay + d) for t in [16] * 6 + [64] + list(range(256, 2049, 128))
               for d in (-0.001, 0.001)]
    decode = [(b, b * L, 0.004 + 0.0003 * b + 7e-7 * b * L) for b in (1, 2, 4, 8) for L in (64, 384)]
    return {"prefill": prefill, "decode": decode}


def test_calibration_on_dense_served_lengths_passes_through_each_of_them():
    from planning.serving_profile import calibrate

    engine = LatencyModel(prefill=(0.004, 9e-5, 5e-8, 1.4e-7), decode=(0.003, 3e-4, 7e-7))

    def served(t):  # the engine's curve, 10 % slower on every third length (a kernel's blocking)
        return engine.prefill_time(t) * (1.1 if (t // 128) % 3 == 0 else 1.0)

    lm, info = calibrate(engine, _served_points(served))
    assert info["first_token_delay_s"] == pytest.approx(0.015, abs=2e-3)
    assert info["prefill_table_lengths"] == 2 + 15
    for t in range(256, 2049, 128):
        # the served TTFT less the delay, within the delay's own error
        assert lm.prefill_time(t) == pytest.approx(served(t), abs=2e-3)
    # only a few served lengths: the reshaped quadratic alone, which cannot follow the wiggles
    few = {"prefill": [p for p in _served_points(served)["prefill"] if p[0] in (16, 64, 512, 1024, 2048)],
           "decode": _served_points(served)["decode"]}
    lm2, info2 = calibrate(engine, few)
    assert lm2.prefill_table == () and info2["prefill_table_lengths"] == 0
    assert max(abs(lm2.prefill_time(t) / served(t) - 1) for t in range(256, 2049, 128)) > 0.03
