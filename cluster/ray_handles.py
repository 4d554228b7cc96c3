"""Worker handles over Ray actor handles (`cluster.actors`): the router's side of a worker
in another process. A dead actor surfaces as an exception from the call, which the
dispatcher treats as a worker failure (retry before the first token, UNAVAILABLE after)."""
from __future__ import annotations

from collections.abc import AsyncIterator


class RayPrefillHandle:
    def __init__(self, actor, worker_id: str, pool: str) -> None:
        self.actor, self.worker_id, self.pool = actor, worker_id, pool

    async def submit(self, task):
        return await self.actor.submit.remote(task)

    async def cancel(self, request_id: str) -> bool:
        return await self.actor.cancel.remote(request_id)

    async def load(self):
        return await self.actor.load.remote()


class RayDecodeHandle:
    def __init__(self, actor, worker_id: str, pool: str, role: str = "decode") -> None:
        self.actor, self.worker_id, self.pool, self.role = actor, worker_id, pool, role

    async def admit(self, request_id, prompt_token_ids, params):
        return await self.actor.admit.remote(request_id, prompt_token_ids, params)

    async def wait_admitted(self, request_id):
        return await self.actor.wait_admitted.remote(request_id)

    async def stream(self, request_id) -> AsyncIterator:
        async for ref in self.actor.stream.options(num_returns="streaming").remote(request_id):
            yield await ref

    async def cancel(self, request_id: str) -> bool:
        return await self.actor.cancel.remote(request_id)

    async def load(self):
        return await self.actor.load.remote()
