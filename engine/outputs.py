"""What crosses the engine's boundary for a request: the result it hands back (the whole of it,
plus the delta since the last step for streaming), and where a resumed request continues. No
torch here: these cross into the router's process."""
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
    fetch_s: float | None = None  # a prefix fetch: its pages' wait, from the plan to their arrival

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


@dataclass(slots=True, frozen=True)
class Resume:
    """Where a stream continues (another worker generated its first tokens, then was lost): the
    output token ids the client already has, and how many characters of their text it has."""
    output_token_ids: tuple[int, ...]
    text_chars_sent: int = 0

    def __post_init__(self) -> None:
        if not self.output_token_ids:
            raise ValueError("Resume.output_token_ids must hold at least one token")
        if self.text_chars_sent < 0:
            raise ValueError(f"Resume.text_chars_sent must be >= 0, got {self.text_chars_sent}")


@dataclass(slots=True, frozen=True)
class RemotePrefix:
    """A request's first `num_pages` pages are in another worker's prefix cache: fetch them
    instead of computing them (the router's choice, from its KV index)."""
    num_pages: int

    def __post_init__(self) -> None:
        if isinstance(self.num_pages, bool) or not isinstance(self.num_pages, int) or self.num_pages < 1:
            raise ValueError(f"RemotePrefix.num_pages must be an integer >= 1, got {self.num_pages!r}")


@dataclass(slots=True)
class PrefixFetch:
    """The requester's half of a prefix fetch, for the holder's `export_prefix`: the KV of
    prompt tokens [start_token, start_token + num_tokens) goes into `descriptors` (each a
    `DestinationDescriptor.to_bytes()`; the tokens before start_token the requester had cached)."""
    request_id: str
    start_token: int
    num_tokens: int
    descriptors: list[bytes]


@dataclass(slots=True)
class PrefixExport:
    """The holder's answer to `export_prefix`, given at once: it pinned and is sending
    `num_tokens` of the `requested_tokens` (whole pages from the first; fewer when its cache no
    longer holds them all, 0 when it sends nothing; `error` says why when it could not send)."""
    request_id: str
    num_tokens: int
    requested_tokens: int
    error: str | None = None

    @property
    def sending(self) -> bool:
        return self.num_tokens > 0
