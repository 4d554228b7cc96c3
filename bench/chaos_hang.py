"""The hang scenarios of `pdcluster bench chaos` (bench/chaos.py): a worker's process stopped
with SIGSTOP (alive to Ray, silent to the router) for twice `router.worker_timeout_s`, then
woken with SIGCONT:

  hang-decode   while greedy streams decode on it: the router marks it `unresponsive` within
                the timeout, the streams on it continue on another decode worker with the
                tokens of an uninterrupted run (streams pinned to it wait for it to come back);
                woken, it is warmed up and serves again.
  hang-prefill  while long prompts are being prefilled: the prompts queued or in progress on
                it move to another prefill worker (or wait for it, when it is the only one).

Judged like the kill scenarios: every greedy stream that was on the hung worker completes
identical to its reference (or ends with a clear UNAVAILABLE), nothing is lost or leaked. The
row's `killed`/`replaced` count the hung worker and its return to `serving` (same process);
`recover_s` runs from SIGCONT to `serving`; `extra` has `detect_s` (SIGSTOP to
`unresponsive`) and `streams_done_s` (SIGSTOP to the last stream's end).
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

HANGS = ("hang-decode", "hang-prefill")
# The suite's own helpers reach these functions as `ch.tools` (bench.chaos passes its module's
# Outcome, generate_call, _until, _until_async, _worker, ...): this module imports nothing of
# bench.chaos, which imports it.


async def _state_within(ch, wid: str, want, bound_s: float) -> float | None:
    """Seconds until `want(worker status)` holds, polled every 50 ms, or None past bound_s."""
    _worker = ch.tools._worker
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound_s:
        try:
            if want(_worker(await ch.status(), wid)):
                return time.monotonic() - t0
        except Exception:
            pass
        await asyncio.sleep(0.05)
    return None


async def _hang(ch, row, victim: str, tasks: list, outs: list) -> None:
    """SIGSTOP `victim` for 2x worker_timeout_s (SIGCONT whatever happens), with bystanders."""
    timeout = ch.s.worker_timeout_s
    stop = asyncio.Event()
    by = ch.bystanders(stop)
    t_stop, pid, _ = await ch.kill(row, victim, signal.SIGSTOP)
    try:
        detect = await _state_within(ch, victim, lambda w: w.state == "unresponsive", timeout + 30)
        if detect is None:
            row.notes.append(f"{victim} was not marked unresponsive within {timeout + 30:g} s of SIGSTOP")
        else:
            row.extra["detect_s"] = round(time.monotonic() - t_stop, 2)
        # the stop lasts twice the timeout: a fixed fault duration, not a synchronization
        await asyncio.sleep(max(t_stop + 2 * timeout - time.monotonic(), 0))
        row.extra["streams_done_while_stopped"] = sum(o.done for o in outs)
    finally:
        os.kill(pid, signal.SIGCONT)
    ch.log(f"chaos [{ch.s.transport}]: woke {victim} (SIGCONT)")
    back = await _state_within(ch, victim, lambda w: w.state == "serving" and w.healthy and w.pid == pid,
                               ch.s.recover_bound_s)
    if back is None:
        row.notes.append(f"{victim} was not serving again within {ch.s.recover_bound_s:g} s of SIGCONT")
    else:
        row.replaced += 1
        row.recover_s_max = round(back, 2)
    await asyncio.gather(*tasks)
    row.extra["streams_done_s"] = round(time.monotonic() - t_stop, 2)
    stop.set()
    ch.judge_bystanders(row, await by)


async def scenario_hang_decode(ch, row) -> None:
    Outcome, generate_call, _until = ch.tools.Outcome, ch.tools.generate_call, ch.tools._until
    f = ch.fuzzer
    victim = ch.decodes[0]
    survivor = next((d for d in ch.decodes if d != victim), "")
    specs: list[tuple[Any, str]] = []  # (request, pin)
    for i in range(6 + (2 if survivor else 0)):
        plen = ch.rng.randint(16, 48)
        pin = "" if i < 4 else victim if i < 6 else survivor
        specs.append((ch.greedy(f.ids(plen), min(ch.s.stream_tokens, f.mml - plen), pin), pin))
    refs = await ch.references(row, [r for r, _ in specs])
    outs = [Outcome() for _ in specs]
    tasks = [asyncio.ensure_future(generate_call(ch.chan(i), r.SerializeToString(), ch.s.call_timeout_s, out=outs[i]))
             for i, (r, _) in enumerate(specs)]
    await _until(lambda: all(len(o.chunks) >= 2 or o.done for o in outs), 120)
    if any(o.done for o in outs):
        row.notes.append(f"{sum(o.done for o in outs)} streams ended before the stop (too few --stream-tokens?)")
    await _hang(ch, row, victim, tasks, outs)
    verdicts: dict = {}
    for (req, pin), out, ref in zip(specs, outs, refs):
        final = out.final
        # unpinned: on the victim when it migrated away from it (or failed naming it)
        on_victim = pin == victim or (not pin and ((final is not None and final.placement.migrations > 0)
                                                   or victim in out.details))
        v = ch.judge_stream(row, req, out, ref, on_victim, victim,
                            f"greedy stream ({pin or 'unpinned'}) while {victim} was stopped mid-stream")
        key = f"{'on ' + victim if on_victim else 'elsewhere'}: {v}"
        verdicts[key] = verdicts.get(key, 0) + 1
    row.extra["streams"] = verdicts
    await ch.post_check(row, specs[4][0], refs[4], victim)


async def scenario_hang_prefill(ch, row) -> None:
    if not ch.prefills:
        row.notes.append("no prefill pool")
        return
    specs, outs, tasks, victim = await ch.busy_prefill_pool(row, "stopped")
    await _hang(ch, row, victim, tasks, outs)
    row.extra["moved_to_another_attempt"] = await ch.judge_prefill_prompts(row, victim, specs, outs, "was stopped")
