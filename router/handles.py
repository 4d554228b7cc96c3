"""What the router needs of a worker, whatever hosts it: the in-process async fronts
(`cluster.worker_handles`) or Ray actors (`cluster.ray_handles`). The router sees only these
protocols and the workers' boundary dataclasses (PrefillTask/Result/Load, Admission,
DecodeOutput/Load), never a worker object.

Decode request stages seen through a handle: admit -> (QUEUED_FOR_PAGES -> wait_admitted)
-> WAITING_FOR_KV (descriptor for the prefill side) or LOCAL_PREFILL -> stream() until an
output has finished=True. cancel() at any point ends it and frees its pages.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from decode_worker.types import Admission, DecodeLoad, DecodeOutput
from engine.sampling_params import SamplingParams
from prefill_worker.tasks import PrefillLoad, PrefillResult, PrefillTask


class PrefillHandle(Protocol):
    worker_id: str
    pool: str

    async def submit(self, task: PrefillTask) -> PrefillResult: ...
    async def cancel(self, request_id: str) -> bool: ...
    async def load(self) -> PrefillLoad: ...


class DecodeHandle(Protocol):
    worker_id: str
    pool: str
    role: str  # "decode" or "colocated"

    async def admit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Admission: ...
    async def wait_admitted(self, request_id: str) -> Admission: ...
    def stream(self, request_id: str) -> AsyncIterator[DecodeOutput]: ...
    async def cancel(self, request_id: str) -> bool: ...
    async def load(self) -> DecodeLoad: ...
