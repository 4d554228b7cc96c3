"""What crosses the decode worker's boundary: its settings, the admission it answers with
(the destination descriptor for the prefill side), per-step token outputs, and its load
report. Plain dataclasses; the request stage enum lives with the module that drives it
(worker.py)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decode_worker.worker import DecodeStage
    from engine.heap import GcPauseStats
    from engine.sampler import TokenLogprobs
    from kv_transfer.descriptor import DestinationDescriptor


class TransferFailurePolicy(enum.Enum):
    FAIL = "fail"            # end the request with finish_reason "error"
    REPREFILL = "reprefill"  # prefill it here instead (plain engine path)


class TokenSource(enum.Enum):
    PREFILL_WORKER = "prefill"  # the first token, carried by the transfer's final notice
    DECODE_WORKER = "decode"    # sampled here


@dataclass(slots=True, frozen=True)
class DecodeConfig:
    """local_prefill_threshold: a prompt whose uncached part has fewer tokens than this is
    prefilled here, skipping the transfer (0 = always disaggregate).
    reserve_pages: admission keeps this many pages free for the running batch to grow into.
    on_transfer_failure: what a FAILED transfer (deadline, prefill death, refusal) does.
    tokens_per_s_window_s: the window of the load report's decode rate."""

    local_prefill_threshold: int = 0
    reserve_pages: int = 0
    on_transfer_failure: TransferFailurePolicy = TransferFailurePolicy.FAIL
    tokens_per_s_window_s: float = 5.0

    def __post_init__(self) -> None:
        if self.local_prefill_threshold < 0:
            raise ValueError(f"local_prefill_threshold must be >= 0, got {self.local_prefill_threshold}")
        if self.reserve_pages < 0:
            raise ValueError(f"reserve_pages must be >= 0, got {self.reserve_pages}")
        if not isinstance(self.on_transfer_failure, TransferFailurePolicy):
            raise ValueError(f"on_transfer_failure must be one of {[p.value for p in TransferFailurePolicy]}, "
                             f"got {self.on_transfer_failure!r}")
        if self.tokens_per_s_window_s <= 0:
            raise ValueError(f"tokens_per_s_window_s must be > 0, got {self.tokens_per_s_window_s}")


@dataclass(slots=True)
class Admission:
    """The decode worker's answer to a new request. With `descriptor` set, send it (as
    `descriptor.to_bytes()`) with the prefill task; QUEUED_FOR_PAGES gets its descriptor in a
    later step's admissions; LOCAL_PREFILL needs no prefill worker at all."""

    request_id: str
    stage: DecodeStage
    descriptor: DestinationDescriptor | None = None
    num_pages: int = 0


@dataclass(slots=True)
class DecodeOutput:
    """New tokens of one request since its previous output (`source` says who sampled them)."""

    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]
    source: TokenSource
    stage: DecodeStage
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    new_text: str = ""
    error: str | None = None
    # One per new token when params.logprobs is set, else None. The first token's entry is None
    # when it came from the prefill worker (its logprobs are in the PrefillResult).
    new_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served, when the prompt was prefilled here


@dataclass(slots=True)
class StepResult:
    outputs: list[DecodeOutput] = field(default_factory=list)
    admissions: list[Admission] = field(default_factory=list)  # queued requests that got pages


@dataclass(slots=True)
class DecodeLoad:
    running_requests: int
    waiting_requests: int       # queued for pages + waiting for KV + engine-waiting (local/preempted)
    queued_for_pages: int
    waiting_for_kv: int
    free_pages: int
    total_pages: int
    tokens_per_s: float
    num_preemptions: int = 0
    num_local_prefills: int = 0
    num_reprefills: int = 0
    gc: GcPauseStats | None = None  # the worker process's garbage collections (its actor sets it)
