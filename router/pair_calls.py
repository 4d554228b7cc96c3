"""Calls on one request's workers that need nothing of the dispatcher's state: the admission
that follows a QUEUED_FOR_PAGES one, a warm-up request through a (prefill, decode) pair, and
the cancel of a request on both of its workers. The dispatcher (router/dispatch.py) places and
watches; these only talk to the handles it gives them.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from decode_worker.types import Admission, DecodeStage
from engine.sampling_params import SamplingParams
from prefill_worker.types import PrefillTask
from router.frontend import RequestError
from router.handles import WorkerHandle

WARM_UP_PROMPT = [1, 2, 3, 4]  # shorter than a page: it leaves nothing in any prefix cache

log = logging.getLogger("router.dispatch")


async def admitted(decode: WorkerHandle, rid: str) -> Admission:
    """The admission with pages of a request that was QUEUED_FOR_PAGES."""
    out = await decode.next_output(rid)
    if not isinstance(out, Admission):
        raise RequestError(f"request ended on decode worker {decode.worker_id} while queued for pages: "
                           f"{out.finish_reason}: {out.error or 'no detail'}", grpc.StatusCode.UNAVAILABLE)
    return out


async def warm_pair(prefill: WorkerHandle | None, decode: WorkerHandle, rid: str, prompt: list[int],
                    params: SamplingParams) -> None:
    """One request through `prefill` -> `decode` (or through `decode` alone when it prefills
    locally), to its finished output; raises RuntimeError when it fails."""
    adm = await decode.admit(rid, prompt, params)
    if adm.stage == DecodeStage.QUEUED_FOR_PAGES:
        adm = await admitted(decode, rid)
    if adm.stage != DecodeStage.LOCAL_PREFILL:
        result = await prefill.submit(PrefillTask(rid, list(prompt), params, list(adm.descriptors)))
        if not result.ok:
            raise RuntimeError(result.error or "prefill failed")
    async for out in decode.stream(rid):
        if out.finished:
            if out.finish_reason in ("error", "abort"):
                raise RuntimeError(f"decode ended with {out.finish_reason}: {out.error or 'no detail'}")
            return


async def cancel_pair(decode: WorkerHandle | None, prefill: WorkerHandle | None, rid: str) -> bool:
    """Cancel `rid` on both workers at once (a prefill worker deep in a long step must not
    hold the decode worker's pages: the decode side never frees a page a write is still
    landing in); whether the decode worker answered (False: it is gone)."""
    async def one(handle: WorkerHandle) -> bool:
        try:
            await asyncio.wait_for(handle.cancel(rid), 10)
            return True
        except Exception as exc:
            log.warning("cancel of %s on %s failed: %s", rid, handle.worker_id, first_line(exc))
            return False

    if not rid:
        return True
    handles = [h for h in (prefill, decode) if h is not None]
    results = await asyncio.gather(*(one(h) for h in handles))
    return all(ok for h, ok in zip(handles, results) if h is decode)


def first_line(exc: BaseException) -> str:
    """An error's first line: a Ray error carries a whole remote traceback."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
