"""What crosses the decode worker's boundary: its settings, the stage of a request, the admission
it answers with (the destination descriptor for the prefill side), and per-step token outputs.
Plain dataclasses with no torch, so the router's process can hold them."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.outputs import PrefixFetch, TokenLogprobs


class DecodeStage(enum.IntEnum):
    """A request's stage on a decode (or colocated) worker; decode_worker/worker.py draws the
    transitions."""

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
    on_transfer_failure: what a FAILED transfer (deadline, prefill death, refusal) does."""

    local_prefill_threshold: int = 0
    reserve_pages: int = 0
    on_transfer_failure: TransferFailurePolicy = TransferFailurePolicy.FAIL

    def __post_init__(self) -> None:
        if self.local_prefill_threshold < 0:
            raise ValueError(f"local_prefill_threshold must be >= 0, got {self.local_prefill_threshold}")
        if self.reserve_pages < 0:
            raise ValueError(f"reserve_pages must be >= 0, got {self.reserve_pages}")
        if not isinstance(self.on_transfer_failure, TransferFailurePolicy):
            raise ValueError(f"on_transfer_failure must be one of {[p.value for p in TransferFailurePolicy]}, "
                             f"got {self.on_transfer_failure!r}")


@dataclass(slots=True)
class Admission:
    """The decode worker's answer to a new request. With `descriptors` set (each receiving rank's
    `DestinationDescriptor.to_bytes()`, in rank order: one at tensor_parallel_size 1), send them
    all with the prefill task; QUEUED_FOR_PAGES gets its descriptors in a later Admission, among
    the request's outputs; LOCAL_PREFILL needs no prefill worker at all (with `prefix_fetch`, an
    admission with a remote prefix: hand that to the holder's `export_prefix`). `num_pages` and
    `kv_bytes` (what the transfer will move: every destination page, K and V, every layer) are
    summed over the ranks."""

    request_id: str
    stage: DecodeStage
    descriptors: list[bytes] | None = None
    num_pages: int = 0
    kv_bytes: int = 0
    prefix_fetch: PrefixFetch | None = None

    @property
    def finished(self) -> bool:
        return False

    @property
    def descriptor(self) -> bytes | None:
        """The one descriptor of a single-rank decode worker (None if there is none)."""
        if not self.descriptors:
            return None
        if len(self.descriptors) != 1:
            raise ValueError(f"this admission has {len(self.descriptors)} descriptors (a tensor-parallel decode "
                             "worker): use Admission.descriptors")
        return self.descriptors[0]


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
