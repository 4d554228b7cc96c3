"""Fits recover known coefficients; a quick real profile of the tiny model gives a loadable model."""
import random

import pytest

from cluster.planning.fit import fit_decode, fit_prefill, fit_transfer
from cluster.planning.latency import LatencyModel
from cluster.planning.profile_cli import add_arguments, run


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
    from cluster.planning.profile import FULL, fit_grid

    g = fit_grid(FULL, 2048)
    assert g["prefill_shapes"] and all(t + c + 80 <= 2048 for t, c in g["prefill_shapes"])
    assert (1024, 512) in g["prefill_shapes"] and (2048, 0) not in g["prefill_shapes"]
    assert (1968, 0) in g["prefill_shapes"]  # the longest prompt the context takes, timed instead
    assert g["budget"] + 64 <= 2048 and max(g["ctx_per_seq"]) < g["budget"] + 64
    assert len(fit_grid(FULL, 8192)["prefill_shapes"]) == len(FULL["prefill_tokens"]) * len(FULL["cached"])
    with pytest.raises(ValueError, match="max_model_len=64"):
        fit_grid(FULL, 64)


def _rec(start_s: float, chunk_times_s: list[float]):
    from bench.serve.metrics import RequestRecord

    return RequestRecord(index=0, request_id="r", scheduled_s=0.0, start_s=start_s, prompt_len=100, max_tokens=10,
                         ok=True, chunk_times_s=chunk_times_s)


def test_served_decode_point_uses_only_the_gaps_while_every_stream_decodes():
    """Two streams of 10 ms steps, the second starting 50 ms later and stepping at 20 ms while
    both decode: the point is the 20 ms gaps of the shared window, not the lone stretches;
    streams that never decode together give no point."""
    from cluster.planning.serving_profile import _all_decoding

    a = _rec(0.0, [0.01 * i for i in range(6)] + [0.05 + 0.02 * i for i in range(1, 6)])  # to 0.15 s
    b = _rec(0.05, [0.0, 0.02, 0.04, 0.06, 0.08, 0.10, 0.11, 0.12])  # decodes 0.07-0.17 s
    b_s, ctx, step = _all_decoding([a, b], [100, 100], min_gaps=2)
    assert b_s == 2 and step == pytest.approx(0.02)
    assert 2 * 100 < ctx < 2 * 110
    late = _rec(1.0, [0.0, 0.01, 0.02, 0.03])
    assert _all_decoding([a, late], [100, 100], min_gaps=1) is None


def test_decode_shape_lengths_spread_around_the_shape_and_fit_the_context():
    from cluster.planning.serving_profile import _spread

    assert _spread(400, 1, 2000) == [400]
    assert _spread(400, 2, 2000) == [200, 600]
    assert _spread(400, 5, 2000) == [200, 300, 400, 500, 600]
    assert _spread(1536, 2, 1896) == [768, 1896]


def test_two_calibrations_merge_into_every_sample_and_the_mean_interference():
    from cluster.planning.serving_profile import merge_points

    a = {"prefill": [(16, 0, 0.02)], "decode": [(1, 100, 0.007)], "first_gaps": [(64, 0.01)], "busy_ttft": [0.03],
         "interference": {"factor": 0.1}}
    b = {"prefill": [(16, 0, 0.03)], "decode": [(2, 200, 0.009)], "first_gaps": [], "busy_ttft": None,
         "interference": {"factor": 0.3}}
    m = merge_points(a, b)
    assert m["prefill"] == [(16, 0, 0.02), (16, 0, 0.03)] and m["decode"] == [(1, 100, 0.007), (2, 200, 0.009)]
    assert m["first_gaps"] == [(64, 0.01)] and m["busy_ttft"] == [0.03]
    assert m["interference"]["factor"] == pytest.approx(0.2)
    assert merge_points({**a, "interference": None}, {**b, "interference": None})["interference"] is None
