"""The socket transport of CPU tensor parallelism (engine/parallel.py's SocketReducer), its ranks
as threads of one process over real TCP connections on 127.0.0.1 and a real TCPStore: the sum
is the leader's rank-order sum on every rank, gathers arrive in rank order, and a lost or
out-of-step peer raises instead of hanging."""
from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from engine.parallel import SocketReducer, TPGroupError


def _group(world: int, timeout_s: float = 5.0) -> list[SocketReducer]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    out: list[SocketReducer | None] = [None] * world

    def make(rank: int) -> None:
        s = store if rank == 0 else dist.TCPStore("127.0.0.1", store.port, is_master=False)
        out[rank] = SocketReducer(s, rank, world, "127.0.0.1", timeout_s)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert all(r is not None for r in out)
    return out  # type: ignore[return-value]


def _run(fns) -> list:
    results, errors = [None] * len(fns), []

    def call(i):
        try:
            results[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_reduce_is_the_rank_order_sum_on_every_rank(world, dtype):
    ranks = _group(world)
    g = torch.Generator().manual_seed(world)
    parts = [torch.randn(37, 129, generator=g).to(dtype) for _ in range(world)]
    expected = parts[0].clone()
    for p in parts[1:]:
        expected += p
    got = [p.clone() for p in parts]
    for _ in range(3):  # the connections carry many messages in turn
        got = [p.clone() for p in parts]
        _run([lambda r=r: ranks[r].all_reduce(got[r]) for r in range(world)])
        for r in range(world):
            assert torch.equal(got[r], expected), f"rank {r}"
    for r in ranks:
        r.shutdown()


def test_gather_puts_every_rank_in_order_on_the_leader():
    ranks = _group(3)
    local = [torch.full((2, 5), float(r)) for r in range(3)]
    parts = [torch.empty(2, 5) for _ in range(3)]
    _run([lambda: ranks[0].gather(local[0], parts)] + [lambda r=r: ranks[r].gather(local[r], []) for r in (1, 2)])
    assert [float(p.mean()) for p in parts] == [0.0, 1.0, 2.0]
    for r in ranks:
        r.shutdown()


def test_a_closed_or_out_of_step_peer_raises():
    ranks = _group(2, timeout_s=2.0)
    with pytest.raises(TPGroupError, match="out of step"):
        _run([lambda: ranks[0].all_reduce(torch.zeros(4)), lambda: ranks[1].all_reduce(torch.zeros(5))])
    for r in ranks:
        r.shutdown()
    ranks = _group(2, timeout_s=2.0)
    ranks[1].shutdown()  # a follower gone: its connection is closed
    with pytest.raises(ConnectionError):
        ranks[0].all_reduce(torch.zeros(4))
    ranks[0].shutdown()
    ranks = _group(2, timeout_s=0.5)
    with pytest.raises(TimeoutError):  # the follower never sends: the leader gives up after timeout_s
        ranks[0].all_reduce(torch.zeros(4))
    for r in ranks:
        r.shutdown()


def test_large_messages_arrive_whole():
    # 8 MiB per rank: more than a socket buffer, so sends and receives come in pieces
    ranks = _group(3)
    parts = [torch.full((2048, 1024), float(r + 1)) for r in range(3)]
    got = [p.clone() for p in parts]
    _run([lambda r=r: ranks[r].all_reduce(got[r]) for r in range(3)])
    assert all(torch.equal(g, torch.full((2048, 1024), 6.0)) for g in got)
    for r in ranks:
        r.shutdown()
