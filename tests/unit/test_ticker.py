"""The transfer progress threads' poller (`kv_transfer.base.Ticker`): an idle request in flight
backs the poll period off, and an event brings it back at once."""
from __future__ import annotations

import threading
import time

from kv_transfer.base import Ticker


def _count_ticks(seconds: float, **kw) -> tuple[int, Ticker, list[float]]:
    times: list[float] = []
    t = Ticker("test-ticker", lambda: times.append(time.monotonic()) and False, active=lambda: True, **kw)
    time.sleep(seconds)
    return len(times), t, times


def test_idle_ticks_back_off_to_the_bound():
    n_fixed, fixed, _ = _count_ticks(0.5, idle_s=0.001)
    n_backoff, backoff, _ = _count_ticks(0.5, idle_s=0.001, backoff_max_s=0.032)
    fixed.stop()
    backoff.stop()
    # 1 ms fixed: ~500 ticks (fewer on a loaded machine); backing off: 1+2+...+32 ms, then every 32 ms
    assert n_fixed >= 100
    assert n_backoff <= 40, f"{n_backoff} ticks in 0.5 s with a 32 ms back-off bound"


def test_wake_resets_the_period():
    _, t, times = _count_ticks(0.4, idle_s=0.001, backoff_max_s=0.2)  # backed off to 200 ms by now
    woke = time.monotonic()
    t.wake()
    deadline = woke + 0.1
    while time.monotonic() < deadline and sum(x > woke for x in times) < 3:
        time.sleep(0.001)
    t.stop()
    after = [x for x in times if x > woke]
    assert len(after) >= 3, "a wake() must bring the poller back to its short period (1, 2, 4 ms)"
    assert after[2] - woke < 0.1


def test_busy_ticks_run_back_to_back():
    calls = []
    work = threading.Event()
    work.set()

    def tick():
        calls.append(time.monotonic())
        if len(calls) >= 50:
            work.clear()
        return work.is_set()

    t = Ticker("test-busy", tick, idle_s=0.05, active=lambda: True, backoff_max_s=0.1)
    time.sleep(0.2)
    t.stop()
    assert calls[49] - calls[0] < 0.05, "busy ticks must not sleep between them"
