"""`PrefillWorker`: an EngineCore with a sending KV connector. It runs each request to its first
token; the engine's connector sends the prompt's KV to the decode side layer by layer. With
`tensor_parallel_size=N` (an engine keyword) every rank sends its own KV heads to the decode
ranks that hold them (a task carries one descriptor per decode rank; kv_transfer/tp_connector.py).

A request's way through the worker:

    submit(task) [-> with a remote prefix: fetch its leading pages from a peer first, or compute
    them if the fetch fails] -> the engine's waiting queue -> chunks under the step's token budget (prefix
    cache hits skipped) -> the last chunk is scheduled: the connector starts the send -> that
    step's forward sends each layer as its K/V is written -> first token sampled: the final
    notice follows the KV, and the PrefillResult is reported at once (TTFT) -> the request's
    pages stay held until the send ends (DONE or FAILED) -> freed (full pages stay in the
    prefix cache).

Prefix fetch, either side (engine/prefix_fetch.py; the router drives it, issue 37):
    requester: fetch = submit(PrefillTask(..., remote_prefix=RemotePrefix(k)))  (None: nothing to fetch)
    holder:    export_prefix(fetch, prompt_token_ids) -> PrefixExport (pinned and sending, at once)
    requester: abandon_fetch(request_id) when the holder sends nothing or cannot be reached
The connector sends and receives for that (at tensor_parallel_size 1; a tensor-parallel worker
neither fetches nor exports yet).

Threading: single-threaded; call every method from one thread (engine/loop.py runs it).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from engine.core import EngineCore, resolve_model
from engine.kv_events import KVEventBatch
from engine.load import WorkerLoad
from engine.outputs import PrefixExport, PrefixFetch, RequestOutput
from kv_transfer import prefix
from kv_transfer.config import TransferConfig
from kv_transfer.tp_connector import make_connector
from kv_transfer.descriptor import DestinationDescriptor
from prefill_worker.types import PrefillResult, PrefillTask


class PrefillWorker:
    CALLS = ("submit", "cancel", "kv_events", "export_prefix", "abandon_fetch")  # what a remote caller may run (engine/async_worker.py)

    def __init__(self, model: str | Path, *, transport: str = "nixl", transfer_config: TransferConfig | None = None,
                 model_id: str | None = None, transport_kwargs: dict | None = None, **engine_kwargs) -> None:
        engine_kwargs.setdefault("detokenize", False)
        tp = engine_kwargs.get("tensor_parallel_size", 1)
        self.connector = make_connector(transport, transfer_config, model_id=model_id or resolve_model(model).name,
                                        send=True, receive=tp == 1, transport_kwargs=transport_kwargs,
                                        tensor_parallel_size=tp)
        self.core = EngineCore(model, kv_connector=self.connector, **engine_kwargs)
        self._init_state()

    @classmethod
    def over(cls, core: EngineCore, *, transport: str = "nixl", transfer_config: TransferConfig | None = None,
             transport_kwargs: dict | None = None, max_num_batched_tokens: int | None = None,
             max_num_seqs: int | None = None) -> PrefillWorker:
        """A prefill worker over an idle engine that had another role (a role switch: the
        weights, the KV cache and its cached prefixes stay; EngineCore.set_kv_connector)."""
        self = cls.__new__(cls)
        self.connector = make_connector(transport, transfer_config, model_id=core.model_dir.name, send=True,
                                        receive=True, transport_kwargs=transport_kwargs)
        core.set_kv_connector(self.connector, max_num_batched_tokens=max_num_batched_tokens,
                              max_num_seqs=max_num_seqs, detokenize=False)
        self.core = core
        self._init_state()
        return self

    def _init_state(self) -> None:
        self.num_prefilled = 0
        self._stops: dict[str, list[str]] = {}  # each request's stop strings: the first token's text honours them

    # ---- intake ---------------------------------------------------------------------------
    def submit(self, task: PrefillTask) -> PrefixFetch | None:
        """Queue a prefill. Raises ValueError (nothing queued) if the request is invalid. With
        `task.remote_prefix`, answers where the holder sends the prefix (None: nothing to fetch,
        the whole prompt is computed or found here)."""
        if not task.destinations:
            raise ValueError("PrefillTask.destinations must hold at least one descriptor")
        dests = [d if isinstance(d, DestinationDescriptor) else DestinationDescriptor.from_bytes(d)
                 for d in task.destinations]
        first_token_only = dataclasses.replace(task.params, max_tokens=1, stop=[])
        req = self.core.make_request(task.prompt_token_ids, first_token_only, task.request_id, dests)
        fetch = None
        if task.remote_prefix is None:
            self.core.add(req)
        else:
            fetch = prefix.fetch_of(task.request_id, self.core.add_fetching(req, task.remote_prefix.num_pages))
        self._stops[task.request_id] = list(task.params.stop)
        return fetch

    def export_prefix(self, fetch: PrefixFetch, prompt_token_ids: list[int]) -> PrefixExport:
        """Send a peer the cached pages it asked for (its PrefixFetch): pinned and sending when
        this returns, or fewer (possibly none) when the prefix cache no longer holds them."""
        return prefix.export(self.core, fetch, prompt_token_ids)

    def abandon_fetch(self, request_id: str) -> bool:
        """Compute a fetching request's whole prompt instead (its holder sends nothing)."""
        return self.core.abandon_fetch(request_id)

    def cancel(self, request_id: str) -> bool:
        """Stop a prefill at any stage: dequeue it, or fail its transfer (pages come back when
        the transfer lets go of them). False if the worker does not know the request."""
        return self.core.abort(request_id)

    # ---- the step -------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.core.has_work

    @property
    def has_requests(self) -> bool:
        return self.core.has_requests

    @property
    def num_transferring(self) -> int:
        """Requests whose pages are still pinned by their send."""
        return self.connector.num_sending

    def step(self) -> list[PrefillResult]:
        """One engine step; returns the requests that ended in it (first token sampled, failed
        or cancelled)."""
        return [self._result(out) for out in self.core.step() if out.finished]

    def _result(self, out: RequestOutput) -> PrefillResult:
        ok = out.finish_reason in ("stop", "length")
        if ok:
            self.num_prefilled += 1
        error = None if ok else ("cancelled" if out.finish_reason == "abort" else out.error or "prefill failed")
        first = out.token_ids[0] if out.token_ids else None
        stops = self._stops.pop(out.request_id, [])
        return PrefillResult(out.request_id, first, len(out.prompt_token_ids),
                             out.num_cached_tokens, ttft_s=out.metrics.ttft if out.metrics else None, ok=ok,
                             error=error, first_logprobs=out.logprobs[0] if out.logprobs else None,
                             first_text=self._first_text(out.prompt_token_ids, first, stops) if ok else "",
                             fetch_s=out.metrics.fetch_s if out.metrics else None)

    def _first_text(self, prompt: list[int], token: int | None, stop: list[str]) -> str:
        """The text the decode side's detokenizer emits for the first token (the same
        incremental detokenizer, prompt and stop strings: nothing held back differs), so the
        router can send it with the token."""
        if token is None or self.core.tokenizer is None:
            return ""
        from engine.detokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self.core.tokenizer, prompt, stop=stop).add_token(token)

    def load(self) -> WorkerLoad:
        return self.core.load()

    def kv_events(self, epoch: str, since: int) -> KVEventBatch:
        """The prefix cache's events after `since` of `epoch`, or a snapshot (EngineCore.kv_events)."""
        return self.core.kv_events(epoch, since)

    def close(self) -> None:
        self.core.close()
