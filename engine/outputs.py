"""What the engine hands back for a request: the whole result, plus the delta since the last
step for streaming. No torch here: these cross into the router's process."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float  # log-softmax of the raw logits, before temperature and filters
    rank: int  # 1-based rank of the chosen token among the raw logits
    top: list[tuple[int, float]]  # top-n (id, logprob) by raw logprob, n = params.logprobs


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every generated id so far
    text: str  # every emitted character so far (stop strings excluded)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    new_token_ids: list[int] = field(default_factory=list)  # since the previous output
    new_text: str = ""
    logprobs: list | None = None  # engine.sampler.TokenLogprobs per generated token, when asked
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    error: str | None = None  # why, when finish_reason is "error"
