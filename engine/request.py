"""A request inside the engine and its lifecycle.

    WAITING --schedule--> RUNNING --(stop | length)--> FINISHED_STOPPED / FINISHED_LENGTH
       ^                   ^  |
       |                   |  +--> PREEMPTED (pages reclaimed; KV recomputed from all tokens later)
       |                   |          |
       +-------------------+----------+
       |                   |
       |   WAITING_FOR_REMOTE_KV --KV received (first token with it)--^
       |        |
       +--------+ KV failed, the worker's policy says recompute here
                | KV failed, the policy says fail --> FINISHED_ERROR
    any state --abort--> FINISHED_ABORTED;  a send that cannot start or finish --> FINISHED_ERROR

WAITING_FOR_REMOTE_KV: the request's pages are allocated and a KV connector fills them from
another worker; the scheduler never schedules it until the connector reports the KV complete
(the request then joins the batch with the first token sampled elsewhere) or failed.

A resumed request (`Request.resume`: its stream continues here after the worker that generated
its first tokens was lost) starts WAITING (or WAITING_FOR_REMOTE_KV) with those tokens already
in `all_token_ids`, exactly like a preempted request.

A request computes `all_token_ids` (prompt + generated) into KV, `num_computed_tokens` at a
time. It samples whenever its computed tokens reach the end of `all_token_ids`, which covers
the last prefill chunk, every decode step, and the recompute after a preemption (which
re-prefills prompt and output together and then continues sampling where it stopped).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from engine.outputs import RequestMetrics, RequestOutput, Resume
from engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KV = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                   RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # prompt + max_tokens, capped by the model's context
    eos_token_ids: tuple[int, ...] = ()
    seed: int = 0  # the key of its draws (engine.sampler.request_seed): token i is drawn from (seed, i)
    detokenizer: object | None = None  # engine.detokenizer.IncrementalDetokenizer, or None for ids only
    # Where the prompt's KV goes once computed (the KV connector's destinations, opaque to the
    # engine); empty for a request whose KV stays here.
    kv_destinations: tuple = ()
    status: RequestStatus = RequestStatus.WAITING
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    pages: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_cached_pages_registered: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first schedule; -1 until then
    num_preemptions: int = 0
    stop_reason: str | int | None = None
    error: str | None = None  # why it finished with FINISHED_ERROR
    logprobs: list | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.monotonic()))
    _emitted_tokens: int = 0
    _pending_text: str = ""
    num_prompt_tokens: int = field(init=False, default=0)  # the prompt never changes: kept, not counted

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    def append_token(self, token_id: int, logprobs=None) -> None:
        """Record a sampled token and decide whether the request is done."""
        tokens = self.all_token_ids
        tokens.append(token_id)
        if self.logprobs is not None:
            self.logprobs.append(logprobs)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = time.monotonic()
        if self.detokenizer is not None:
            self._pending_text += self.detokenizer.add_token(token_id)
            if self.detokenizer.stop_matched is not None:
                self._finish(RequestStatus.FINISHED_STOPPED, self.detokenizer.stop_matched)
                return
        p = self.params
        if not p.ignore_eos and token_id in self.eos_token_ids:
            self._finish(RequestStatus.FINISHED_STOPPED, None)
        elif p.stop_token_ids and token_id in p.stop_token_ids:
            self._finish(RequestStatus.FINISHED_STOPPED, token_id)
        elif len(tokens) - self.num_prompt_tokens >= p.max_tokens or len(tokens) >= self.max_total_tokens:
            self._finish(RequestStatus.FINISHED_LENGTH, None)

    def resume(self, resume: Resume) -> None:
        """Take the tokens another worker generated (before any step here): they are replayed
        through the stop checks and the detokenizer, which so reaches the state that worker's
        had, and are never reported again; the text the client lacks is reported with the next
        output. A request whose replay already finishes it (its last token was the end) ends
        here, with no new token."""
        for token_id in resume.output_token_ids:
            if self.status.finished:
                raise ValueError(f"Resume.output_token_ids go past the end of the request "
                                 f"({len(resume.output_token_ids)} tokens, max_tokens={self.params.max_tokens})")
            self.append_token(token_id, None)
        self._emitted_tokens = self.num_output_tokens
        self._pending_text = self._pending_text[resume.text_chars_sent:]
        self.metrics.first_token_time = None  # the first token sampled here is this worker's first

    def abort(self) -> None:
        self._finish(RequestStatus.FINISHED_ABORTED, None)

    def fail(self, error: str) -> None:
        self.error = error
        self._finish(RequestStatus.FINISHED_ERROR, None)

    def _finish(self, status: RequestStatus, stop_reason: str | int | None) -> None:
        self.status = status
        self.stop_reason = stop_reason
        self.metrics.finished_time = time.monotonic()
        if self.detokenizer is not None and status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self._pending_text += self.detokenizer.finish()

    def take_output(self) -> RequestOutput:
        """Snapshot for the caller; `new_*` fields hold what was not reported before."""
        new_ids = self.all_token_ids[self.num_prompt_tokens + self._emitted_tokens :]
        self._emitted_tokens += len(new_ids)
        new_text, self._pending_text = self._pending_text, ""
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=self.output_token_ids,
            text=self.detokenizer.text if self.detokenizer is not None else "",
            finished=self.status.finished,
            finish_reason=self.status.finish_reason,
            stop_reason=self.stop_reason,
            new_token_ids=new_ids,
            new_text=new_text,
            logprobs=self.logprobs,
            num_cached_tokens=max(self.num_cached_tokens, 0),
            metrics=self.metrics,
            error=self.error,
        )
