"""`DecodeWorker`: an EngineCore whose requests mostly arrive with their prompt KV computed
elsewhere, plus the decode side's policies. A request's stage (types.DecodeStage):

    admit --pages free--> WAITING_FOR_KV --KV received--> DECODING --stop|length--> FINISHED
      |  \\--pages short--> QUEUED_FOR_PAGES --pages free--^      ^
      |                                                  FAILED <-+- KV failed (policy FAIL)
      \\--uncached prompt < threshold, or a remote prefix--> LOCAL_PREFILL --first token--> DECODING
                        KV failed (policy REPREFILL) --^
    any live stage --cancel--> CANCELLED (pages freed at once, or once the receiver lets go)

What is this worker's own, the engine does not know:
- decode-first admission with page reservation: a request takes its destination pages when
  admitted, keeping `reserve_pages` free for the running batch, or waits in a FIFO page queue
  (QUEUED_FOR_PAGES, not in the engine yet);
- the local-prefill decision: a prompt whose uncached part is shorter than
  `local_prefill_threshold` is prefilled here; without a connector (a colocated worker) every
  prompt is;
- the transfer-failure policy (`on_transfer_failure`), which the engine asks when a request's
  KV fails.
Everything else is the engine's: WAITING_FOR_KV is its WAITING_FOR_REMOTE_KV state; on arrival
the request joins the batch with the first token sampled by the prefill side (a draw depends
only on seed and position, so seeded output matches a colocated run); preemption recomputes.

Prefix fetch (engine/prefix_fetch.py; the router drives it): `admit(..., remote_prefix=
RemotePrefix(k))` prefills here after fetching the prompt's first k pages from a peer (the
Admission's `prefix_fetch` goes to that peer's `export_prefix`; a failed fetch computes them
here); `export_prefix` sends this worker's cached pages to a peer; `abandon_fetch` gives a fetch
up. The connector sends too, for that (at tensor_parallel_size 1 only).

With `tensor_parallel_size=N` (an engine keyword) every rank receives its own KV heads: an
admission carries one descriptor per rank, all of which go to the prefill worker.

Threading: single-threaded; call every method from one thread (engine/loop.py runs it).
"""
from __future__ import annotations

import dataclasses
from collections import deque
from pathlib import Path

from decode_worker.types import (Admission, DecodeConfig, DecodeOutput, DecodeStage, TokenSource,
                                 TransferFailurePolicy)
from engine.core import EngineCore, resolve_model
from engine.kv_events import KVEventBatch
from engine.load import WorkerLoad
from engine.outputs import PrefixExport, PrefixFetch, RemotePrefix, RequestOutput, Resume
from engine.request import Request
from engine.sampling_params import SamplingParams
from kv_transfer import prefix
from kv_transfer.config import TransferConfig
from kv_transfer.tp_connector import make_connector


class DecodeWorker:
    CALLS = ("admit", "cancel", "kv_events", "export_prefix", "abandon_fetch")  # what a remote caller may run (engine/async_worker.py)

    def __init__(self, model: str | Path, *, transport: str | None = "nixl",
                 transfer_config: TransferConfig | None = None, config: DecodeConfig | None = None,
                 model_id: str | None = None, transport_kwargs: dict | None = None, **engine_kwargs) -> None:
        """`transport=None`: a colocated worker, which prefills every prompt itself."""
        self.config = config or DecodeConfig()
        tp = engine_kwargs.get("tensor_parallel_size", 1)
        self.connector = None if transport is None else make_connector(
            transport, transfer_config, model_id=model_id or resolve_model(model).name, receive=True, send=tp == 1,
            transport_kwargs=transport_kwargs, tensor_parallel_size=tp)
        self.core = EngineCore(model, kv_connector=self.connector, on_kv_failure=self._on_kv_failure, **engine_kwargs)
        self._init_state()

    @classmethod
    def over(cls, core: EngineCore, *, transport: str | None = "nixl", transfer_config: TransferConfig | None = None,
             config: DecodeConfig | None = None, transport_kwargs: dict | None = None,
             max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None) -> DecodeWorker:
        """A decode (or, with `transport=None`, colocated) worker over an idle engine that had
        another role (a role switch: the weights, the KV cache and its cached prefixes stay;
        EngineCore.set_kv_connector)."""
        self = cls.__new__(cls)
        self.config = config or DecodeConfig()
        self.connector = None if transport is None else make_connector(
            transport, transfer_config, model_id=core.model_dir.name, receive=True, send=True,
            transport_kwargs=transport_kwargs)
        core.set_kv_connector(self.connector, self._on_kv_failure, max_num_batched_tokens=max_num_batched_tokens,
                              max_num_seqs=max_num_seqs, detokenize=True)
        self.core = core
        self._init_state()
        return self

    def _init_state(self) -> None:
        self._stages: dict[str, DecodeStage] = {}  # every open request, by id
        self._queued: deque[Request] = deque()       # QUEUED_FOR_PAGES, FIFO
        self._pending: list[DecodeOutput] = []       # outputs made outside a step (a queued request cancelled)
        self.num_local_prefills = 0
        self.num_reprefills = 0

    @property
    def endpoint(self) -> str:
        return self.connector.endpoint

    def stage(self, request_id: str) -> DecodeStage | None:
        return self._stages.get(request_id)

    # ---- admission ------------------------------------------------------------------------
    def admit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
              resume: Resume | None = None, remote_prefix: RemotePrefix | None = None) -> Admission:
        """Take a new request: pages + descriptor, a place in the page queue, or a local prefill.
        With `resume`, the request continues a stream whose decode worker was lost: its KV (prompt
        and the tokens generated so far) is prefilled here or by the prefill side like a new
        prompt's, and it goes on sampling where that worker stopped. Raises ValueError (nothing
        kept) for an invalid request. With `remote_prefix`, the request is prefilled here after
        its first pages are fetched from a peer (the Admission's `prefix_fetch`; None: nothing to
        fetch)."""
        if request_id in self._stages:
            raise ValueError(f"request_id {request_id!r} is already on this decode worker")
        req = self.core.make_request(prompt_token_ids, params, request_id, resume=resume)
        if remote_prefix is not None:
            fetch = prefix.fetch_of(request_id, self.core.add_fetching(req, remote_prefix.num_pages))
            self.num_local_prefills += 1
            self._stages[request_id] = DecodeStage.LOCAL_PREFILL
            return Admission(request_id, DecodeStage.LOCAL_PREFILL, prefix_fetch=fetch)
        threshold = self.config.local_prefill_threshold
        if self.connector is None or req.status.finished or (
                threshold and req.num_tokens - self.core.cached_prefix_tokens(req) < threshold):
            self.core.add(req)
            self.num_local_prefills += 1
            self._stages[request_id] = DecodeStage.LOCAL_PREFILL
            return Admission(request_id, DecodeStage.LOCAL_PREFILL)
        if not self._queued:
            adm = self._receive(req)
            if adm is not None:
                return adm
        self._queued.append(req)
        self._stages[request_id] = DecodeStage.QUEUED_FOR_PAGES
        return Admission(request_id, DecodeStage.QUEUED_FOR_PAGES)

    def _fits(self, req: Request) -> bool:
        return self.core.num_free_pages - self.core.pages_for(req.num_tokens) >= self.config.reserve_pages

    def _receive(self, req: Request) -> Admission | None:
        """Pages for the prompt and the descriptor to receive into, or None (pages short)."""
        where = self.core.add_remote(req) if self._fits(req) else None
        if where is None:
            return None
        self._stages[req.request_id] = DecodeStage.WAITING_FOR_KV
        descs = where if isinstance(where, list) else [where]  # one per rank of a tensor-parallel engine
        return Admission(req.request_id, DecodeStage.WAITING_FOR_KV, [d.to_bytes() for d in descs],
                         sum(len(d.page_ids) for d in descs),
                         sum(len(d.page_ids) * d.layout.page_bytes * d.layout.num_layers for d in descs))

    def _on_kv_failure(self, req: Request, error: str) -> bool:
        """The engine asks: the request's KV will not come. True: prefill it here."""
        if self.config.on_transfer_failure == TransferFailurePolicy.REPREFILL:
            self._stages[req.request_id] = DecodeStage.LOCAL_PREFILL
            self.num_reprefills += 1
            return True
        return False

    def export_prefix(self, fetch: PrefixFetch, prompt_token_ids: list[int]) -> PrefixExport:
        """Send a peer the cached pages it asked for (its PrefixFetch): pinned and sending when
        this returns, or fewer (possibly none) when the prefix cache no longer holds them."""
        return prefix.export(self.core, fetch, prompt_token_ids)

    def abandon_fetch(self, request_id: str) -> bool:
        """Compute a fetching request's whole prompt instead (its holder sends nothing)."""
        return self.core.abandon_fetch(request_id)

    # ---- cancellation ---------------------------------------------------------------------
    def cancel(self, request_id: str) -> bool:
        """End a request at any stage; its final output says "abort". Its pages are free when
        this returns, or as soon as the receiver lets go of them if a write is in flight."""
        stage = self._stages.pop(request_id, None)
        if stage is None:
            return False
        if stage == DecodeStage.QUEUED_FOR_PAGES:
            req = next(r for r in self._queued if r.request_id == request_id)
            self._queued.remove(req)
            req.abort()
            self._pending.append(DecodeOutput(request_id, [], [], TokenSource.DECODE_WORKER, DecodeStage.CANCELLED,
                                              True, "abort"))
        else:
            self.core.abort(request_id)
        return True

    # ---- the step -------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        """Whether `step` would do something now (requests waiting for KV are not work: the
        engine's connector wakes its loop when their KV arrives)."""
        return bool(self._pending or self.core.has_work or (self._queued and self._fits(self._queued[0])))

    @property
    def has_requests(self) -> bool:
        """Any request (or held page) still open, at any stage."""
        return bool(self._stages or self._pending or self.core.has_requests)

    def step(self) -> list[Admission | DecodeOutput]:
        """Admissions of queued requests that got pages, then one engine step's outputs."""
        outputs: list[Admission | DecodeOutput] = self._pending
        self._pending = []
        while self._queued:
            adm = self._receive(self._queued[0])
            if adm is None:
                break
            self._queued.popleft()
            outputs.append(adm)
        outputs += [self._output(out) for out in self.core.step()]
        return outputs

    def _output(self, out: RequestOutput) -> DecodeOutput:
        rid = out.request_id
        stage = self._stages.get(rid)
        source = TokenSource.DECODE_WORKER
        if stage == DecodeStage.WAITING_FOR_KV and out.new_token_ids:
            source = TokenSource.PREFILL_WORKER  # joined with the prefill side's first token
        if out.finished:
            self._stages.pop(rid, None)
            stage = {"stop": DecodeStage.FINISHED, "length": DecodeStage.FINISHED,
                     "error": DecodeStage.FAILED}.get(out.finish_reason, DecodeStage.CANCELLED)
        elif out.new_token_ids:
            stage = self._stages[rid] = DecodeStage.DECODING
        return DecodeOutput(rid, out.new_token_ids, out.token_ids, source, stage, out.finished, out.finish_reason,
                            out.new_text, error=out.error, new_logprobs=_new_logprobs(out),
                            num_cached_tokens=out.num_cached_tokens)

    # ---- load -----------------------------------------------------------------------------
    def load(self) -> WorkerLoad:
        load = self.core.load()
        return dataclasses.replace(load, waiting_requests=load.waiting_requests + len(self._queued),
                                   queued_for_pages=len(self._queued), num_local_prefills=self.num_local_prefills,
                                   num_reprefills=self.num_reprefills,
                                   local_prefill_threshold=self.config.local_prefill_threshold if self.connector else 0)

    def kv_events(self, epoch: str, since: int) -> KVEventBatch:
        """The prefix cache's events after `since` of `epoch`, or a snapshot (EngineCore.kv_events)."""
        return self.core.kv_events(epoch, since)

    def close(self) -> None:
        for req in list(self._queued):
            self.cancel(req.request_id)
        self._pending.clear()
        self.core.close()
        self._stages.clear()


def _new_logprobs(out: RequestOutput) -> list | None:
    """The logprobs of `out.new_token_ids` (engine outputs carry the whole list so far)."""
    if out.logprobs is None:
        return None
    n = len(out.new_token_ids)
    return list(out.logprobs[len(out.logprobs) - n:]) if n else []
