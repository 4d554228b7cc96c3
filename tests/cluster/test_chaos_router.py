"""The chaos suite's `kill-router` scenario (bench/chaos_router.py) on a real local Ray cluster
of the tiny model: kill -9 of the router mid-stream; the streams end UNAVAILABLE after a prefix
of the reference tokens (never a wrong token, never a hang), the router serves again on the
same port, its predecessor's requests are cancelled on the workers and no page leaks. Slow: the
default run covers the same loss and return in tests/cluster/test_cluster_ray_router_loss.py."""
from __future__ import annotations

import pytest

from bench.chaos import ChaosSettings, format_notes, format_table, run_transport
from tests.helpers import our_ray_processes


@pytest.mark.slow
def test_chaos_kill_router(tiny_model):
    tiny_model("llama")
    s = ChaosSettings(model="tiny", transport="nixl", prefill=1, decode=1, scenarios=("kill-router",),
                      stream_tokens=600, seed=0)
    [row] = run_transport(s)
    report = format_table([row]) + "\n" + format_notes([row])
    print("\n" + report)
    assert row.clean and not row.crashed, report
    assert (row.wrong_codes, row.bad_responses, row.hangs, row.lost) == (0, 0, 0, 0), report
    assert (row.stuck_requests, row.leaked_pages) == (0, 0), report
    assert row.killed == row.replaced == 1 and row.codes.get("UNAVAILABLE", 0) >= 1, report
    assert row.extra["streams"].get("ended UNAVAILABLE", 0) == 4, report
    assert row.extra["predecessor_requests_cancelled"] == row.extra["running_on_workers_at_kill"] == 4, report
    assert row.extra["after_recovery_identical"], report
    assert not our_ray_processes(), "Ray processes left after stop"
