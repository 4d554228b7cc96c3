"""What crosses the prefill worker's boundary: the task it accepts and the first-token result it
reports (TTFT). Plain dataclasses with no torch, so the router's process can hold them; the
destinations travel as the decode side's descriptor bytes, which only the worker parses."""
from __future__ import annotations

from dataclasses import dataclass

from engine.outputs import RemotePrefix, TokenLogprobs
from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class PrefillTask:
    """One request to prefill: its real sampling params (the worker runs it to the first token
    only) and where its KV goes: one `DestinationDescriptor.to_bytes()` per destination rank.
    With `remote_prefix`, its leading pages are fetched from a peer's prefix cache (submit
    answers the PrefixFetch the router hands to that peer's `export_prefix`)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    destinations: list[bytes]
    remote_prefix: RemotePrefix | None = None


@dataclass(slots=True)
class PrefillResult:
    """The first token, reported the step it is sampled (before the transfer completes).
    `ok` is False when the request could not be prefilled, its transfer failed before the first
    token, or it was cancelled; `error` says why. `first_logprobs` is set when the task's params
    ask for logprobs. Always a request's last output."""

    request_id: str
    first_token: int | None
    prompt_len: int
    num_cached_tokens: int = 0
    ttft_s: float | None = None
    ok: bool = True
    error: str | None = None
    first_logprobs: TokenLogprobs | None = None
    first_text: str = ""  # what the decode side's detokenizer emits for the first token
    fetch_s: float | None = None  # a prefix fetch's wait for its pages (None: none, or it failed)

    @property
    def finished(self) -> bool:
        return True
