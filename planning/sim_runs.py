"""Runs of decode steps: a worker's next decode steps planned at once (`_plan_run`) and applied to
its engine when the run ends or something reaches the worker (`_apply_run`), as the mixin
`DecodeRuns` of `EngineSim`.

A run is planned when every running request decodes (one token each, all in one batch),
nothing waits to be admitted (or every sequence slot is taken), and at least two steps pass
before a request samples its last token or pages run out. The batch cannot change before
then, so each step's batch and time are known in advance. A run may start with the step the
scheduler builds to join requests whose KV arrived, and ends with the step that samples a
request's last token (applied the ordinary way). Nothing is applied to the engine until the
run ends or is interrupted (`EngineSim.end_run`, `EngineSim.sync`); then every page the steps
took and registered is taken and registered through the KV manager's own calls, in the order
the step-by-step path makes them.
"""
from __future__ import annotations

import bisect
from itertools import accumulate
from dataclasses import dataclass

from engine.scheduler import ScheduledBatch


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
    """Decode steps planned at once. Only their times are worked out in advance; the pages
    they take and fill are worked out (and taken) when the run is applied, for the steps that
    ran (`apply_run`)."""
    start: float
    ends: list          # end time of each step
    durs: list          # each step's time
    reqs: list          # the running engine requests, in batch order
    sims: list          # their SimRequests
    c0: list            # their computed tokens when the run began
    first_page: list    # per request: the first step whose token needs a new page (then every page_size)
    page_size: int
    last_ordinary: bool = False  # its last step samples a request's last token: applied the ordinary way
    _allocs: tuple = (-1, 0)  # (step, pages taken by the steps up to it): the last `allocs` answer

    def started(self, t: float) -> int:
        """Steps started by time `t` (steps ending before `t` are done, the next one is running)."""
        return min(bisect.bisect_left(self.ends, t) + 1, len(self.ends))

    def allocs(self, step: int) -> int:
        """Pages taken by the steps up to and including `step`."""
        if self._allocs[0] != step:
            ps = self.page_size
            self._allocs = (step, sum((step - s) // ps + 1 for s in self.first_page if s <= step))
        return self._allocs[1]


class DecodeRuns:
    """EngineSim's runs of decode steps (a mixin: the worker's state is EngineSim's)."""

    def _plan_run(self, now: float) -> tuple[float | None, ScheduledBatch | None]:
        """Plan the steps from `now` on as one run when every running request decodes (one token
        each, all in one batch), nothing waits to be admitted (or every sequence slot is taken), and
        at least two steps pass before pages run out; the step that samples a request's last token is the run's last. Requests
        whose KV arrived join first: the scheduler builds the run's first step (`schedule`), and
        when that is such a batch the run starts with it. Returns (the run's end, None), or (None,
        the batch the scheduler built, if it did) for a single ordinary step. Exactness: the
        step-by-step path would schedule exactly these batches (the scheduler's inputs change only
        through this worker's methods, each of which calls `sync` first, or through a step that
        samples a first or last token, which ends the run), and its step times are the same
        function of the same batch, summed in the same order."""
        sched = self.scheduler
        seqs = sched.max_num_seqs
        # with every sequence slot taken, nothing joins or is admitted before a request finishes
        if sched.waiting and len(sched.running) < seqs:
            return None, None
        first = None
        if sched.ready and len(sched.running) < seqs:  # they join in this step, while slots last
            first = sched.schedule()
            if (first.preempted or first.failed or first.saving
                    or ((sched.ready or sched.waiting) and len(sched.running) < seqs)
                    or first.num_decodes != len(first.requests) or len(first.requests) != len(sched.running)
                    or any(r.status.finished for r in first.joined)):
                return None, first
        reqs = sched.running
        b = len(reqs)
        if not b or b > sched.max_num_batched_tokens:
            return None, first
        sims = []
        fin = self._run_len  # the first step that samples a request's last token (or the most to plan)
        requests = self._requests
        for eng in reqs:
            computed = eng.num_computed_tokens
            sim = requests[eng.request_id]
            p = eng.params
            if (computed != len(eng.all_token_ids) - 1 or computed < eng.num_prompt_tokens or sim.generated < 1
                    or sim.cached < 0 or eng.detokenizer is not None or p.stop_token_ids or not p.ignore_eos):
                return None, first
            fin = min(fin, p.max_tokens - eng.num_output_tokens - 1, eng.max_total_tokens - computed - 2,
                      sim.output_len - sim.generated - 1)
            sims.append(sim)
        if fin < 2:  # at least two steps before a request's last
            return None, first
        # a step that samples a last token ends the run, and is applied the ordinary way at its end
        # (the owner hears of the request then, as on the step-by-step path)
        m = min(self._run_len, fin + 1)
        ps = self.kv.page_size
        c0 = [eng.num_computed_tokens for eng in reqs]
        first_page = [len(eng.pages) * ps - c for eng, c in zip(reqs, c0)]
        if min(first_page) < 0:
            return None, first
        free = self.kv.num_free_pages
        if sum((m - 1 - s) // ps + 1 for s in first_page if s < m) > free:
            # pages run out within the run: it stops before the step that would preempt
            counts = [0] * m
            for s in first_page:
                for k in range(s, m, ps):
                    counts[k] += 1
            total = 0
            for s, n in enumerate(counts):
                total += n
                if total > free:
                    m = s
                    break
            if m < 2:
                return None, first
        durs = self.latency.decode_step_times(b, sum(c0) + b, m)
        if self.load_per_stream and b > 1:  # the load terms of EngineSim._duration, in its order
            f = 1.0 + self.load_per_stream * (b - 1)
            durs = [d * f for d in durs]
        if self.load_base:
            f = 1.0 + self.load_base
            durs = [d * f for d in durs]
        ends = list(accumulate(durs, initial=now))
        del ends[0]
        self.run = _Run(now, ends, durs, list(reqs), sims, c0, first_page, ps, m == fin + 1)
        t = ends[-1]
        self.step = _Step(now, t, None, False, b)
        return t, None

    def _run_events(self, run: _Run, n_alloc: int, j: int) -> list:
        """(step, 0 = take a page | 1 = register full pages, request position) for the pages the
        first `n_alloc` steps take and the first `j` steps fill, in the order the step-by-step path
        makes those calls (a step's pages are taken when it is scheduled, filled ones registered at
        its end)."""
        ps = run.page_size
        events = []
        for i, s in enumerate(run.first_page):
            events.extend((k, 0, i) for k in range(s, n_alloc, ps))
        if self.kv.pool.enable_prefix_caching:  # the steps whose token fills a page
            for i, (eng, c) in enumerate(zip(run.reqs, run.c0)):
                s = max(0, (eng.num_cached_pages_registered + 1) * ps - c - 1)
                if s < j:
                    events.append((s, 1, i))
                    s = ((c + s + 1) // ps + 1) * ps - c - 1
                    events.extend((k, 1, i) for k in range(s, j, ps))
        events.sort()
        return events

    def _apply_run(self, j: int, running: bool, notify: bool = True) -> None:
        """Apply the run's first `j` steps; with `running`, also schedule step j (its pages) as
        the ordinary step in flight (and with `notify`, tell the owner when it ends)."""
        run, self.run = self.run, None
        kv = self.kv
        reqs, c0 = run.reqs, run.c0
        n_alloc = j + 1 if running else j
        events = self._run_events(run, n_alloc, j)
        zeros = [0] * j
        for eng in reqs:
            eng.all_token_ids.extend(zeros)  # the tokens the steps sampled (the simulator samples 0)
        for s, phase, i in events:
            eng = reqs[i]
            if phase == 0:
                eng.num_computed_tokens = c0[i] + s
                if not kv.allocate(eng, 1):
                    raise AssertionError("a planned run ran out of pages")
            else:
                eng.num_computed_tokens = c0[i] + s + 1
                kv.cache_full_pages(eng)
        times = run.ends[:j]
        for eng, sim, c in zip(reqs, run.sims, c0):
            eng.num_computed_tokens = c + j
            sim.generated += j
            sim.token_times.extend(times)
        b = len(reqs)
        started = n_alloc
        if self.trace is not None:
            shape = tuple((e.request_id, 1) for e in reqs)
            self.trace.extend(((run.ends[s - 1] if s else run.start), shape) for s in range(started))
        for dur in run.durs[:started]:
            self.busy_s += dur
        self.steps += started
        self.batched_tokens += started * b
        self.decode_seqs += started * b
        self.last_step_s = run.durs[started - 1]
        if j:
            self.last_step_start = run.ends[j - 2] if j >= 2 else run.start
        if running:
            batch = ScheduledBatch(list(reqs), [1] * b, b)
            start = run.ends[j - 1] if j else run.start
            self.step = _Step(start, run.ends[j], batch, False, b)
            if notify:
                self.on_step(self, run.ends[j])
        else:
            self.step = None
