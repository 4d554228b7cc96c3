"""`Dispatcher`: one request's way across the pools, after validation.

    pick decode (policy) -> admit (pages + descriptor; maybe QUEUED_FOR_PAGES -> wait;
    LOCAL_PREFILL skips the prefill pool) -> pick prefill (policy) -> submit, await the
    first token -> send it to the client at once -> stream the decode worker's outputs
    (minus its copy of that first token) until finished.

The first token goes out as soon as the prefill result arrives, so TTFT does not include the
KV transfer, with its text: the prefill worker runs the decode side's incremental detokenizer
(same prompt, same stop strings) on it, and the router drops that text from the decode worker's
copy, so the text stays exactly what a colocated run produces.

Health: a worker's load is answered between its engine steps, so a worker in a long step
(a 2,048-token prefill chunk takes seconds on a CPU) answers late. Late is not dead: one load
call per worker stays pending across refreshes, the worker keeps its last load and stays
healthy. (Treating a 2 s timeout as death failed requests with UNAVAILABLE "no healthy prefill
worker" while the only prefill worker was busy.) A worker is out of placement when:

  - its load call or its output stream fails (its process or actor is gone): `replacing` while
    Ray restarts it (noticed the moment the output stream fails, not at the next refresh), or
    `dead`;
  - it answers nothing for `worker_timeout_s`: no load answer AND no output on its output
    stream (a worker streaming outputs is stepping, however late its load) -> `unresponsive`
    (a process stopped, deadlocked or swapped out; an engine step longer than worker_timeout_s
    counts as a hang too). Its handle is fenced at once (router.handles): every request open
    on it fails as if the worker were lost, so its decode streams migrate and its prefills
    move to another prefill worker; what it sends later for them is ignored, and their cancels
    are sent the moment it answers again, which frees their pages.

A worker that answers again after either (a new process, or the same one waking up) is
warmed up (one request through each of its prefill/decode pairs) before it is placed on again;
a failed warm-up is retried at once the first time, then with a backoff.

Hot spares: workers named in `spares` are loaded and warmed up but not placed on (`spare`).
Each pool keeps as many serving workers as it started with: when one leaves placement (lost,
replacing, unresponsive) a spare of its pool is promoted at once, and a worker that comes back
to a pool that is full again becomes a spare.

A prefill worker that fails before the first token (error result or a dead worker) gets the
request retried on another one, under a new worker-side id (`RID.TAG~N`) and fresh decode pages:
the failed attempt is cancelled on both sides first. Whatever ends the stream early (client
cancel, deadline, router shutdown) cancels the request on both workers, so their pages come
back.

Migration: a decode worker lost while it holds a request (its process, actor or engine loop
gone: at admission, while its KV arrives, or mid-stream) does not end the stream. The request
is placed again, as `RID.TAG@N`, with an `engine.outputs.Resume` carrying the tokens the client
already has: the new decode worker's KV for the prompt plus those tokens is prefilled by the
prefill pool or locally, as placement decides, and it samples on from there. Draws depend only
on (seed, position) (engine.sampler), and the router fixes a seed for every sampled request
that has none, so the continuation draws exactly the tokens an uninterrupted run would; the
resumed worker replays the tokens through its detokenizer and stop checks, so text and stop
strings continue seamlessly too. With no decode worker left, the stream waits for a
replacement (its client's deadline, or `migration_wait_s`). Past `migration_limit` losses the
request ends with UNAVAILABLE naming the workers it lost.

Where it lives: this module places and streams requests (the above, `Dispatcher`); the loads
and health tracking (load refresh, unresponsive workers, spares, rejoining) are
router/worker_health.py's `WorkerHealth`, and membership (the start-up warm-up, adding,
retiring and removing workers at run time, the cleanup of cancels) router/membership.py's
`Membership`, and the KV cache beyond one worker (fetch plans, fetches, offloads into the
nodes' stores) router/kv_fetch.py's `KVFetch`: mixins `Dispatcher` inherits, working on the
state its `__init__` sets.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from decode_worker.types import DecodeStage
from engine.outputs import RemotePrefix, Resume
from engine.sampling_params import SamplingParams
from prefill_worker.types import PrefillResult, PrefillTask
from router.frontend import PreparedRequest, RequestError
from router.fetch_rule import FetchCosts
from router.handles import WorkerHandle
from router.kv_fetch import KVFetch, capacity as _capacity
from router.kv_index import KVIndex, KVIndexSync
from router.kv_tier import KVTier
from router.membership import Membership
from router.pair_calls import admitted as _admitted, cancel_pair, first_line as _first_line
from router.policy import PlacementPolicy, WorkerView
from router.worker_health import WorkerHealth

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Chunk:
    token_ids: list[int]
    text: str
    logprobs: list | None = None  # engine.sampler.TokenLogprobs per token id, when asked


@dataclass(slots=True)
class RequestStats:
    arrival: float
    admitted: float = 0.0
    prefill_start: float = 0.0
    first_token: float = 0.0
    first_output: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    finish_reason: str = ""
    prefill_worker: str = ""
    decode_worker: str = ""
    local_prefill: bool = False
    attempts: int = 0
    migrations: int = 0  # decode workers lost under the request, whose stream continued elsewhere
    kv_bytes: int = 0  # KV moved prefill -> decode: destination pages x bytes per page, all layers
    fetched_tokens: int = 0  # prompt tokens the prefill worker fetched from a peer's cache (not computed)


@dataclass(slots=True)
class _Live:
    """What must be cancelled if the request ends early (one placement of it)."""
    decode: WorkerHandle | None = None
    decode_losses: int = 0  # the decode handle's `losses` when the request was admitted
    prefill: WorkerHandle | None = None
    worker_rid: str = ""
    done: bool = False
    first_token: int | None = None  # from the prefill result, sent ahead of the decode stream
    first_logprobs: object | None = None  # its engine.sampler.TokenLogprobs, when asked
    first_text: str = ""  # its text, as the decode side's detokenizer will emit it
    views: list[WorkerView] = field(default_factory=list)
    local_tokens: tuple[WorkerView, int] | None = None  # a colocated prefill not yet sampled: its prompt

    def end_local_prefill(self) -> None:
        if self.local_tokens is not None:
            view, n = self.local_tokens
            view.inflight_tokens -= n
            self.local_tokens = None


class _DecodeLost(Exception):
    """The decode worker holding a request was lost: the stream may continue on another."""

    def __init__(self, worker_id: str, cause: str) -> None:
        super().__init__(f"decode worker {worker_id} lost: {cause}")
        self.worker_id, self.cause = worker_id, cause


class Dispatcher(WorkerHealth, Membership, KVFetch):
    def __init__(self, prefills: Sequence[WorkerHandle], decodes: Sequence[WorkerHandle], policy: PlacementPolicy,
                 *, max_prefill_attempts: int = 2, worker_timeout_s: float = 10.0, migration_limit: int = 2,
                 migration_wait_s: float = 60.0, spares: Sequence[str] = (), kv_index: KVIndex | None = None,
                 fetch_min_pages: int = 0, stores: Sequence[WorkerHandle] = ()) -> None:
        """`kv_index`: the cluster's KV index, fed from every worker's KV events at each load
        refresh (router/kv_index.py); None: no events are pulled. `stores`: the nodes' KV stores
        (router/kv_tier.py; they need the index)."""
        if not decodes:
            raise ValueError("the router needs at least one decode (or colocated) worker")
        self.prefills = {h.worker_id: h for h in prefills}
        self.decodes = {h.worker_id: h for h in decodes}
        self.views = {h.worker_id: WorkerView(h.worker_id, h.pool, "prefill") for h in prefills}
        self.views.update({h.worker_id: WorkerView(h.worker_id, h.pool, h.role) for h in decodes})
        self.policy = policy
        self.max_prefill_attempts = max_prefill_attempts
        if not worker_timeout_s > 0:
            raise ValueError(f"worker_timeout_s must be > 0, got {worker_timeout_s}")
        self.worker_timeout_s = worker_timeout_s
        unknown = set(spares) - set(self.views)
        if unknown:
            raise ValueError(f"spares must name workers of the router, got {sorted(unknown)}")
        self.spares = frozenset(spares)
        # how many serving workers each pool keeps (spares are promoted to keep it)
        self.serving_target: dict[str, int] = {}
        for v in self.views.values():
            self.serving_target[v.pool] = self.serving_target.get(v.pool, 0) + (v.worker_id not in self.spares)
        self.handles = {**self.prefills, **self.decodes}
        for wid, h in self.handles.items():
            h.on_lost = lambda exc, wid=wid: self._lost(wid, exc)
        if not 0 <= migration_limit <= 16:
            raise ValueError(f"migration_limit must be in [0, 16], got {migration_limit}")
        if not migration_wait_s > 0:
            raise ValueError(f"migration_wait_s must be > 0, got {migration_wait_s}")
        self.migration_limit, self.migration_wait_s = migration_limit, migration_wait_s
        self._back = asyncio.Event()  # set (and replaced) whenever a worker enters placement
        self._cleanup: set[asyncio.Task] = set()
        self._started = time.monotonic()
        self._load_calls: dict[str, asyncio.Task] = {}  # at most one pending load() per worker
        self._answered: dict[str, float] = {}           # when each worker's load last answered
        self._warming: dict[str, asyncio.Task] = {}     # restarted workers being warmed up
        self._silent_since: dict[str, float] = {}       # unresponsive workers: since when they answer nothing
        self._retiring: set[str] = set()                # workers being drained for removal (scale-in)
        self.kv_index = kv_index
        # prefix fetch (issue 37): fetch a prompt's cached leading pages from the worker that holds
        # at least this many more of them than the chosen prefill worker (0: never fetch)
        self.fetch_min_pages = fetch_min_pages
        self.fetch_timeout_s = 10.0
        self.fetch_counts = {"fetched": 0, "recomputed": 0}
        self.fetched_tokens = 0
        self.fetched_by_source = {"store": 0, "worker": 0}
        self.fetch_costs = FetchCosts()
        self._kv_sync = KVIndexSync(kv_index) if kv_index is not None else None
        if stores and kv_index is None:
            raise ValueError("stores need a kv_index (the router finds prefixes in them by it)")
        self.tier = KVTier(stores, kv_index, self._kv_sync, self.fetch_costs) if stores else None

    def _candidates(self, ids, exclude=()) -> list[WorkerView]:
        return [self.views[w] for w in ids if w not in exclude and self.views[w].healthy]

    def _decode_candidates(self, req: PreparedRequest) -> list[WorkerView]:
        """The healthy decode (or colocated) workers, or only the one the request pins."""
        pin = req.decode_worker
        if not pin:
            decodes = self._candidates(self.decodes)
            if not decodes:
                raise RequestError("no healthy decode worker", grpc.StatusCode.UNAVAILABLE)
            return decodes
        if pin not in self.decodes:
            shown = pin if len(pin) <= 64 else pin[:64] + "..."
            raise RequestError(f"decode_worker must be empty or one of {sorted(self.decodes)}, got {shown!r}")
        view = self.views[pin]
        if not view.healthy:
            raise RequestError(f"decode_worker {pin!r} is unhealthy: {view.error or 'no detail'}",
                               grpc.StatusCode.UNAVAILABLE)
        return [view]

    # ---- one request ----------------------------------------------------------------------
    async def generate(self, req: PreparedRequest, stats: RequestStats) -> AsyncIterator[Chunk]:
        """The request's chunks, from wherever it runs; it moves to another decode worker when
        its own is lost (the module docstring)."""
        stats.prompt_tokens = len(req.prompt_token_ids)
        if req.params.seed is None and not req.params.greedy:
            # a continuation elsewhere draws the tokens this run would only under the same key
            req.params = dataclasses.replace(req.params, seed=secrets.randbits(63))
        sent_ids: list[int] = []
        sent_chars = 0
        lost: list[str] = []
        resume: Resume | None = None
        while True:
            try:
                async for chunk in self._attempt(req, stats, resume, len(lost)):
                    sent_ids += chunk.token_ids
                    sent_chars += len(chunk.text)
                    yield chunk
                return
            except _DecodeLost as exc:
                lost.append(exc.worker_id)
                view = self.views[exc.worker_id]
                if view.healthy:  # out of placement until it answers again (replaced, warmed up)
                    self._out(view, "replacing", f"lost under request {req.request_id}: {exc.cause}")
                if len(lost) > self.migration_limit:
                    raise RequestError(f"the request lost decode workers {lost}, more than migration_limit="
                                       f"{self.migration_limit}: {exc.cause}", grpc.StatusCode.UNAVAILABLE) from exc
                stats.migrations = len(lost)
                log.warning("%s: migrating after %d tokens: %s", req.request_id, len(sent_ids), exc)
                resume = Resume(tuple(sent_ids), sent_chars) if sent_ids else None
                await self._wait_for_decode(req, lost)

    async def _wait_for_decode(self, req: PreparedRequest, lost: list[str]) -> None:
        """Until a decode worker can take the migrating request (a replacement, when the lost one
        was the only one), for migration_wait_s at most; the client's deadline may end it first."""
        await self._wait_for(lambda: self._decode_candidates(req), f"to continue on (lost: {lost})",
                             [req.decode_worker] if req.decode_worker else list(self.decodes), "no healthy decode worker")

    async def _wait_for(self, candidates, what: str, pool: list[str], none: str) -> None:
        """Until `candidates()` (which may raise RequestError while there are none) finds a worker
        of `pool`, for migration_wait_s at most, woken whenever a worker enters placement or is
        given up on; at once when every worker of `pool` is dead (nothing will come back)."""
        deadline = time.monotonic() + self.migration_wait_s
        while True:
            back = self._back
            try:
                if candidates():
                    return
                error = none
            except RequestError as exc:
                error = str(exc)
            left = deadline - time.monotonic()
            if all(self.views[w].state == "dead" for w in pool if w in self.views):
                raise RequestError(f"{error} {what}: every one is dead ({', '.join(pool)})", grpc.StatusCode.UNAVAILABLE)
            if left <= 0:
                raise RequestError(f"{error} {what} within migration_wait_s={self.migration_wait_s:g}",
                                   grpc.StatusCode.UNAVAILABLE)
            try:
                await asyncio.wait_for(back.wait(), left)
            except asyncio.TimeoutError:
                pass

    async def _attempt(self, req: PreparedRequest, stats: RequestStats, resume: Resume | None,
                       migration: int) -> AsyncIterator[Chunk]:
        """One placement of the request: its chunks until it finishes, or _DecodeLost."""
        live = _Live()
        try:
            await self._place(req, stats, live, resume, migration)
            ahead, ahead_text = 0, ""  # ids (and their text) sent before the decode stream reported them
            if live.first_token is not None:
                ahead, ahead_text = 1, live.first_text
                stats.completion_tokens += 1
                yield Chunk([live.first_token], ahead_text, _logprobs(req, [live.first_logprobs]))
            async for out in self._decode_stream(live):
                ids = list(out.new_token_ids)
                if ids or out.new_text:
                    if not stats.first_output:  # for a disaggregated request: the transfer is done
                        stats.first_output = time.monotonic()
                        if stats.local_prefill:  # sampled where it decodes: prefill ends here, no transfer
                            live.end_local_prefill()
                            if not stats.first_token:
                                stats.first_token = stats.first_output
                                stats.cached_prompt_tokens = out.num_cached_tokens
                    # The decode side's copy of the first token (source PREFILL_WORKER, or the
                    # re-sampled one after a REPREFILL) was already sent, with its text.
                    drop = min(ahead, len(ids))
                    ids, ahead = ids[drop:], ahead - drop
                    text = out.new_text
                    if ahead_text and drop:
                        if text.startswith(ahead_text):
                            text = text[len(ahead_text):]
                        else:  # never expected: the same detokenizer on the same tokens
                            log.warning("%s: first token's text %r differs from the decode side's %r",
                                        live.worker_rid, ahead_text, text)
                        ahead_text = ""
                    lps = out.new_logprobs[drop:] if out.new_logprobs is not None else None
                    stats.completion_tokens += len(ids)
                    if ids or text:
                        yield Chunk(ids, text, _logprobs(req, lps))
                if out.finished:
                    live.done = True
                    if out.finish_reason in ("error", "abort"):
                        raise RequestError(f"request ended on decode worker {live.decode.worker_id}: "
                                           f"{out.finish_reason}: {out.error or 'no detail'}",
                                           grpc.StatusCode.UNAVAILABLE)
                    stats.finish_reason = out.finish_reason or "stop"
                    if resume is None:
                        self._expect_conversation(live, req, out.token_ids)
                        self._offload(live, req, out.token_ids)
                    return
        finally:
            live.end_local_prefill()
            for v in live.views:
                v.inflight -= 1
            if not live.done:
                self._abort_later(live)

    @staticmethod
    async def _decode_stream(live: _Live) -> AsyncIterator:
        """The decode worker's outputs; a worker lost mid-stream (its process, actor or engine
        loop gone) raises _DecodeLost, which migrates the request."""
        try:
            async for out in live.decode.stream(live.worker_rid):
                yield out
        except RequestError:
            raise
        except Exception as exc:  # CancelledError is not an Exception: it passes through
            raise _DecodeLost(live.decode.worker_id, f"mid-stream: {type(exc).__name__}: {_first_line(exc)[:300]}") from exc

    async def _place(self, req: PreparedRequest, stats: RequestStats, live: _Live, resume: Resume | None = None,
                     migration: int = 0) -> None:
        tried: set[str] = set()
        # worker-side ids are the router's own, unguessable: the client's id plus a random tag
        base = f"{req.request_id}.{secrets.token_hex(8)}" + (f"@{migration}" if migration else "")
        prompt = req.prompt_token_ids if resume is None else req.prompt_token_ids + list(resume.output_token_ids)
        retry = 0
        while True:
            stats.attempts += 1
            rid = base if not retry else f"{base}~{retry}"
            retry += 1
            dview = self.policy.place(self._decode_candidates(req), req.block_hashes, len(prompt))
            decode = self.decodes[dview.worker_id]
            live.decode, live.prefill, live.worker_rid = decode, None, rid
            # Counted before the admit is awaited: a worker answers between engine steps, so a
            # burst arriving during one long step would otherwise see the same counts and all
            # be placed on that one worker. The caller's `finally` uncounts live.views.
            dview.inflight += 1
            dview.placed += 1
            live.views.append(dview)
            live.decode_losses = decode.losses
            local = self._local_fetch(dview, req) if resume is None else None
            try:
                if local is None:
                    adm = await decode.admit(rid, req.prompt_token_ids, req.params, resume)
                else:  # it prefills here, after fetching the cached pages from their holder
                    adm = await decode.admit(rid, req.prompt_token_ids, req.params, resume,
                                             RemotePrefix(local[0].pages))
                if adm.stage == DecodeStage.QUEUED_FOR_PAGES:
                    adm = await _admitted(decode, rid)
            except ValueError as exc:  # the worker's own limits (pages, lengths)
                live.done = True
                raise RequestError(f"decode worker {dview.worker_id} refused the request: {exc}") from exc
            except RequestError:
                raise
            except Exception as exc:  # its process, actor or engine loop is gone
                raise _DecodeLost(dview.worker_id, f"at admission: {type(exc).__name__}: {_first_line(exc)[:300]}") from exc
            stats.decode_worker = dview.worker_id
            if adm.stage == DecodeStage.LOCAL_PREFILL and local is not None and adm.prefix_fetch is not None:
                stats.prefill_start = stats.prefill_start or time.monotonic()
                stats.fetched_tokens = await self._fetch(decode, local[0].holder, adm.prefix_fetch, prompt)
            if adm.stage == DecodeStage.LOCAL_PREFILL:
                stats.local_prefill = True
                # its engine caches the prompt's pages as it prefills (the next turn of a
                # conversation finds them there)
                self.policy.remember(dview, req.block_hashes, _capacity(dview))
                if dview.role == "colocated":
                    dview.inflight_tokens += len(prompt)
                    live.local_tokens = (dview, len(prompt))
                if not stats.prefill_start:
                    stats.prefill_start = time.monotonic()  # first_token: when the decode stream first yields
                return
            stats.local_prefill = False
            stats.kv_bytes = adm.kv_bytes
            prefills = self._candidates(self.prefills, exclude=tried)
            if not prefills:
                raise RequestError("no healthy prefill worker", grpc.StatusCode.UNAVAILABLE)
            # the worker with the earliest estimated first token, counting what a fetch saves it
            plans = self._fetch_plans(prefills, req) if resume is None else {}
            saved = {wid: gain / self.fetch_costs.prefill_s_per_token for wid, (_, gain) in plans.items()}
            pview = self.policy.pick_prefill(prefills, req.block_hashes, saved)
            tried.add(pview.worker_id)
            prefill = self.prefills[pview.worker_id]
            live.prefill = prefill
            stats.prefill_worker = pview.worker_id
            pview.placed += 1
            pview.inflight += 1
            pview.inflight_tokens += len(prompt)
            if not stats.prefill_start:
                stats.prefill_start = time.monotonic()
            prefill_lost = False
            plan = plans.get(pview.worker_id)
            source = (plan[0].holder, plan[0].pages) if plan is not None else None
            try:
                # every decode rank's descriptor: the prefill worker sends each rank its KV heads
                task = PrefillTask(rid, prompt, _remaining(req.params, resume), list(adm.descriptors),
                                   remote_prefix=RemotePrefix(source[1]) if source else None)
                async def fetch_from_holder(fetch, holder=source[0] if source else ""):
                    stats.fetched_tokens = await self._fetch(prefill, holder, fetch, prompt)
                result = await (prefill.submit(task, fetch_from_holder) if source else prefill.submit(task))
            except ValueError as exc:
                raise RequestError(f"prefill worker {pview.worker_id} refused the request: {exc}") from exc
            except Exception as exc:  # the worker died or its actor is gone: retryable
                result = PrefillResult(rid, None, len(prompt), ok=False,
                                       error=f"prefill worker {pview.worker_id} lost: {type(exc).__name__}: "
                                             f"{_first_line(exc)}")
                if pview.healthy:  # (an unresponsive one was fenced: it stays unresponsive)
                    self._out(pview, "replacing", result.error)
                prefill_lost = True
            finally:
                pview.inflight -= 1
                pview.inflight_tokens -= len(prompt)
            if result.ok:
                self.policy.remember(pview, req.block_hashes, _capacity(pview))
                if not stats.first_token:
                    stats.first_token = time.monotonic()
                    stats.cached_prompt_tokens = result.num_cached_tokens
                    if not stats.fetched_tokens:  # (a fetch's wait is not prefill time)
                        self.fetch_costs.observe_prefill(len(prompt) - result.num_cached_tokens,
                                                         stats.first_token - stats.prefill_start)
                    elif result.fetch_s and self.kv_index is not None:  # the pages' whole wait, as the worker saw it
                        self.fetch_costs.observe_fetch(stats.fetched_tokens // self.kv_index.page_size, result.fetch_s,
                                                       "worker" if source[0] in self.handles else "store")
                live.first_token = result.first_token
                live.first_logprobs = result.first_logprobs
                live.first_text = result.first_text if resume is None else ""  # resumed: its context differs
                return
            log.warning("prefill of %s failed on %s (attempt %d): %s", rid, pview.worker_id, retry, result.error)
            decode_answered = await self._abort(decode, prefill, rid)
            live.views.remove(dview)
            dview.inflight -= 1
            if decode.losses != live.decode_losses or not decode_answered:
                live.done = True  # nothing left to cancel: the decode side went with its process
                raise _DecodeLost(dview.worker_id, f"while its KV was sent: {result.error}")
            if prefill_lost:  # its replacement is a new process: it may take the retry
                tried.discard(pview.worker_id)
            if retry >= self.max_prefill_attempts or not (prefill_lost or self._candidates(self.prefills, exclude=tried)):
                live.done = True
                raise RequestError(f"prefill failed on {sorted(tried | {pview.worker_id})} (max_prefill_attempts="
                                   f"{self.max_prefill_attempts}): {result.error}", grpc.StatusCode.UNAVAILABLE)
            if prefill_lost:  # with no other prefill worker, wait for the replacement, as a migration does
                await self._wait_for(lambda: self._candidates(self.prefills, exclude=tried),
                                     f"to retry the prefill on (lost: {pview.worker_id})", list(self.prefills),
                                     "no healthy prefill worker")

    _abort = staticmethod(cancel_pair)  # also membership's (router.membership)


def _remaining(params: SamplingParams, resume: Resume | None) -> SamplingParams:
    """A resumed request's params for the prefill side, which sees prompt + the tokens so far as
    its prompt: the tokens still to generate, so the two together stay within max_model_len."""
    if resume is None:
        return params
    return dataclasses.replace(params, max_tokens=max(params.max_tokens - len(resume.output_token_ids), 1))


def _logprobs(req: PreparedRequest, lps: list | None) -> list | None:
    if req.params.logprobs is None:
        return None
    if lps is None or any(lp is None for lp in lps):
        raise RequestError("a worker returned no logprobs for a request that asked for them",
                           grpc.StatusCode.INTERNAL)
    return lps
