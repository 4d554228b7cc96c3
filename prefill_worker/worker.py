"""`PrefillWorker`: an EngineCore that runs each request to its first token and sends the
prompt's KV to the decode side layer by layer.

A request's way through the worker:

    submit(task) -> engine waiting queue -> (chunks under the step's token budget, prefix-cache
    hits skipped) -> final chunk scheduled: sender.start(descriptors, pages) -> that step's
    forward calls send_layer(i) as each layer's K/V is written -> first token sampled:
    PrefillResult reported at once (TTFT), sender.finish(first_token, prompt_len) ->
    pages held until the sender's on_release (DONE or FAILED) -> kv.free (full pages stay
    in the prefix cache).

Threading: the worker is single-threaded; call `submit`, `cancel` and `step` from one thread
(a harness loop, or an asyncio task that
runs `step` through `asyncio.to_thread` while it owns the worker). The sender's `on_release` runs on transport threads, so it only
puts the request id on a queue that `step` drains.
"""
from __future__ import annotations

import dataclasses
import queue
import time
from pathlib import Path

import torch

from engine.core import EngineCore
from engine.request import Request
from kv_transfer.config import TransferConfig
from kv_transfer.layout import KVPool
from kv_transfer.registry import create_sender
from kv_transfer.states import TransferState
from prefill_worker.tasks import PrefillLoad, PrefillResult, PrefillTask


def engine_kv_pool(core: EngineCore, model_id: str) -> KVPool:
    """The engine's own KV tensors as a transfer pool (registered once, never copied)."""
    return KVPool.from_tensors(core.runner.kv_caches, model_id)


class PrefillWorker:
    def __init__(self, model: str | Path, *, transport: str = "nixl", transfer_config: TransferConfig | None = None,
                 model_id: str | None = None, sender_kwargs: dict | None = None, **engine_kwargs) -> None:
        engine_kwargs.setdefault("detokenize", False)
        self.core = EngineCore(model, **engine_kwargs)
        self.core.scheduler.on_retire = self._on_retire
        self.model_id = model_id or self.core.model_dir.name
        self.pool = engine_kv_pool(self.core, self.model_id)
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.sender = create_sender(transport, self.pool, transfer_config or TransferConfig(),
                                    on_release=lambda rid, pages, state: self._released.put(rid),
                                    **(sender_kwargs or {}))
        self._tasks: dict[str, PrefillTask] = {}     # submitted, not yet sampled
        self._requests: dict[str, Request] = {}      # in the engine (waiting or running)
        self._held: dict[str, Request] = {}          # finished, pages pinned by the transfer
        self._sending: set[str] = set()              # transfer started (release will come)
        self.num_prefilled = 0

    # ---- intake ---------------------------------------------------------------------------
    def submit(self, task: PrefillTask) -> None:
        """Queue a prefill. Raises ValueError (nothing queued) if the request is invalid."""
        if task.request_id in self._tasks or task.request_id in self._held:
            raise ValueError(f"request_id {task.request_id!r} is already being prefilled")
        if not task.destinations:
            raise ValueError("PrefillTask.destinations must hold at least one descriptor")
        one_token = dataclasses.replace(task.params, max_tokens=1, stop=[])
        req = self.core.make_request(task.prompt_token_ids, one_token, task.request_id)
        for d in task.destinations:
            if d.num_tokens != req.num_prompt_tokens:
                raise ValueError(f"destination {d.endpoint} expects {d.num_tokens} tokens, the prompt has "
                                 f"{req.num_prompt_tokens}")
        self._tasks[req.request_id] = task
        self._requests[req.request_id] = req
        self.core.scheduler.add(req)

    def cancel(self, request_id: str) -> bool:
        """Stop a prefill at any stage: dequeue it, or fail its transfer (pages come back on
        release). Returns False if the worker does not know the request."""
        self._tasks.pop(request_id, None)
        req = self._requests.pop(request_id, None)
        if req is not None:
            self.core.scheduler.abort(req)  # frees its pages
            return True
        if request_id in self._sending:
            self.sender.cancel(request_id, "cancelled by the prefill worker's caller")
            self._drain_releases()
            return True
        return False

    # ---- the step -------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        """Whether `step` would do something now (held pages waiting for their release are
        not work: a loop should idle rather than spin while transfers finish)."""
        return self.core.scheduler.has_unfinished or not self._released.empty()

    @property
    def has_requests(self) -> bool:
        """Any request still open, its transfer included (a release can make work without a call)."""
        return bool(self.has_work or self._sending)

    @property
    def num_transferring(self) -> int:
        """Requests whose pages are still pinned by their transfer."""
        return len(self._sending)

    def step(self) -> list[PrefillResult]:
        """One engine step plus transfer bookkeeping; returns the first tokens sampled in it."""
        self._drain_releases()
        sched = self.core.scheduler
        batch = sched.schedule()
        if batch.empty:
            return []
        starting: list[str] = []
        results: list[PrefillResult] = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            if req.num_computed_tokens + n == req.num_prompt_tokens and req.num_output_tokens == 0:
                err = self._start_transfer(req)
                if err is None:
                    starting.append(req.request_id)
                else:
                    results.append(PrefillResult(req.request_id, None, req.num_prompt_tokens, ok=False, error=err))

        def on_layer(i: int) -> None:
            for rid in starting:
                status = self.sender.status(rid)
                if status is not None and not status.state.terminal:
                    self.sender.send_layer(rid, i)

        sampled = self.core.runner.execute(batch, on_layer=on_layer if starting else None)
        for req, _ in zip(batch.requests, batch.num_new_tokens):
            if req not in sampled:
                continue
            token, logprobs = sampled[req]
            rid = req.request_id
            if rid in starting:
                status = self.sender.status(rid)
                if status is not None and not status.state.terminal:
                    self.sender.finish(rid, token, req.num_prompt_tokens)
                ok = status is not None and status.state != TransferState.FAILED
                results.append(PrefillResult(rid, token, req.num_prompt_tokens, max(req.num_cached_tokens, 0),
                                             ttft_s=time.monotonic() - req.metrics.arrival_time, ok=ok,
                                             error=None if ok else (status.error if status else "no transfer"),
                                             first_logprobs=logprobs))
        self.core.finish_step(batch, sampled)  # retires sampled requests into _held (on_retire)
        for r in results:
            self._tasks.pop(r.request_id, None)
            self._requests.pop(r.request_id, None)
        self.num_prefilled += sum(1 for r in results if r.ok)
        self._drain_releases()
        return results

    def _start_transfer(self, req: Request) -> str | None:
        task = self._tasks[req.request_id]
        try:
            status = self.sender.start(req.request_id, task.destinations, list(req.pages), req.num_prompt_tokens)
        except Exception as exc:  # a refused start leaves nothing tracked; the request still finishes
            return f"transfer start failed: {type(exc).__name__}: {exc}"
        self._sending.add(req.request_id)
        if status.state == TransferState.FAILED:
            return status.error or "transfer failed at start"
        return None

    def _on_retire(self, req: Request) -> None:
        if req.request_id in self._sending:
            self._held[req.request_id] = req
        else:
            self.core.kv.free(req)

    def _drain_releases(self) -> None:
        while True:
            try:
                rid = self._released.get_nowait()
            except queue.Empty:
                return
            self._sending.discard(rid)
            req = self._held.pop(rid, None)
            if req is not None:
                self.core.kv.free(req)

    # ---- load -----------------------------------------------------------------------------
    def load(self) -> PrefillLoad:
        sched, pool = self.core.scheduler, self.core.kv.pool
        return PrefillLoad(
            queued_requests=len(sched.waiting),
            queued_tokens=sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting),
            running_requests=len(sched.running),
            running_tokens=sum(r.num_tokens - r.num_computed_tokens for r in sched.running),
            transferring_requests=len(self._sending),
            free_pages=self.core.num_free_pages,
            total_pages=self.core.num_pages,
            prefix_cache_hit_rate=pool.hits / pool.queries if pool.queries else 0.0,
            prefix_cache_queries=pool.queries,
        )

    def close(self) -> None:
        for rid in list(self._requests):
            self.cancel(rid)
        self.sender.close()
        self._drain_releases()


def set_worker_threads(n: int = 1) -> None:
    """Worker processes run one intra-op thread by default: contending OpenMP threads on a
    shared CPU made steps several times slower."""
    torch.set_num_threads(n)
