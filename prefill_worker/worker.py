"""`PrefillWorker`: an EngineCore with a sending KV connector. It runs each request to its first
token; the engine's connector sends the prompt's KV to the decode side layer by layer. With
`tensor_parallel_size=N` (an engine keyword) every rank sends its own KV heads to the decode
ranks that hold them (a task carries one descriptor per decode rank; kv_transfer/tp_connector.py).

A request's way through the worker:

    submit(task) -> the engine's waiting queue -> chunks under the step's token budget (prefix
    cache hits skipped) -> the last chunk is scheduled: the connector starts the send -> that
    step's forward sends each layer as its K/V is written -> first token sampled: the final
    notice follows the KV, and the PrefillResult is reported at once (TTFT) -> the request's
    pages stay held until the send ends (DONE or FAILED) -> freed (full pages stay in the
    prefix cache).

Threading: single-threaded; call every method from one thread (engine/loop.py runs it).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from engine.core import EngineCore, resolve_model
from engine.kv_events import KVEventBatch
from engine.load import WorkerLoad
from engine.outputs import RequestOutput
from kv_transfer.config import TransferConfig
from kv_transfer.tp_connector import make_connector
from kv_transfer.descriptor import DestinationDescriptor
from prefill_worker.types import PrefillResult, PrefillTask


class PrefillWorker:
    CALLS = ("submit", "cancel", "kv_events")  # what a remote caller may run (engine/async_worker.py)

    def __init__(self, model: str | Path, *, transport: str = "nixl", transfer_config: TransferConfig | None = None,
                 model_id: str | None = None, transport_kwargs: dict | None = None, **engine_kwargs) -> None:
        engine_kwargs.setdefault("detokenize", False)
        self.connector = make_connector(transport, transfer_config, model_id=model_id or resolve_model(model).name,
                                        send=True, transport_kwargs=transport_kwargs,
                                        tensor_parallel_size=engine_kwargs.get("tensor_parallel_size", 1))
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
                                        transport_kwargs=transport_kwargs)
        core.set_kv_connector(self.connector, max_num_batched_tokens=max_num_batched_tokens,
                              max_num_seqs=max_num_seqs, detokenize=False)
        self.core = core
        self._init_state()
        return self

    def _init_state(self) -> None:
        self.num_prefilled = 0
        self._stops: dict[str, list[str]] = {}  # each request's stop strings: the first token's text honours them

    # ---- intake ---------------------------------------------------------------------------
    def submit(self, task: PrefillTask) -> None:
        """Queue a prefill. Raises ValueError (nothing queued) if the request is invalid."""
        if not task.destinations:
            raise ValueError("PrefillTask.destinations must hold at least one descriptor")
        dests = [d if isinstance(d, DestinationDescriptor) else DestinationDescriptor.from_bytes(d)
                 for d in task.destinations]
        first_token_only = dataclasses.replace(task.params, max_tokens=1, stop=[])
        self.core.add(self.core.make_request(task.prompt_token_ids, first_token_only, task.request_id, dests))
        self._stops[task.request_id] = list(task.params.stop)

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
                             first_text=self._first_text(out.prompt_token_ids, first, stops) if ok else "")

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
