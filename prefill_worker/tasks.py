"""What crosses the prefill worker's boundary: the task it accepts, the first-token result
it reports (TTFT), and its load report. Plain dataclasses; descriptors stay protobuf-ready
(`DestinationDescriptor.to_bytes()/from_bytes()`) for whoever carries them."""
from __future__ import annotations

from dataclasses import dataclass

from engine.heap import GcPauseStats
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from kv_transfer.descriptor import DestinationDescriptor


@dataclass(slots=True)
class PrefillTask:
    """One request to prefill: its real sampling params (the worker runs it to the first
    token only) and where its KV goes (one descriptor per destination rank)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    destinations: list[DestinationDescriptor]

    @classmethod
    def from_wire(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  descriptors: list[bytes]) -> PrefillTask:
        return cls(request_id, list(prompt_token_ids), params,
                   [DestinationDescriptor.from_bytes(d) for d in descriptors])


@dataclass(slots=True)
class PrefillResult:
    """The first token, reported the step it is sampled (before the transfer completes).
    `ok` is False when the request could not be prefilled or its transfer failed to start;
    `error` says why. `first_logprobs` is set when the task's params ask for logprobs."""

    request_id: str
    first_token: int | None
    prompt_len: int
    num_cached_tokens: int = 0
    ttft_s: float | None = None
    ok: bool = True
    error: str | None = None
    first_logprobs: TokenLogprobs | None = None


@dataclass(slots=True)
class PrefillLoad:
    """What a router weighs when placing a prefill: queued and running uncomputed tokens,
    free pages (held-for-transfer pages are not free), prefix-cache hit rate."""

    queued_requests: int
    queued_tokens: int
    running_requests: int
    running_tokens: int
    transferring_requests: int
    free_pages: int
    total_pages: int
    prefix_cache_hit_rate: float
    prefix_cache_queries: int = 0
    gc: GcPauseStats | None = None  # the worker process's garbage collections (its actor sets it)
