"""Heterogeneous tensor-parallel transfer over the real transports (nixl, grpc): a sender group of
P ranks and a receiver group of D ranks, one sender or receiver (its own NIXL agent / gRPC
service on 127.0.0.1) per rank, each rank's pool holding its TPShard heads of a model with K=2
kv heads (so a 4-rank side replicates every head), different page sizes on the two sides. The
senders' pools are filled from one "full" model KV, every sender sends to the receiver ranks
kv_transfer/reshard.py's plan assigns it, and every receiver rank's pages must then hold exactly
its heads of that full KV. A misrouted or inconsistent rank is refused at the handshake, the
refusal naming both sides, before any byte moves."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_transfer.config import TransferConfig
from kv_transfer.layout import KVLayout, KVPool, ModelSpec
from kv_transfer.registry import create_receiver, create_sender
from kv_transfer.reshard import group_layouts, plan_transfer
from tests.integration.kv_peer import request_tokens

K, LAYERS, HEAD_DIM = 2, 3, 8
SPEC = ModelSpec("tiny-kv-tp", num_layers=LAYERS, num_kv_heads=K, head_dim=HEAD_DIM)
TOKENS = 45  # not a multiple of either page size: the last pages are partial
SENDER_PAGE, RECEIVER_PAGE = 16, 8
NUM_PAGES = 12


def layouts(tp: int, page_size: int) -> list[KVLayout]:
    return group_layouts(K, tp, num_layers=LAYERS, page_size=page_size, head_dim=HEAD_DIM, dtype="float32")


def full_kv(seed: int) -> torch.Tensor:
    """The model's whole KV for the request: [layers, 2 (K, V), tokens, K heads, head_dim]."""
    return torch.randn(LAYERS, 2, TOKENS, K, HEAD_DIM, generator=torch.Generator().manual_seed(seed))


def page_ids(layout: KVLayout, seed: int) -> list[int]:
    return np.random.default_rng(seed).permutation(NUM_PAGES)[:layout.pages_for(TOKENS)].tolist()


def write_heads(pool: KVPool, pages: list[int], full: torch.Tensor) -> None:
    """Token t of the request -> page pages[t // page_size], slot t % page_size; this rank's heads only."""
    lay = pool.layout
    for t in range(TOKENS):
        for layer in range(LAYERS):
            pool.layers[layer][pages[t // lay.page_size], :, t % lay.page_size] = \
                full[layer, :, t, lay.head_start:lay.head_end]


class Group:
    """One side's ranks: a pool and a transport endpoint each."""

    def __init__(self, kind: str, transport: str, tp: int, page_size: int) -> None:
        self.layouts = layouts(tp, page_size)
        self.pools = [KVPool.allocate(SPEC, lay, NUM_PAGES) for lay in self.layouts]
        make = create_receiver if kind == "receiver" else create_sender
        self.objs = []
        try:
            for pool in self.pools:
                self.objs.append(make(transport, pool, TransferConfig(deadline_s=20.0)))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for obj in self.objs:
            obj.close()


@pytest.fixture(params=["nixl", "grpc"])
def transport(request):
    return request.param


@pytest.mark.parametrize("p,d", [(1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (4, 2)])
def test_each_receiver_rank_gets_exactly_its_heads(transport, p, d):
    full = full_kv(seed=10 * p + d)
    senders = Group("sender", transport, p, SENDER_PAGE)
    try:
        receivers = Group("receiver", transport, d, RECEIVER_PAGE)
    except BaseException:
        senders.close()
        raise
    rid = f"req-tp{p}-to-tp{d}"
    try:
        plan = plan_transfer(senders.layouts, receivers.layouts)
        src_pages = [page_ids(lay, 100 + i) for i, lay in enumerate(senders.layouts)]
        dst_pages = [page_ids(lay, 200 + j) for j, lay in enumerate(receivers.layouts)]
        for i, pool in enumerate(senders.pools):
            write_heads(pool, src_pages[i], full)
        descs = [recv.expect(rid, dst_pages[j], TOKENS) for j, recv in enumerate(receivers.objs)]
        assert [(dsc.layout.tp_size, dsc.layout.tp_rank) for dsc in descs] == [(d, j) for j in range(d)]
        active = [i for i in range(p) if plan.receivers_of(i)]
        if p > K:  # a replicating sender group: receivers spread over the replicas, no rank sends twice a head
            assert len(active) == min(p, max(d, K))
        for i in active:
            dests = [descs[j] for j in plan.receivers_of(i)]
            status = senders.objs[i].start(rid, dests, src_pages[i], TOKENS)
            assert status.state.name == "WAITING", status.error
        for layer in range(LAYERS):
            for i in active:
                senders.objs[i].send_layer(rid, layer)
        for i in active:
            senders.objs[i].finish(rid, 17, TOKENS)
        for j, recv in enumerate(receivers.objs):
            status = recv.wait(rid, 20)
            assert status.state.name == "DONE", (j, status.error)
            assert status.first_token == 17
            lay = receivers.layouts[j]
            got = request_tokens(receivers.pools[j], dst_pages[j], TOKENS)  # [layers, 2, tokens, heads, D]
            assert torch.equal(got, full[:, :, :, lay.head_start:lay.head_end]), f"receiver rank {j} ({lay})"
            others = sorted(set(range(NUM_PAGES)) - set(dst_pages[j]))
            assert all(int(t[others].count_nonzero()) == 0 for t in receivers.pools[j].layers), \
                f"receiver rank {j}: bytes outside the request's pages"
            recv.take(rid)
        for i in active:
            assert senders.objs[i].wait(rid, 20).state.name == "DONE"
        assert all(o.tracked_pages() == [] for o in senders.objs + receivers.objs)
    finally:
        receivers.close()
        senders.close()


def test_impossible_pairings_are_refused_naming_both_sides(transport):
    """A sender rank routed to a receiver rank it shares no head with (TP 2 rank 1 -> TP 2 rank 0),
    and a sender whose head range is not its TP rank's (head 0 alone claimed as TP 1, i.e. the
    whole model; it shares head 0 with the receiver, so only the topology check refuses it): both refused at the handshake, the transfer FAILED with both sides named, and
    nothing written."""
    receiver_layout = layouts(2, RECEIVER_PAGE)[0]
    recv_pool = KVPool.allocate(SPEC, receiver_layout, NUM_PAGES)
    recv = create_receiver(transport, recv_pool)
    partial = KVLayout(LAYERS, SENDER_PAGE, 0, 1, HEAD_DIM, "float32")  # tp 1 rank 0, yet only head 0
    cases = {
        "misrouted": (layouts(2, SENDER_PAGE)[1], "do not overlap"),
        "inconsistent": (partial, "sender layout inconsistent with its tensor-parallel topology: heads [0, 1) are "
                                  "not those of tp rank 0 of 1 over 2 kv heads, which holds [0, 2)"),
    }
    try:
        for case, (sender_layout, why) in cases.items():
            rid = f"req-{case}"
            src_pool = KVPool.allocate(SPEC, sender_layout, NUM_PAGES)
            write_heads(src_pool, list(range(sender_layout.pages_for(TOKENS))), full_kv(seed=3))
            sender = create_sender(transport, src_pool)
            try:
                desc = recv.expect(rid, page_ids(receiver_layout, 5), TOKENS)
                status = sender.start(rid, [desc], list(range(sender_layout.pages_for(TOKENS))), TOKENS)
                assert status.state.name == "FAILED", case
                assert f"sender {sender_layout.describe()} / receiver {receiver_layout.describe()}: " in status.error
                assert why in status.error, status.error
                assert "refused" in status.error
                assert recv.status(rid).state.name == "BOOTSTRAPPING"  # nothing began
                recv.cancel(rid)
                assert sender.tracked_pages() == []
            finally:
                sender.close()
        assert all(int(t.count_nonzero()) == 0 for t in recv_pool.layers)
        assert recv.tracked_pages() == []
    finally:
        recv.close()
