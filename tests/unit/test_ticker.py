"""The transfer progress threads' poller (`kv_transfer.base.Ticker`): an idle request in flight
backs the poll period off, doubling up to a bound; an event brings it back at once; busy ticks
run back to back. A sleep never ends early, so these check lower bounds on the gaps between
idle ticks, and compare busy and woken ticks against periods far longer than any scheduling
delay: a loaded machine only stretches the gaps the tests call long."""
from __future__ import annotations

import threading
import time

from kv_transfer.base import Ticker
from tests.helpers import wait_until


def _ticking(n: int, **kw) -> tuple[Ticker, list[float]]:
    """A ticker whose idle ticks are timed, once it has ticked `n` times."""
    times: list[float] = []
    t = Ticker("test-ticker", lambda: times.append(time.monotonic()) and False, active=lambda: True, **kw)
    wait_until(lambda: len(times) >= n, 10, 0.001, f"{n} ticks")
    return t, times


def test_idle_ticks_back_off_doubling_to_the_bound():
    t, times = _ticking(9, idle_s=0.001, backoff_max_s=0.032)
    t.stop()
    gaps = [b - a for a, b in zip(times, times[1:])]
    # each idle tick in a row doubles the sleep: 1, 2, 4, 8, 16 ms, then the 32 ms bound
    for gap, sleep_s in zip(gaps, (0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.032, 0.032)):
        assert gap >= sleep_s * 0.9, (gaps, sleep_s)


def test_without_a_bound_idle_ticks_keep_the_short_period():
    t, times = _ticking(30, idle_s=0.001)
    t.stop()
    # 29 gaps of 1 ms: a back-off would have taken 1+2+...: seconds, not this
    assert times[-1] - times[0] < 1.0


def test_wake_resets_the_period():
    t, times = _ticking(10, idle_s=0.001, backoff_max_s=5.0)  # backed off: now in a sleep of 512 ms
    woke = time.monotonic()
    t.wake()
    wait_until(lambda: sum(x > woke for x in times) >= 3, 5, 0.001, "three ticks after the wake")
    t.stop()
    after = [x for x in times if x > woke]
    # back at 1, 2, 4 ms: without the wake not even the first tick would come within 0.4 s
    assert after[2] - woke < 0.4


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
    wait_until(lambda: len(calls) >= 50, 10, 0.001, "50 busy ticks")
    t.stop()
    # 49 sleeps of 50 ms would take 2.45 s
    assert calls[49] - calls[0] < 1.0, "busy ticks must not sleep between them"
