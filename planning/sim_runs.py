"""Runs of decode steps: a worker's next decode steps planned at once (`plan_run`) and applied to
its engine when the run ends or something reaches the worker (`apply_run`).

A run is planned when every running request decodes (one token each, all in one batch),
nothing waits to be admitted or to join, and at least two steps pass before a request finishes
or pages run out. The batch cannot change before then, so each step's batch and time are known
in advance; nothing is applied to the engine until the run ends or is interrupted
(`EngineSim.sync`), and then every page the steps took and registered is taken and registered
through the KV manager's own calls, in the order the step-by-step path makes them.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.scheduler import ScheduledBatch

if TYPE_CHECKING:
    from planning.sim_engine import EngineSim


@dataclass(slots=True)
class _Step:
    start: float
    end: float
    batch: ScheduledBatch
    prefills: bool = False  # any prompt tokens in it (what slows a neighbour down)
    decodes: int = 0        # sequences decoding in it (what slows a neighbour down under load)


MAX_RUN = 512  # decode steps planned at once (a run cut short wastes its planning)


@dataclass(slots=True, eq=False)
class _Run:
    """Decode steps planned at once: the batch cannot change before one of its requests
    finishes or something from outside reaches the worker, so each step's batch and time are
    known in advance. Nothing is applied to the engine until the run ends or is interrupted
    (`EngineSim.sync`); then every page the steps took and registered is taken and registered
    through the KV manager's own calls, in the order the step-by-step path makes them."""
    start: float
    ends: list          # end time of each step
    durs: list          # each step's time
    reqs: list          # the running engine requests, in batch order
    sims: list          # their SimRequests
    c0: list            # their computed tokens when the run began
    events: list        # (step, 0 = take a page | 1 = register full pages, request position), in order
    allocs_by_step: list  # pages taken by the steps up to and including each

    def started(self, t: float) -> int:
        """Steps started by time `t` (steps ending before `t` are done, the next one is running)."""
        return min(bisect.bisect_left(self.ends, t) + 1, len(self.ends))


def plan_run(w: EngineSim, now: float) -> float | None:
    """Plan the steps from `now` on as one run when every running request decodes (one token
    each, all in one batch), nothing waits to be admitted or to join, and at least two steps
    pass before a request finishes or pages run out. Returns the run's end, or None for a
    single ordinary step. Exactness: the step-by-step path would schedule exactly these
    batches (the scheduler's inputs change only through this worker's methods, each of which
    calls `sync` first, or through a step that samples a first or last token, which ends the
    run), and its step times are the same function of the same batch, summed in the same
    order."""
    sched = w.scheduler
    if sched.waiting or sched.ready:
        return None
    reqs = sched.running
    b = len(reqs)
    if not b or b > sched.max_num_batched_tokens:
        return None
    sims = []
    m = w._run_len
    for eng in reqs:
        computed = eng.num_computed_tokens
        sim = w._requests[eng.request_id]
        p = eng.params
        if (computed != len(eng.all_token_ids) - 1 or computed < eng.num_prompt_tokens or sim.generated < 1
                or sim.cached < 0 or eng.detokenizer is not None or p.stop_token_ids or not p.ignore_eos):
            return None
        # the last step that samples no final token: a finishing step goes the ordinary way
        m = min(m, p.max_tokens - eng.num_output_tokens - 1, eng.max_total_tokens - computed - 2,
                sim.output_len - sim.generated - 1)
        sims.append(sim)
    if m < 2:
        return None
    ps = w.kv.page_size
    caching = w.kv.pool.enable_prefix_caching
    events = []
    c0 = []
    for i, eng in enumerate(reqs):
        c = eng.num_computed_tokens
        c0.append(c)
        s = len(eng.pages) * ps - c  # the first step whose token needs a new page
        if s < 0:
            return None
        while s < m:
            events.append((s, 0, i))
            s += ps
        if caching:  # the steps whose token fills a page (registered at the step's end)
            s = max(0, (eng.num_cached_pages_registered + 1) * ps - c - 1)
            while s < m:
                events.append((s, 1, i))
                s = ((c + s + 1) // ps + 1) * ps - c - 1
    counts = [0] * m
    for s, phase, _ in events:
        if not phase:
            counts[s] += 1
    free = w.kv.num_free_pages
    allocs_by_step, total = [], 0
    for s, n in enumerate(counts):
        total += n
        if total > free:  # this step would preempt: the run stops before it
            m = s
            break
        allocs_by_step.append(total)
    if m < 2:
        return None
    events = sorted(e for e in events if e[0] < m)
    ctx = sum(c0) + b
    durs, ends = [], []
    t = now
    for _ in range(m):
        dur = w._duration([], b, ctx)
        t = t + dur
        durs.append(dur)
        ends.append(t)
        ctx += b
    w.run = _Run(now, ends, durs, list(reqs), sims, c0, events, allocs_by_step)
    w.step = _Step(now, t, None, False, b)
    return t


def apply_run(w: EngineSim, j: int, running: bool) -> None:
    """Apply the run's first `j` steps; with `running`, also schedule step j (its pages) as
    the ordinary step in flight."""
    run, w.run = w.run, None
    kv = w.kv
    reqs, c0 = run.reqs, run.c0
    zeros = [0] * j
    for eng in reqs:
        eng.all_token_ids.extend(zeros)  # the tokens the steps sampled (the simulator samples 0)
    n_alloc = j + 1 if running else j
    for s, phase, i in run.events:
        if s >= n_alloc:
            break
        eng = reqs[i]
        if phase == 0:
            eng.num_computed_tokens = c0[i] + s
            if not kv.allocate(eng, 1):
                raise AssertionError("a planned run ran out of pages")
        elif s < j:
            eng.num_computed_tokens = c0[i] + s + 1
            kv.cache_full_pages(eng)
    times = run.ends[:j]
    for eng, sim, c in zip(reqs, run.sims, c0):
        eng.num_computed_tokens = c + j
        sim.generated += j
        sim.token_times.extend(times)
    b = len(reqs)
    started = n_alloc
    if w.trace is not None:
        shape = tuple((e.request_id, 1) for e in reqs)
        w.trace.extend(((run.ends[s - 1] if s else run.start), shape) for s in range(started))
    for dur in run.durs[:started]:
        w.busy_s += dur
    w.steps += started
    w.batched_tokens += started * b
    w.decode_seqs += started * b
    w.last_step_s = run.durs[started - 1]
    if j:
        w.last_step_start = run.ends[j - 2] if j >= 2 else run.start
    if running:
        batch = ScheduledBatch(list(reqs), [1] * b, b)
        start = run.ends[j - 1] if j else run.start
        w.step = _Step(start, run.ends[j], batch, False, b)
        w.on_step(w, run.ends[j])
    else:
        w.step = None
