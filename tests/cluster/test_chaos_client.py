"""The chaos suite's client-side scenarios (bench/chaos_client.py) on a real local Ray cluster of
the tiny model, one prefill and two decode workers over NIXL, the HTTP API on: `http-fuzz`
(random HTTP requests: every answer a 4xx in OpenAI's error shape naming the field, or a valid
200; never a 5xx or a hang; the server still serves) and `disconnect` (gRPC and HTTP clients
that leave while queued, prefilling, transferring and decoding: slot free within 1 s and every
page back within 2 s of each leave). Asserted: both rows clean, nothing stuck or leaked."""
from __future__ import annotations

import pytest

from bench.chaos import ChaosSettings, format_notes, format_table, run_transport
from bench.chaos_client import PAGES_BOUND_S, SLOT_BOUND_S
from tests.helpers import our_ray_processes

SCENARIOS = ("http-fuzz", "disconnect")


@pytest.mark.slow
def test_chaos_client(tiny_model):
    tiny_model("llama")
    s = ChaosSettings(model="tiny", transport="nixl", prefill=1, decode=2, max_model_len=256, max_inflight=4,
                      max_queue=8, scenarios=SCENARIOS, http_fuzz_requests=150, disconnect_reps=1, seed=0)
    rows = run_transport(s)
    report = format_table(rows) + "\n" + format_notes(rows)
    print("\n" + report)
    assert [r.scenario for r in rows] == list(SCENARIOS), report
    fuzz, disc = rows
    for r in rows:
        assert r.clean and not r.crashed, report
        assert (r.wrong_codes, r.bad_responses, r.hangs, r.lost, r.stuck_requests, r.leaked_pages) == (0,) * 6, report
    assert fuzz.tried == 151 and fuzz.ok >= 1 and fuzz.clean_errors >= 1 and fuzz.extra["served_after"], report
    assert disc.tried == 3 * 4 + 2 and disc.ok == disc.tried, report  # 3 doors x 4 stages, the holders, one after
    assert disc.extra["slot_freed_max_s"] <= SLOT_BOUND_S, report
    assert disc.extra["pages_freed_max_s"] <= PAGES_BOUND_S, report
    assert not our_ray_processes(), "Ray processes left after stop"
