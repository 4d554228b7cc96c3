"""The planning loop on the real cluster: a served profile of the tiny model (decode steps and
the first token's delay timed through a local Ray cluster), then `plan validate` simulating a
case and running it for real, both sides on the same requests (slow: ~2 minutes on 2 cores; the
served profile's test keeps the loop through the cluster in the default run)."""
import json
import statistics

import pytest

from cluster.cli import main
from planning.latency import LatencyModel


@pytest.fixture(scope="module")
def served_profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("prof") / "tiny-served.json"
    assert main(["plan", "profile", "--model", "tiny", "--quick", "--transports", "nixl", "--serving",
                 "--load-rate", "2", "--load-requests", "8", "--out", str(out)]) == 0
    return out


def test_served_profile_times_decode_through_the_cluster(served_profile):
    doc = json.loads(served_profile.read_text())
    lm = LatencyModel.load(served_profile)
    assert lm.meta["served"] is True and lm.source.startswith("served:")
    # served decode points: one per (batch, context), each a median of real chunk gaps
    assert [b for b, _, _ in doc["points"]["served_decode"]] == [1, 2, 4]
    assert all(0 < s < 1.0 for _, _, s in doc["points"]["served_decode"])
    # a served first token pays router, Ray and gRPC time on top of the engine's prefill step; it is
    # the difference of two medians measured minutes apart (the engine's, then the served one), so
    # on a loaded machine it can come out at or below 0, which the profile clips to 0
    assert 0 <= lm.meta["first_token_delay_s"] < 1.0
    assert lm.decode_time(1, 64) > 0
    # the load run: eight synthetic requests at 2 req/s, fitted against their simulation; what it
    # found is in the model the simulator reads
    load = doc["load"]
    assert load["ttft_requests"] == 8 and load["requests"] == 8
    assert (lm.meta["load_same"], lm.meta["load_other"], lm.meta["load_rate"]) == (load["load_same"],
                                                                                  load["load_other"], 2.0)


@pytest.mark.slow
def test_validate_predicts_and_measures_the_same_requests(served_profile, tmp_path, capsys):
    out = tmp_path / "validate.json"
    rc = main(["plan", "validate", "--model", "tiny", "--profile", str(served_profile), "--cases", "disagg-low",
               "--num-requests", "8", "--dataset", "random", "--bracket", "--load-requests", "6", "--json", str(out)])
    assert rc == 0
    assert "largest error" in capsys.readouterr().out
    res = json.loads(out.read_text())["results"][0]
    assert res["failed"] == 0 and len(res["runs"]) == 1
    rows = {r["figure"]: r for r in res["rows"]}
    assert set(rows) == {"ttft median", "ttft p90", "tpot median", "tpot p90", "request_throughput",
                         "output_throughput"}
    assert all(r["predicted"] > 0 and r["measured"] > 0 for r in rows.values())
    # the busy-admission calibration times short prompts that arrive while a stream decodes:
    # most of its twelve, not ones that came after the stream had ended; --bracket calibrates
    # twice (before and after the replay), so there are two sets of every kind of point
    points = res["runs"][0]["calibration"]["points"]
    assert len(points["busy_ttft"]) >= 16
    assert len(points["decode"]) > 8 and {b for b, _, _ in points["decode"]} == {1, 2, 4, 8}  # 8 shapes each
    assert len(points["interference"]["each"]) == 2
    # served prefills every 128 tokens up to the longest prompt the model takes (960 of 1,024):
    # the model the case was predicted with passes through each length's median
    lm = LatencyModel.from_json(res["runs"][0]["latency_model"])
    delay = res["runs"][0]["calibration"]["first_token_delay_s"]
    fresh = {}
    for t, c, ttft in points["prefill"]:
        fresh.setdefault(t, []).append(ttft)
    assert sorted(fresh) == [16, 64, 256, 384, 512, 640, 768, 896, 960]
    assert [t for t, _ in lm.prefill_table] == sorted(fresh)
    for t, ttfts in fresh.items():
        assert lm.prefill_time(t) == pytest.approx(statistics.median(ttfts) - delay, rel=1e-6)
    # the load run: six synthetic requests at the case's rate, each compared with its simulated
    # self; the fitted slow-down per stream alongside is what the prediction carried
    load = res["runs"][0]["calibration"]["load"]
    assert load["requests"] == 6 and load["ttft_requests"] == 6
    assert load["load_same"] >= 0.0 and load["load_other"] >= 0.0
    assert res["runs"][0]["calibration"]["load_used"] == load  # one repeat: the pooled fit is its own
    meta = res["runs"][0]["latency_model"]["meta"]
    assert (meta["load_same"], meta["load_other"]) == (load["load_same"], load["load_other"])
    assert meta["first_token_delay_s"] == pytest.approx(res["runs"][0]["calibration"]["first_token_delay_s"]
                                                        + load["ttft_offset_s"])
    # the spread of the load run's requests around their fitted simulation: six TTFTs (TPOT only
    # for outputs of 8 tokens or more), and the predicted TTFT/TPOT figures are expectations over
    # it, the simulator's own kept beside them
    disp = res["dispersion"]
    assert disp["ttft"]["n"] == 6 and len(disp["residuals"]["ttft"]) == 6 and disp["ttft"]["sd"] > 0
    pred = res["runs"][0]["predicted"]["summary"]
    assert pred["dispersion"]["ttft"] == disp["ttft"]
    plain = pred["deterministic"]["ttft_ms"]["p90"]
    assert plain > 0 and pred["ttft_ms"]["p90"] != plain
    # 8 requests at 0.4 req/s: both sides are paced by the arrivals, whatever the step times
    assert rows["request_throughput"]["rel_err"] == pytest.approx(0.0, abs=0.35)


def test_validate_rejects_unknown_cases(capsys):
    assert main(["plan", "validate", "--cases", "nope"]) == 2
    assert "--cases must name some of" in capsys.readouterr().err
    assert main(["plan", "validate", "--load-requests", "3"]) == 2
    assert "--load-requests must be >= 4, got 3" in capsys.readouterr().err
    assert main(["plan", "profile", "--load-rate", "1"]) == 2
    assert "--load-rate must be > 0 and needs --serving" in capsys.readouterr().err
