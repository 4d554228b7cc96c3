"""`DecodeWorker`: an EngineCore whose requests mostly arrive with their prompt KV already
computed elsewhere. A request's stage:

    admit --pages free--> WAITING_FOR_KV --transfer DONE--> DECODING --stop|length--> FINISHED
      |  \\--pages short--> QUEUED_FOR_PAGES --pages free--^      ^
      |                                                  FAILED <-+- transfer FAILED (policy FAIL)
      \\--uncached prompt < threshold--> LOCAL_PREFILL --first token--> DECODING
                 transfer FAILED (policy REPREFILL) --^
    any live stage --cancel--> CANCELLED (pages freed at once: queue dropped, transfer failed
                               through the receiver, or engine abort)

WAITING_FOR_KV holds the pages the receiver writes into; on DONE the request takes the first
token from the final notice (skipping the one uniform the prefill side drew for it, so seeded
output matches a colocated run), joins the batch with `Scheduler.add_running` and decodes.
Preemption by recompute is the engine's: a transferred request that loses its pages is
recomputed here from its prompt and outputs.

Threading: single-threaded; call `admit`, `cancel`, `step` and `load` from one thread (see
async_worker.py for the asyncio front with a loop thread). The receiver's `on_release` runs on
transport threads and only queues the request id for `step` to handle.
"""
from __future__ import annotations

import enum
import queue
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from decode_worker.types import (Admission, DecodeConfig, DecodeLoad, DecodeOutput, StepResult, TokenSource,
                                 TransferFailurePolicy)
from engine.core import EngineCore
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from kv_transfer.config import TransferConfig
from kv_transfer.layout import KVPool
from kv_transfer.registry import create_receiver
from kv_transfer.states import TransferState


class DecodeStage(enum.IntEnum):
    QUEUED_FOR_PAGES = 0
    WAITING_FOR_KV = 1
    LOCAL_PREFILL = 2
    DECODING = 3
    FINISHED = 4
    FAILED = 5
    CANCELLED = 6

    @property
    def terminal(self) -> bool:
        return self >= DecodeStage.FINISHED


@dataclass(slots=True, eq=False)
class _Entry:
    req: Request
    stage: DecodeStage


def _new_logprobs(out) -> list | None:
    """The logprobs of `out.new_token_ids` (engine outputs carry the whole list so far)."""
    if out.logprobs is None:
        return None
    n = len(out.new_token_ids)
    return list(out.logprobs[len(out.logprobs) - n:]) if n else []


def engine_kv_pool(core: EngineCore, model_id: str) -> KVPool:
    """The engine's own KV tensors as a transfer pool (registered once, never copied)."""
    return KVPool.from_tensors(core.runner.kv_caches, model_id)


class DecodeWorker:
    def __init__(self, model: str | Path, *, transport: str = "nixl", transfer_config: TransferConfig | None = None,
                 config: DecodeConfig | None = None, model_id: str | None = None,
                 receiver_kwargs: dict | None = None, **engine_kwargs) -> None:
        self.config = config or DecodeConfig()
        self.core = EngineCore(model, **engine_kwargs)
        self.model_id = model_id or self.core.model_dir.name
        self.pool = engine_kv_pool(self.core, self.model_id)
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.receiver = create_receiver(transport, self.pool, transfer_config or TransferConfig(),
                                        on_release=lambda rid, pages: self._released.put(rid),
                                        **(receiver_kwargs or {}))
        self._entries: dict[str, _Entry] = {}
        self._queued: deque[_Entry] = deque()        # QUEUED_FOR_PAGES, FIFO
        self._waiting_kv: dict[str, _Entry] = {}     # WAITING_FOR_KV
        self._releasing: dict[str, Request] = {}     # cancelled/failed, pages still with the receiver
        self._pending: list[DecodeOutput] = []       # outputs produced outside step() (cancel)
        self._decoded: deque[tuple[float, int]] = deque()
        self.num_local_prefills = 0
        self.num_reprefills = 0

    @property
    def endpoint(self) -> str:
        return self.receiver.endpoint

    def stage(self, request_id: str) -> DecodeStage | None:
        entry = self._entries.get(request_id)
        return entry.stage if entry is not None else None

    # ---- admission ------------------------------------------------------------------------
    def admit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Admission:
        """Take a new request: pages + descriptor, a place in the page queue, or a local prefill.
        Raises ValueError (nothing kept) for an invalid request."""
        if request_id in self._entries or request_id in self._releasing:
            raise ValueError(f"request_id {request_id!r} is already on this decode worker")
        req = self.core.make_request(prompt_token_ids, params, request_id)
        entry = _Entry(req, DecodeStage.QUEUED_FOR_PAGES)
        self._entries[request_id] = entry
        if self.config.local_prefill_threshold:
            cached = self.core.kv.find_cached_prefix(req)
            if req.num_prompt_tokens - len(cached) * self.core.page_size < self.config.local_prefill_threshold:
                entry.stage = DecodeStage.LOCAL_PREFILL
                self.num_local_prefills += 1
                self.core.scheduler.add(req)
                return Admission(request_id, entry.stage)
        if not self._queued and self._try_allocate(entry):
            return self._expect(entry)
        self._queued.append(entry)
        return Admission(request_id, entry.stage)

    def _try_allocate(self, entry: _Entry) -> bool:
        req, kv = entry.req, self.core.kv
        if kv.num_free_pages - self._pages_for(req) < self.config.reserve_pages:
            return False
        return kv.allocate(req, req.num_prompt_tokens)

    def _pages_for(self, req: Request) -> int:
        return -(-req.num_prompt_tokens // self.core.kv.page_size)

    def _expect(self, entry: _Entry) -> Admission:
        req = entry.req
        desc = self.receiver.expect(req.request_id, list(req.pages), req.num_prompt_tokens)
        entry.stage = DecodeStage.WAITING_FOR_KV
        self._waiting_kv[req.request_id] = entry
        return Admission(req.request_id, entry.stage, desc, len(req.pages))

    # ---- cancellation ---------------------------------------------------------------------
    def cancel(self, request_id: str) -> bool:
        """End a request at any stage; its pages are free when this returns (or, if a write
        into them is still in flight, as soon as the receiver's ledger releases them)."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return False
        req, stage = entry.req, entry.stage
        if stage == DecodeStage.QUEUED_FOR_PAGES:
            self._queued.remove(entry)
        elif stage == DecodeStage.WAITING_FOR_KV:
            del self._waiting_kv[request_id]
            self._release_transfer(req, "cancelled by the decode worker")
        else:
            self.core.scheduler.abort(req)  # frees its pages
        req.abort()
        entry.stage = DecodeStage.CANCELLED
        self._pending.append(self._output(entry, [], TokenSource.DECODE_WORKER, "abort"))
        return True

    def _release_transfer(self, req: Request, reason: str) -> None:
        rid = req.request_id
        self._releasing[rid] = req
        self.receiver.cancel(rid, reason)
        status = self.receiver.status(rid)
        if status is not None and status.state == TransferState.DONE:
            try:
                self.receiver.take(rid)  # it finished just before the cancel: the pages are ours again
            except ValueError:
                pass  # already retired by the ledger
            else:
                self._released.put(rid)
        self._drain_releases([])

    # ---- the step -------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        """Whether `step` would do something now. Requests waiting for KV or for pages are not
        work: a loop with nothing else to do should idle briefly instead of spinning (on a
        shared CPU a spinning decode loop takes the core the prefill process needs)."""
        if self._pending or self.core.scheduler.has_unfinished or not self._released.empty():
            return True
        if self._queued and self._pages_for(self._queued[0].req) <= self.core.kv.num_free_pages - self.config.reserve_pages:
            return True
        return any(self._arrived(rid) for rid in self._waiting_kv)

    @property
    def has_requests(self) -> bool:
        """Any request (or page release) still open, at any stage."""
        return bool(self._entries or self._releasing or self.has_work)

    def _arrived(self, request_id: str) -> bool:
        status = self.receiver.status(request_id)
        return status is not None and status.state == TransferState.DONE

    def step(self) -> StepResult:
        """Transfer bookkeeping (releases, page queue, arrived KV) plus one engine step."""
        result = StepResult(outputs=self._pending)
        self._pending = []
        self._drain_releases(result.outputs)
        while self._queued and self._try_allocate(self._queued[0]):
            result.admissions.append(self._expect(self._queued.popleft()))
        self._join_arrived(result.outputs)
        batch = self.core.scheduler.schedule()
        if not batch.empty:
            sampled = self.core.runner.execute(batch)
            num_decoded = 0
            for out in self.core.finish_step(batch, sampled):
                entry = self._entries.get(out.request_id)
                if entry is None:
                    continue
                num_decoded += len(out.new_token_ids)
                if entry.stage == DecodeStage.LOCAL_PREFILL:
                    entry.stage = DecodeStage.DECODING
                if out.finished:
                    entry.stage = DecodeStage.FINISHED
                    del self._entries[out.request_id]
                result.outputs.append(DecodeOutput(out.request_id, out.new_token_ids, out.token_ids,
                                                   TokenSource.DECODE_WORKER, entry.stage, out.finished,
                                                   out.finish_reason, out.new_text,
                                                   new_logprobs=_new_logprobs(out),
                                                   num_cached_tokens=out.num_cached_tokens))
            self._decoded.append((time.monotonic(), num_decoded))
        self._drain_releases(result.outputs)
        return result

    def _join_arrived(self, outputs: list[DecodeOutput]) -> None:
        sched = self.core.scheduler
        for rid, entry in list(self._waiting_kv.items()):
            if not self._arrived(rid):
                continue
            if len(sched.running) >= sched.max_num_seqs:
                return
            del self._waiting_kv[rid]
            status = self.receiver.take(rid)
            req = entry.req
            if status.prompt_len != req.num_prompt_tokens or status.first_token is None:
                self.core.kv.free(req)
                self._transfer_failed(entry, f"final notice says prompt_len={status.prompt_len}, "
                                             f"expected {req.num_prompt_tokens}", outputs)
                continue
            req.num_computed_tokens = req.num_prompt_tokens
            req.num_cached_tokens = 0
            req.metrics.first_scheduled_time = time.monotonic()
            if req.generator is not None:
                torch.rand(1, generator=req.generator)  # the uniform the prefill side drew
            req.append_token(status.first_token)
            if req.status.finished:
                self.core.kv.free(req)
                entry.stage = DecodeStage.FINISHED
                del self._entries[rid]
            else:
                sched.add_running(req)
                entry.stage = DecodeStage.DECODING
            out = req.take_output()
            outputs.append(DecodeOutput(rid, out.new_token_ids, out.token_ids, TokenSource.PREFILL_WORKER,
                                        entry.stage, out.finished, out.finish_reason, out.new_text,
                                        new_logprobs=_new_logprobs(out)))

    def _drain_releases(self, outputs: list[DecodeOutput]) -> None:
        while True:
            try:
                rid = self._released.get_nowait()
            except queue.Empty:
                return
            req = self._releasing.pop(rid, None)
            if req is not None:  # cancelled (or already failed): the pages were only waiting for this
                self.core.kv.free(req)
                continue
            entry = self._waiting_kv.pop(rid, None)
            if entry is None:
                continue
            self.core.kv.free(entry.req)
            status = self.receiver.status(rid)
            self._transfer_failed(entry, status.error if status is not None else "transfer failed", outputs)

    def _transfer_failed(self, entry: _Entry, error: str | None, outputs: list[DecodeOutput]) -> None:
        req = entry.req
        if self.config.on_transfer_failure == TransferFailurePolicy.REPREFILL:
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            entry.stage = DecodeStage.LOCAL_PREFILL
            self.num_reprefills += 1
            self.core.scheduler.add(req)
            return
        req.abort()
        entry.stage = DecodeStage.FAILED
        del self._entries[req.request_id]
        outputs.append(self._output(entry, [], TokenSource.DECODE_WORKER, "error", error or "transfer failed"))

    def _output(self, entry: _Entry, new: list[int], source: TokenSource, reason: str | None,
                error: str | None = None) -> DecodeOutput:
        return DecodeOutput(entry.req.request_id, new, entry.req.output_token_ids, source, entry.stage,
                            entry.stage.terminal, reason, error=error)

    # ---- load -----------------------------------------------------------------------------
    def load(self) -> DecodeLoad:
        sched = self.core.scheduler
        now = time.monotonic()
        window = self.config.tokens_per_s_window_s
        while self._decoded and self._decoded[0][0] < now - window:
            self._decoded.popleft()
        span = min(window, now - self._decoded[0][0]) if self._decoded else 0.0
        rate = sum(n for _, n in self._decoded) / span if span > 0 else 0.0
        return DecodeLoad(
            running_requests=len(sched.running),
            waiting_requests=len(self._queued) + len(self._waiting_kv) + len(sched.waiting),
            queued_for_pages=len(self._queued),
            waiting_for_kv=len(self._waiting_kv),
            free_pages=self.core.num_free_pages,
            total_pages=self.core.num_pages,
            tokens_per_s=rate,
            num_preemptions=sched.num_preemptions,
            num_local_prefills=self.num_local_prefills,
            num_reprefills=self.num_reprefills,
        )

    def close(self) -> None:
        for rid in list(self._entries):
            self.cancel(rid)
        self._pending.clear()
        self.receiver.close()
        self._drain_releases([])
