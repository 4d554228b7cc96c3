"""What the simulated router sees of a worker (`SimView`: the router's own `WorkerView` plus the
simulator's queues), its prefix index (`RouterView`), and the workload's requests as the
simulator's (`to_sim_requests`: shared prefix blocks as chained keys, the router's page keys)."""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain, repeat, starmap

from loadgen.workloads import Workload
from planning.sim_engine import EngineSim
from planning.sim_request import SimRequest
from router.policy import WorkerView


@dataclass(slots=True, eq=False)
class RouterView(WorkerView):
    """The router's `WorkerView` with `remember` done in bulk: the simulator remembers every
    shared page of every prompt (a Mooncake hour: 9 M page keys), and one dict operation per key
    in Python was a tenth of its time. The index ends in the same state, keys in the same LRU
    order, given keys without repeats (a request's page keys name distinct pages)."""

    def remember(self, hashes: Sequence[int], capacity: int) -> None:
        cached = self.cached
        deque(map(cached.pop, hashes, repeat(None)), maxlen=0)  # a known key moves to the end
        cached.update(zip(hashes, repeat(None)))
        over = len(cached) - capacity
        if over > 0:  # the least recently remembered go
            deque(starmap(cached.popitem, repeat((False,), over)), maxlen=0)


class SimLoad:
    """What a worker's load report tells the router's policy: its free pages, now."""
    __slots__ = ("worker",)
    queued_tokens = 0  # the router's own count (WorkerView.inflight_tokens) is what it goes by

    def __init__(self, worker: EngineSim) -> None:
        self.worker = worker

    @property
    def free_pages(self) -> int:
        return self.worker.free_pages


@dataclass(slots=True, eq=False)
class SimView:
    """One worker as the router sees it: the router's own `WorkerView` (what the placement
    policies of router/policy.py read and the router updates), plus the simulator's queues."""
    worker: EngineSim
    router: WorkerView
    local_threshold: int = 0
    reserve: int = 0
    page_queue: deque = field(default_factory=deque)
    admit_queue: deque = field(default_factory=deque)  # (ready time, request): admitted at a step boundary
    link_free: float = 0.0
    kick_pending: bool = False


def to_sim_requests(workload: Workload, page_size: int) -> list[SimRequest]:
    """Workload requests -> SimRequests; prefix block ids become chained keys (a block's key
    names it and every block before it, as the engine's page hashes do)."""
    chained: dict[tuple, int] = {}
    out = []
    for w in workload.requests:
        keys, prev = [], -1
        for b in w.prefix_blocks:
            prev = chained.setdefault((prev, b), len(chained))
            keys.append(prev)
        r = SimRequest(w.index, w.arrival_s, w.prompt_len, w.output_len, tuple(keys), workload.block_tokens,
                       scheduled=w.arrival_s)
        if keys:  # the router's page hashes of the shared part (the rest never matches anything)
            bt = workload.block_tokens
            n = len(keys) * bt // page_size
            if bt % page_size == 0:  # whole pages to a block: its key repeated
                per = bt // page_size
                r.page_keys = tuple(zip(chain.from_iterable(repeat(k, per) for k in keys), range(n)))
            else:
                r.page_keys = tuple((keys[((j + 1) * page_size - 1) // bt], j) for j in range(n))
        out.append(r)
    return out
