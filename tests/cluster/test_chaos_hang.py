"""The chaos suite's hang scenarios (bench/chaos_hang.py) on a real local Ray cluster of the tiny
model, 2 prefill and 2 decode workers over NIXL, `router.worker_timeout_s` 2 s: a decode worker
and then a prefill worker stopped with SIGSTOP for 4 s mid-stream, then woken. Asserted: nothing
wrong, lost, stuck or leaked; every greedy stream on the stopped worker completed with the
reference tokens; the worker was `unresponsive` within the timeout (+ slack) and serving again."""
from __future__ import annotations

import pytest

from bench.chaos import ChaosSettings, format_notes, format_table, run_transport
from tests.helpers import our_ray_processes

SCENARIOS = ("hang-decode", "hang-prefill")


@pytest.mark.slow
def test_chaos_hang(tiny_model):
    tiny_model("llama")
    s = ChaosSettings(model="tiny", transport="nixl", prefill=2, decode=2, scenarios=SCENARIOS, stream_tokens=400,
                      worker_timeout_s=2.0, seed=0)
    rows = run_transport(s)
    report = format_table(rows) + "\n" + format_notes(rows)
    print("\n" + report)
    assert [r.scenario for r in rows] == list(SCENARIOS), report
    for r in rows:
        assert r.clean, report
        assert r.killed == 1 and r.replaced == 1 and r.greedy_total >= 1, report
        assert r.greedy_identical == r.greedy_total, report
        assert r.extra["detect_s"] <= s.worker_timeout_s + 2.5, report
    assert not our_ray_processes(), "Ray processes left after stop"
