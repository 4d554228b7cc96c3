"""`AsyncWorker.retire`, what a router that came back asks of every worker, on a real colocated
tiny-llama worker in this process: the requests of the router's earlier incarnation are
cancelled (their pages free), their channel's output stream ends, a late call on it is
refused; another router's requests and the new incarnation's are untouched."""
from __future__ import annotations

import asyncio

import pytest

from decode_worker import DecodeWorker
from engine.async_worker import AsyncWorker
from engine.sampling_params import SamplingParams
from router.handles import InProcess, WorkerHandle
from tests.conftest import register_engine
from tests.helpers import ENGINE

LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)


def test_retire_cancels_only_the_old_incarnation(tiny_model):
    worker = DecodeWorker(tiny_model("llama"), transport=None, page_size=16, num_pages=64, **ENGINE)
    register_engine(worker.core)
    host = AsyncWorker(worker, "colocated-0")

    def handle(prefix: str) -> WorkerHandle:
        return WorkerHandle(InProcess(host), "colocated-0", "colocated", "colocated", prefix)

    async def scenario():
        old, other = handle("router-0/aaaa"), handle("router-1/cccc")
        assert old.channel == "router-0/aaaa-colocated-0"
        for h, rid in ((old, "r-old-1"), (old, "r-old-2"), (other, "r-other")):
            await h.admit(rid, list(range(3, 40)), LONG)
            await h.next_output(rid)  # a first token: running, pages held
        held = (await host.load()).free_pages
        assert (await host.load()).running_requests == 3
        assert await host.retire("router-0", "bbbb") == 2
        assert (await host.load()).running_requests == 1  # cancelled at once, not run to their end
        with pytest.raises(RuntimeError, match="output stream ended"):  # the old channel's stream ends
            while True:
                await old.next_output("r-old-1")
        with pytest.raises(RuntimeError, match="retired"):
            await old.admit("r-old-3", list(range(3, 10)), LONG)
        new = handle("router-0/bbbb")
        await new.admit("r-new", list(range(3, 20)), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        got = [out async for out in new.stream("r-new")]
        assert got[-1].finished and sum(len(o.new_token_ids) for o in got) == 5
        done = [out async for out in other.stream("r-other")]  # router-1's request runs to its end
        assert done[-1].finished and done[-1].finish_reason == "length"
        assert sum(len(o.new_token_ids) for o in done) == 199
        load = await host.load()
        assert load.free_pages == load.total_pages > held, load
        for h in (old, other, new):
            await h.close()

    try:
        asyncio.run(scenario())
    finally:
        host.close()
