"""`InferenceService`: the grpc.aio servicer of pdcluster.v1.Inference.

Admission: at most `max_inflight` requests run across the pools; up to `max_queue` more wait
for a slot (their wait is the `queue_s` timing); beyond that a request is refused with
RESOURCE_EXHAUSTED at once. A client deadline or cancel ends the handler's task, and the
dispatcher cancels the request on both workers.

Drain (`drain`, the Drain RPC; SIGTERM through RouterServer.stop): new requests get UNAVAILABLE
"draining" while the listener stays open (health, ModelInfo, ClusterStatus still answer); the
running and queued ones finish within the grace; any left then are cancelled with UNAVAILABLE
saying the grace ran out, and the dispatcher frees their pages on both workers.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc

from engine.load import WorkerLoad
from router.dispatch import Chunk, Dispatcher, RequestStats
from router.frontend import Frontend, RequestError
from router.metrics import RouterMetrics, log_request
from router.wire import BadRequest
from proto.pdcluster.v1 import inference_pb2 as pb
from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc


class PoolTargets:
    """What the Scale RPC sets: each pool's target of serving workers, and moves of serving
    workers from one pool to another (role switches). The router only records them; the owner
    of the workers (cluster.scaler, in the driver process) reads the requests of every router
    (RouterActor.info, in the order they were made), starts, drains or moves workers until each
    pool has its target, and pushes back what it did (`status`), which ClusterStatus shows.
    The same targets are what a planner sets to resize pools."""

    def __init__(self, pools: dict[str, str], targets: dict[str, int], max_replicas: int = 16,
                 move_refusals: dict[tuple[str, str], str] | None = None) -> None:
        self.roles = dict(pools)                     # pool -> role
        self.targets = dict(targets)                 # pool -> the config's replicas, then the latest target
        self.max_replicas = max_replicas
        # (from, to) -> why workers cannot move between those pools (engine shape, resources); absent: they can
        self.move_refusals = dict(move_refusals or {})
        self.requests: dict[str, tuple[float, int]] = {}  # pool -> (time.time() of the Scale call, replicas)
        self.moves: list[tuple[float, str, str, int]] = []  # (time.time() of the call, from, to, workers), latest 64
        # from the driver: {"pools": {pool: {"target", "stamp", "current", "start_failures", "error"}},
        #                   "workers": [{"worker_id", "pool", "role", "state", "error", "moving_to"}]} (workers
        # the router has not been given, or no longer has: starting, switching, failed, stopped; and those moving)
        self.status: dict = {}

    def check(self, pool: str, replicas: int) -> str | None:
        """Why a Scale request is invalid (naming the field and the allowed range), or None."""
        if pool not in self.roles:
            return f"pool must be one of {sorted(self.roles)}, got {pool[:64]!r}"
        if not 1 <= replicas <= self.max_replicas:
            return f"replicas must be in [1, {self.max_replicas}], got {replicas}"
        return None

    def check_move(self, pool: str, to_pool: str, move: int) -> str | None:
        """Why a move request is invalid (naming the field and the allowed range), or None."""
        if pool not in self.roles:
            return f"pool must be one of {sorted(self.roles)}, got {pool[:64]!r}"
        others = sorted(p for p in self.roles if p != pool)
        if to_pool not in others:
            return f"to_pool must be one of {others} (a pool other than {pool!r}), got {to_pool[:64]!r}"
        refusal = self.move_refusals.get((pool, to_pool))
        if refusal is not None:
            return f"workers cannot move from pool {pool!r} to {to_pool!r}: {refusal}"
        most = min(self.target(pool) - 1, self.max_replicas - self.target(to_pool))
        if most < 1:
            return (f"move must be in [1, max(target({pool}) - 1, max_replicas - target({to_pool}))]: pool {pool!r} "
                    f"has target {self.target(pool)} (one worker stays) and {to_pool!r} {self.target(to_pool)} of "
                    f"at most {self.max_replicas}, so no worker can move now")
        if not 1 <= move <= most:
            return f"move must be in [1, {most}] for pools {pool!r} -> {to_pool!r}, got {move}"
        return None

    def target(self, pool: str) -> int:
        pushed = self.status.get("pools", {}).get(pool)
        asked = self.requests.get(pool)
        stamp = pushed.get("stamp", 0.0) if pushed is not None else 0.0
        base = pushed["target"] if pushed is not None else self.targets[pool]
        if asked is not None and asked[0] > stamp:
            stamp, base = asked
        # moves recorded here and not yet taken by the driver (its pushed stamp is older)
        return base + sum((n if to == pool else -n) for t, frm, to, n in self.moves
                          if t > stamp and pool in (frm, to))

    def set(self, pool: str, replicas: int) -> int:
        """Record a target; returns the previous one."""
        previous = self.target(pool)
        self.requests[pool] = (time.time(), replicas)
        return previous

    def move(self, pool: str, to_pool: str, move: int) -> tuple[int, int]:
        """Record a move of `move` serving workers; returns both pools' previous targets."""
        previous = self.target(pool), self.target(to_pool)
        self.moves = (self.moves + [(time.time(), pool, to_pool, move)])[-64:]
        return previous


class InferenceService(pb_grpc.InferenceServicer):
    def __init__(self, frontend: Frontend, dispatcher: Dispatcher, *, model_id: str, architecture: str,
                 eos_token_ids: list[int], max_inflight: int = 64, max_queue: int = 256) -> None:
        if max_inflight < 1 or max_queue < 0:
            raise ValueError(f"max_inflight must be >= 1 and max_queue >= 0, got {max_inflight}, {max_queue}")
        self.frontend = frontend
        self.dispatcher = dispatcher
        self.model_id, self.architecture, self.eos_token_ids = model_id, architecture, list(eos_token_ids)
        self.max_inflight, self.max_queue = max_inflight, max_queue
        self._slots = asyncio.Semaphore(max_inflight)
        self._waiting = 0
        self._running = 0
        self._active: set[str] = set()
        self.served = 0
        self.failed = 0
        self.draining = False
        self.on_draining = None  # called (awaited) when a drain begins: RouterServer updates health
        self.default_grace_s = 30.0
        self._handlers: set[asyncio.Task] = set()  # Generate calls past the draining check
        self._shutdown_reason = ""  # set when a drain's grace ran out: why the handlers are cancelled
        # handlers suspended at a yield: their message is in the transport's hands (grpc.aio's send). A
        # cancel landing there would end the call with no status, so a drain stops them when they resume
        self._at_yield: set[asyncio.Task] = set()
        self._stopping: set[asyncio.Task] = set()
        self.metrics = RouterMetrics(lambda: dispatcher.views, dispatcher.kv_index, dispatcher)
        self.pool_targets: PoolTargets | None = None  # set where something owns the workers (a Ray cluster)

    async def Generate(self, request: pb.GenerateRequest | BadRequest, context: grpc.aio.ServicerContext):
        try:
            async for msg in self.generate(request):
                yield msg
        except RequestError as exc:
            await context.abort(exc.code, str(exc))

    async def generate(self, request: pb.GenerateRequest | BadRequest) -> AsyncIterator[pb.GenerateResponse]:
        """One Generate call, through whichever door it came (gRPC, the OpenAI HTTP API): its
        messages, the final one with usage and timings; a RequestError ends it with its status."""
        try:
            arrival = time.monotonic()
            if isinstance(request, BadRequest):
                raise RequestError(request.reason)
            if self.draining:
                raise RequestError("the router is draining: it takes no new requests; retry on another replica",
                                   grpc.StatusCode.UNAVAILABLE)
            task = asyncio.current_task()
            self._handlers.add(task)
            try:
                async for msg in self._generate(request, arrival):
                    yield msg
            finally:
                self._handlers.discard(task)
        except RequestError as exc:
            self.metrics.errors.labels(code=exc.code.name).inc()
            raise

    async def _generate(self, request: pb.GenerateRequest, arrival: float):
        # validation, tokenization and chat templating off the event loop: a large request
        # must not hold up every other stream and call
        prepared = await asyncio.to_thread(self.frontend.prepare, request)
        rid = prepared.request_id
        if rid in self._active:
            raise RequestError(f"request_id {rid!r} is already in flight", grpc.StatusCode.ALREADY_EXISTS)
        if self._running >= self.max_inflight and self._waiting >= self.max_queue:
            raise RequestError(f"the admission queue is full ({self._waiting} waiting, max_queue={self.max_queue}, "
                               f"{self._running} running, max_inflight={self.max_inflight}); retry later",
                               grpc.StatusCode.RESOURCE_EXHAUSTED)
        self._active.add(rid)
        stats = RequestStats(arrival=arrival)
        self._waiting += 1
        m = self.metrics
        m.waiting.inc()
        acquired = finished = False
        try:
            await self._slots.acquire()
            acquired = True
            self._waiting -= 1
            self._running += 1
            m.waiting.dec()
            m.running.inc()
            stats.admitted = time.monotonic()
            ttft, last = 0.0, 0.0
            # closed explicitly, also when this generator is closed at a yield (a client gone):
            # the dispatcher's cleanup cancels the request on its workers at once
            async with contextlib.aclosing(self.dispatcher.generate(prepared, stats)) as chunks:
                async for chunk in chunks:
                    if chunk.token_ids:  # TTFT and ITL count token-bearing chunks, as clients see them
                        now = time.monotonic()
                        if not ttft:
                            ttft = now - arrival
                            m.ttft.observe(ttft)
                        else:
                            m.itl.observe(now - last)
                        last = now
                    task = asyncio.current_task()
                    self._at_yield.add(task)
                    try:
                        yield self._chunk(rid, chunk)
                    finally:
                        self._at_yield.discard(task)
                    if task in self._stopping:  # a drain ran out of grace while this chunk was being sent
                        raise asyncio.CancelledError
            final = self._final(rid, stats, ttft)
            # counted before the final message is yielded: a caller may stop at it and close
            # this generator (the HTTP stream does), and the request did finish
            self.served += 1
            self._observe_finished(rid, stats, final)
            finished = True
            task = asyncio.current_task()
            self._at_yield.add(task)
            try:
                yield final
            finally:
                self._at_yield.discard(task)
        except RequestError as exc:
            self.failed += 1
            self._log(rid, stats, {"error": exc.code.name})
            raise
        except asyncio.CancelledError:
            self.failed += 1
            if self._shutdown_reason:  # a drain ran out of grace: tell the client so
                self._log(rid, stats, {"error": grpc.StatusCode.UNAVAILABLE.name})
                raise RequestError(self._shutdown_reason, grpc.StatusCode.UNAVAILABLE) from None
            m.errors.labels(code=grpc.StatusCode.CANCELLED.name).inc()
            self._log(rid, stats, {"error": grpc.StatusCode.CANCELLED.name})
            raise
        except GeneratorExit:  # closed by its caller: a client gone (unless it had finished)
            if not finished:
                self.failed += 1
                m.errors.labels(code=grpc.StatusCode.CANCELLED.name).inc()
                self._log(rid, stats, {"error": grpc.StatusCode.CANCELLED.name})
            raise
        finally:
            if acquired:
                self._running -= 1
                m.running.dec()
                self._slots.release()
            else:
                self._waiting -= 1
                m.waiting.dec()
            self._active.discard(rid)

    async def drain(self, grace_s: float | None = None) -> tuple[int, int]:
        """Refuse new requests, let those running finish within grace_s (default_grace_s), then
        cancel the rest; returns (finished, cancelled). A second drain waits for the same end."""
        grace_s = self.default_grace_s if grace_s is None else grace_s
        if not 0 <= grace_s <= 3600:
            raise ValueError(f"grace_s must be in [0, 3600], got {grace_s}")
        first = not self.draining
        self.draining = True
        if first and self.on_draining is not None:
            await self.on_draining()
        running = set(self._handlers)
        if running:
            await asyncio.wait(running, timeout=grace_s)
        left = [t for t in running if not t.done()]
        if left:
            self._shutdown_reason = (f"the router is shutting down: this request was still running when the drain's "
                                     f"grace of {grace_s:g} s ran out")
            for t in left:
                if t in self._at_yield:  # stops itself as its send returns (see __init__)
                    self._stopping.add(t)
                else:
                    t.cancel()
            _, stuck = await asyncio.wait(left, timeout=2)
            for t in stuck:  # a send that does not return (a client that stopped reading): cancel anyway
                t.cancel()
            if stuck:
                await asyncio.wait(stuck, timeout=8)
            self._stopping.difference_update(left)
        return len(running) - len(left), len(left)

    async def Drain(self, request: pb.DrainRequest | BadRequest, context: grpc.aio.ServicerContext) -> pb.DrainResponse:
        if isinstance(request, BadRequest):
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        grace = request.grace_s or None
        if grace is not None and not 0 < grace <= 3600:  # also nan
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"grace_s must be in (0, 3600] "
                                                                         f"(0: the default), got {request.grace_s}")
        finished, cancelled = await self.drain(grace)
        return pb.DrainResponse(finished=finished, cancelled=cancelled)

    async def Scale(self, request: pb.ScaleRequest | BadRequest, context: grpc.aio.ServicerContext) -> pb.ScaleResponse:
        if isinstance(request, BadRequest):
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        t = self.pool_targets
        if t is None:
            await self._abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                              "this router owns no workers it could start or stop (not a pdcluster serve cluster)")
        if request.move:
            why = t.check_move(request.pool, request.to_pool, request.move)
            if why is not None:
                await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, why)
            prev_from, prev_to = t.move(request.pool, request.to_pool, request.move)
            return pb.ScaleResponse(pool=request.pool, previous_target=prev_from, target=prev_from - request.move,
                                    current=self._current(request.pool), to_pool=request.to_pool,
                                    to_previous_target=prev_to, to_target=prev_to + request.move)
        why = t.check(request.pool, request.replicas)
        if why is not None:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, why)
        previous = t.set(request.pool, request.replicas)
        return pb.ScaleResponse(pool=request.pool, previous_target=previous, target=request.replicas,
                                current=self._current(request.pool))

    def _current(self, pool: str) -> int:
        """Serving workers of `pool` (not hot spares): the driver's count, else this router's."""
        pushed = (self.pool_targets.status.get("pools", {}).get(pool) if self.pool_targets is not None else None)
        if pushed is not None:
            return pushed["current"]
        return sum(1 for v in self.dispatcher.views.values() if v.pool == pool and v.state == "serving")

    def _pools(self) -> list[pb.PoolStatus]:
        t = self.pool_targets
        if t is None:
            return []
        out = []
        for pool, role in t.roles.items():
            pushed = t.status.get("pools", {}).get(pool, {})
            out.append(pb.PoolStatus(name=pool, role=role, target_replicas=t.target(pool),
                                     current_replicas=self._current(pool), max_replicas=t.max_replicas,
                                     start_failures=pushed.get("start_failures", 0), error=pushed.get("error", "")))
        return out

    async def _abort(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        self.metrics.errors.labels(code=code.name).inc()
        await context.abort(code, message)

    def _observe_finished(self, rid: str, s: RequestStats, final: pb.GenerateResponse) -> None:
        m, t = self.metrics, final.timings
        m.e2e.observe(t.e2e_s)
        m.queue.observe(t.queue_s)
        m.prefill.observe(t.prefill_s)
        if not s.local_prefill:  # a local prefill moves no KV: neither histogram counts it
            m.transfer.observe(t.transfer_s)
            m.transfer_bytes.observe(s.kv_bytes)
        m.requests.labels(finish_reason=s.finish_reason).inc()
        m.prompt_tokens.inc(s.prompt_tokens)
        m.generation_tokens.inc(s.completion_tokens)
        self._log(rid, s, {"queue_s": t.queue_s, "prefill_s": t.prefill_s, "transfer_s": t.transfer_s,
                           "ttft_s": t.ttft_s, "e2e_s": t.e2e_s, "finish_reason": s.finish_reason})

    @staticmethod
    def _log(rid: str, s: RequestStats, extra: dict) -> None:
        log_request({"request_id": rid, "prefill_worker": s.prefill_worker, "decode_worker": s.decode_worker,
                     "local_prefill": s.local_prefill, "attempts": s.attempts, "migrations": s.migrations,
                     "prompt_tokens": s.prompt_tokens,
                     "completion_tokens": s.completion_tokens, "cached_tokens": s.cached_prompt_tokens,
                     "kv_bytes": s.kv_bytes, **extra})

    @staticmethod
    def _chunk(rid: str, chunk: Chunk) -> pb.GenerateResponse:
        lps = [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                               top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
               for lp in chunk.logprobs or ()]
        return pb.GenerateResponse(request_id=rid, token_ids=chunk.token_ids, text=chunk.text, logprobs=lps)

    @staticmethod
    def _final(rid: str, s: RequestStats, ttft: float) -> pb.GenerateResponse:
        end = time.monotonic()
        return pb.GenerateResponse(
            request_id=rid, finish_reason=s.finish_reason,
            usage=pb.Usage(prompt_tokens=s.prompt_tokens, completion_tokens=s.completion_tokens,
                           cached_prompt_tokens=s.cached_prompt_tokens),
            timings=pb.Timings(queue_s=s.admitted - s.arrival, prefill_s=max(s.first_token - s.prefill_start, 0.0),
                               transfer_s=max(s.first_output - s.first_token, 0.0) if s.first_output else 0.0,
                               ttft_s=ttft, e2e_s=end - s.arrival),
            placement=pb.Placement(prefill_worker=s.prefill_worker, decode_worker=s.decode_worker,
                                   local_prefill=s.local_prefill, attempts=s.attempts,
                                   migrations=s.migrations))

    async def ModelInfo(self, request, context) -> pb.ModelInfoResponse:
        if isinstance(request, BadRequest):
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        f = self.frontend
        return pb.ModelInfoResponse(model_id=self.model_id, architecture=self.architecture, vocab_size=f.vocab_size,
                                    max_model_len=f.max_model_len, eos_token_ids=self.eos_token_ids,
                                    has_chat_template=f.has_chat_template, hash_page_size=f.hash_page_size)

    async def Tokenize(self, request, context) -> pb.TokenizeResponse:
        if isinstance(request, BadRequest):
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        try:
            ids, rendered = await asyncio.to_thread(self.frontend.tokens_of, request)
        except RequestError as exc:
            await context.abort(exc.code, str(exc))
        return pb.TokenizeResponse(token_ids=ids, rendered=rendered)

    async def ClusterStatus(self, request, context) -> pb.ClusterStatusResponse:
        if isinstance(request, BadRequest):
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        await self.dispatcher.refresh_loads()
        workers = []
        pushed = {w["worker_id"]: w for w in self.pool_targets.status.get("workers", ())} \
            if self.pool_targets is not None else {}
        index, tier = self.dispatcher.kv_index, self.dispatcher.tier
        for v in self.dispatcher.views.values():
            ld = v.load or WorkerLoad()
            kv = index.workers.get(v.worker_id) if index is not None else None
            workers.append(pb.WorkerStatus(
                worker_id=v.worker_id, pool=v.pool, role=v.role, healthy=v.healthy, error=v.error,
                free_pages=ld.free_pages, total_pages=ld.total_pages, running_requests=ld.running_requests,
                waiting_requests=ld.waiting_requests, queued_tokens=ld.queued_tokens,
                transferring_requests=ld.transferring_requests, tokens_per_s=ld.tokens_per_s,
                prefix_cache_hit_rate=ld.prefix_cache_hit_rate, requests_placed=v.placed, pid=v.pid, node=v.node,
                state=v.state, restarts=v.restarts, last_error=v.last_error,
                # a Ray worker's report (cluster.worker_host.ClusterWorkerLoad); an in-process worker has none
                tp_size=getattr(ld, "tp_size", 1) if v.load is not None else 0,
                rank_pids=getattr(ld, "rank_pids", ()), rank_nodes=getattr(ld, "rank_nodes", ()),
                num_threads=getattr(ld, "num_threads", 0),
                moving_to=pushed.get(v.worker_id, {}).get("moving_to", ""),
                kv_index_state=kv.state if kv is not None else "unknown",
                kv_index_blocks=len(kv.blocks) if kv is not None else 0,
                kv_index_reason=kv.reason if kv is not None else "no KV index" if index is None else "not synced yet"))
        for w in pushed.values():  # workers the driver has and this router has not (yet, or any more)
            if w["worker_id"] not in self.dispatcher.views:
                workers.append(pb.WorkerStatus(worker_id=w["worker_id"], pool=w["pool"], role=w["role"],
                                               healthy=False, state=w["state"], error=w.get("error", ""),
                                               last_error=w.get("error", ""), moving_to=w.get("moving_to", "")))
        return pb.ClusterStatusResponse(workers=workers, policy=self.dispatcher.policy.name, pools=self._pools(),
                                        inflight_requests=self._running, queued_requests=self._waiting,
                                        max_inflight=self.max_inflight, max_queue=self.max_queue,
                                        requests_served=self.served, requests_failed=self.failed,
                                        kv_index_exact=index is not None and index.all_exact(
                                            v.worker_id for v in self.dispatcher.views.values() if v.state == "serving"),
                                        kv_index_blocks=index.num_blocks if index is not None else 0,
                                        kv_stores=self._stores(), kv_fetched_tokens=self.dispatcher.fetched_tokens,
                                        kv_offloaded_tokens=tier.offloaded_tokens if tier is not None else 0)

    def _stores(self) -> list:
        tier, index = self.dispatcher.tier, self.dispatcher.kv_index
        out = []
        for sid, v in (tier.stores.items() if tier is not None else ()):
            ld = v.load or WorkerLoad()
            kv = index.workers.get(sid) if index is not None else None
            out.append(pb.KVStoreStatus(store_id=sid, node=v.node, healthy=v.healthy, error=v.error, pid=v.pid,
                                        total_pages=ld.total_pages, free_pages=ld.free_pages,
                                        hit_rate=ld.prefix_cache_hit_rate,
                                        kv_index_state=kv.state if kv is not None else "unknown",
                                        kv_index_blocks=len(kv.blocks) if kv is not None else 0))
        return out
