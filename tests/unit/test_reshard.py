"""The reshard plan between tensor-parallel groups of different sizes (kv_transfer/reshard.py),
proven for every pairing of TP sizes in {1, 2, 4, 8} and KV head counts in {1, 2, 4, 8}; and the
handshake's topology checks (kv_transfer/handshake.py): each side's TP size and rank travel in
its layout, and a pairing whose heads cannot line up is refused naming both sides."""
from __future__ import annotations

import math

import pytest
import torch

from engine.config import ModelConfig
from engine.parallel import TPShard
from kv_transfer.config import TransferConfig
from kv_transfer.handshake import answer, make_request
from kv_transfer.layout import KVLayout, KVPool, ModelSpec, tp_head_range
from kv_transfer.local import LocalHub, LocalReceiver, LocalSender
from kv_transfer.reshard import ReshardError, plan_transfer, group_layouts
from kv_transfer.states import TransferState

SIZES = [1, 2, 4, 8]
Q_HEADS = 16  # GQA: more q heads than kv heads for every K below, divisible by every TP size


def _cfg(kv_heads: int) -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 8 * Q_HEADS,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": Q_HEADS,
        "num_key_value_heads": kv_heads,
    })


def group(k: int, n: int, page_size: int = 16, head_dim: int = 8, num_layers: int = 2) -> list[KVLayout]:
    return group_layouts(k, n, num_layers=num_layers, page_size=page_size, head_dim=head_dim, dtype="float32")


def heads(lay: KVLayout) -> range:
    return range(lay.head_start, lay.head_end)


# ---- the layouts are engine/parallel.py's sharding --------------------------------------------
@pytest.mark.parametrize("k", SIZES)
@pytest.mark.parametrize("n", SIZES)
def test_group_layouts_are_the_engines_tp_shards(k, n):
    cfg = _cfg(k)
    for r, lay in enumerate(group(k, n)):
        shard = TPShard.of(cfg, r, n)
        assert heads(lay) == shard.kv_heads, (k, n, r)
        assert (lay.tp_size, lay.tp_rank) == (n, r)
        assert tp_head_range(k, n, r) == (shard.kv_head_start, shard.num_kv_heads)
        assert lay.topology_error(k) is None


# ---- the plan, for every pairing ----------------------------------------------------------------
@pytest.mark.parametrize("k", SIZES)
@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("p", SIZES)
def test_plan_sends_every_receiver_head_exactly_once(p, d, k):
    senders, receivers = group(k, p, page_size=16), group(k, d, page_size=64)
    plan = plan_transfer(senders, receivers)
    assert (plan.num_senders, plan.num_receivers) == (p, d)
    for r in plan.routes:
        snd, rcv = senders[r.sender], receivers[r.receiver]
        assert r.num_heads >= 1
        # the sender holds what it sends, and the route is its whole overlap with the receiver
        # (what the transports move; a partial overlap would make a head arrive twice)
        assert snd.head_start <= r.head_start and r.head_end <= snd.head_end, r
        assert (r.head_start, r.head_end) == (max(snd.head_start, rcv.head_start), min(snd.head_end, rcv.head_end))
    for j, rcv in enumerate(receivers):
        for h in range(k):
            senders_of_h = [r.sender for r in plan.routes if r.receiver == j and r.head_start <= h < r.head_end]
            assert len(senders_of_h) == (1 if h in heads(rcv) else 0), (j, h, senders_of_h)
        assert plan.senders_of(j) == sorted({r.sender for r in plan.routes if r.receiver == j})
    for i in range(p):
        assert plan.receivers_of(i) == [r.receiver for r in plan.routes if r.sender == i]
    assert plan.heads_moved() == sum(lay.num_heads for lay in receivers)
    # minimal: a route per overlapping rank pair when the senders do not replicate (each head has
    # one holder, so every such pair must move something); with replicated senders (one head per
    # sender rank), one route per receiver head
    overlapping = sum(1 for s in senders for r in receivers if max(s.head_start, r.head_start) < min(s.head_end,
                                                                                                      r.head_end))
    assert len(plan.routes) == (overlapping if p <= k else sum(lay.num_heads for lay in receivers))


@pytest.mark.parametrize("p,d,k", [(p, d, k) for p in SIZES for d in SIZES for k in SIZES if p > k])
def test_receivers_spread_over_a_replicated_heads_replicas(p, d, k):
    """The sender group replicates every head on p / k ranks."""
    senders, receivers = group(k, p), group(k, d)
    plan = plan_transfer(senders, receivers)
    for h in range(k):
        replicas = [i for i, s in enumerate(senders) if h in heads(s)]
        assert len(replicas) == p // k
        needing = sum(1 for r in receivers if h in heads(r))
        cap = math.ceil(needing / len(replicas))
        for i in replicas:
            sent = sum(1 for r in plan.routes if r.sender == i and r.head_start <= h < r.head_end)
            assert sent <= cap, f"replica {i} of head {h} sends {sent} times, {needing} receivers over " \
                                f"{len(replicas)} replicas"
        # as many replicas at work as there are receivers for them
        busy = {r.sender for r in plan.routes if r.head_start <= h < r.head_end}
        assert len(busy) == min(needing, len(replicas))


def test_plan_is_cached_per_pair_of_layouts():
    a = plan_transfer(group(4, 2), group(4, 8, page_size=32))
    b = plan_transfer(tuple(group(4, 2)), group(4, 8, page_size=32))  # equal layouts, new objects
    assert a is b
    assert plan_transfer(group(4, 2), group(4, 8, page_size=16)) is not a


# ---- invalid and impossible pairings ------------------------------------------------------------
@pytest.mark.parametrize("k,n", [(8, 3), (2, 3), (4, 6), (8, 12), (2, 0), (2, -2)])
def test_invalid_tp_size_is_refused_naming_tensor_parallel_size(k, n):
    with pytest.raises(ReshardError, match=rf"tensor_parallel_size={n}"):
        group(k, n)


def test_layout_topology_fields_are_validated():
    with pytest.raises(ValueError, match=r"KVLayout.tp_rank must be in \[0, tp_size=2\), got 2"):
        KVLayout(2, 16, 0, 1, 8, "float32", tp_size=2, tp_rank=2)
    with pytest.raises(ValueError, match=r"KVLayout.tp_size must be >= 1, got 0"):
        KVLayout(2, 16, 0, 1, 8, "float32", tp_size=0)
    with pytest.raises(ValueError, match="KVLayout.tp_rank"):
        KVLayout(2, 16, 0, 1, 8, "float32", tp_rank=-1)
    lay = KVLayout(6, 16, 2, 2, 32, "float32", tp_size=2, tp_rank=1)
    assert str(lay) == lay.describe() == "tp 2 rank 1 heads [2, 4) page 16 float32 (6 layers x head_dim 32)"
    assert KVLayout.from_proto(lay.to_proto()) == lay
    legacy = lay.to_proto()
    legacy.ClearField("tp_size"), legacy.ClearField("tp_rank")  # a peer from before the topology fields
    assert (KVLayout.from_proto(legacy).tp_size, KVLayout.from_proto(legacy).tp_rank) == (1, 0)
    assert "tp rank 0 of 2 over 4 kv heads, which holds [0, 2)" in \
        KVLayout(6, 16, 2, 2, 32, "float32", tp_size=2, tp_rank=0).topology_error(4)


def test_receiver_head_of_another_model_is_impossible_naming_both_sides():
    # a 2-kv-head model's TP 2 senders cannot feed a 4-kv-head model's receiver
    with pytest.raises(ReshardError) as err:
        plan_transfer(group(2, 2), group(4, 1))
    msg = str(err.value)
    assert "receiver rank 0 holds KV head 2, which no sender rank holds" in msg
    assert "senders [rank 0: tp 2 rank 0 heads [0, 1)" in msg and "rank 1: tp 2 rank 1 heads [1, 2)" in msg
    assert "receivers [rank 0: tp 1 rank 0 heads [0, 4)" in msg


def test_hand_built_gap_is_impossible_naming_both_sides():
    lay = dict(num_layers=2, page_size=16, head_dim=8, dtype="float32")
    senders = [KVLayout(head_start=0, num_heads=1, **lay), KVLayout(head_start=2, num_heads=2, **lay)]
    with pytest.raises(ReshardError, match=r"KV head 1, which no sender rank holds: senders \[rank 0: tp 1 rank 0 "
                                           r"heads \[0, 1\).*receivers \[rank 0: tp 1 rank 0 heads \[0, 4\)"):
        plan_transfer(senders, [KVLayout(head_start=0, num_heads=4, **lay)])


def test_mismatched_head_dim_or_layers_is_impossible_naming_both_sides():
    with pytest.raises(ReshardError, match=r"head_dim \(8 vs 16\).*senders \[rank 0.*/ receivers \[rank 0"):
        plan_transfer(group(2, 1), group(2, 2, head_dim=16))
    with pytest.raises(ReshardError, match=r"num_layers \(2 vs 3\).*senders .* / receivers "):
        plan_transfer(group(2, 1), group(2, 1, num_layers=3))


def test_uneven_hand_built_ranges_have_no_exact_cover():
    lay = dict(num_layers=2, page_size=16, head_dim=8, dtype="float32")
    senders = [KVLayout(head_start=0, num_heads=2, **lay), KVLayout(head_start=1, num_heads=2, **lay)]
    with pytest.raises(ReshardError, match=r"cannot each come from exactly one sender rank.*senders .* / receivers"):
        plan_transfer(senders, [KVLayout(head_start=0, num_heads=3, **lay)])


def test_overlapping_hand_built_ranges_still_plan():
    """A sender range that contains another's: every receiver takes the head from a sender whose
    whole overlap it needs (the first plan refused receiver 1 here, picking the sub-range)."""
    lay = dict(num_layers=2, page_size=16, head_dim=8, dtype="float32")
    senders = [KVLayout(head_start=0, num_heads=2, **lay), KVLayout(head_start=1, num_heads=1, **lay)]
    plan = plan_transfer(senders, [KVLayout(head_start=0, num_heads=2, **lay)] * 2)
    assert [(r.sender, r.receiver, r.head_start, r.num_heads) for r in plan.routes] == [(0, 0, 0, 2), (0, 1, 0, 2)]


def test_group_topology_must_match_the_group():
    senders = group(4, 2)
    with pytest.raises(ReshardError, match=r"sender rank 1 of a group of 2 declares tp 2 rank 0.*tensor_parallel_size"):
        plan_transfer([senders[0], senders[0]], group(4, 1))
    with pytest.raises(ReshardError, match=r"receiver rank 0 of a group of 1 declares tp 2 rank 0"):
        plan_transfer(group(4, 1), senders[:1])
    with pytest.raises(ReshardError, match="at least one sender rank"):
        plan_transfer([], group(4, 1))


# ---- the handshake carries and checks topology ------------------------------------------------
ALLOWED = TransferConfig().allowed_dtype_conversions


def _spec(k: int) -> ModelSpec:
    return ModelSpec("tiny-kv", num_layers=2, num_kv_heads=k, head_dim=8)


@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("p", SIZES)
def test_handshake_accepts_every_planned_pair_and_refuses_disjoint_heads(p, d):
    k = 2
    senders, receivers = group(k, p, page_size=16), group(k, d, page_size=64)
    planned = {(r.sender, r.receiver) for r in plan_transfer(senders, receivers).routes}
    for i, s in enumerate(senders):
        for j, r in enumerate(receivers):
            reply = answer(make_request(_spec(k), s, "grpc", f"s{i}"), _spec(k), r, "grpc", f"r{j}", ALLOWED)
            got = KVLayout.from_proto(reply.layout)
            assert (got.tp_size, got.tp_rank) == (d, j)  # the reply carries the receiver rank's topology
            if (i, j) in planned:
                assert reply.accepted, reply.reason
            if max(s.head_start, r.head_start) >= min(s.head_end, r.head_end):
                assert not reply.accepted
                assert reply.reason.startswith(f"sender {s.describe()} / receiver {r.describe()}: ")
                assert "do not overlap" in reply.reason


def test_handshake_refuses_a_sender_inconsistent_with_its_topology_naming_both_sides():
    spec = _spec(2)
    recv = group(2, 4)[0]
    wrong = KVLayout(2, 16, 0, 1, 8, "float32", tp_size=2, tp_rank=1)  # rank 1 of 2 holds head 1, not 0
    reply = answer(make_request(spec, wrong, "grpc", "s"), spec, recv, "grpc", "r", ALLOWED)
    assert not reply.accepted
    assert reply.reason == (
        "sender tp 2 rank 1 heads [0, 1) page 16 float32 (2 layers x head_dim 8) / receiver tp 4 rank 0 heads "
        "[0, 1) page 16 float32 (2 layers x head_dim 8): sender layout inconsistent with its tensor-parallel "
        "topology: heads [0, 1) are not those of tp rank 1 of 2 over 2 kv heads, which holds [1, 2)")
    # a TP size that cannot shard the model's heads
    three = KVLayout(2, 16, 0, 1, 8, "float32", tp_size=3, tp_rank=0)
    reply = answer(make_request(spec, three, "grpc", "s"), spec, recv, "grpc", "r", ALLOWED)
    assert not reply.accepted and "tensor_parallel_size=3 must divide or be a multiple of num_key_value_heads=2" \
        in reply.reason and "sender tp 3 rank 0" in reply.reason and "receiver tp 4 rank 0" in reply.reason
    # a partial head range that claims to be the whole model (tp 1)
    partial = KVLayout(2, 16, 0, 1, 8, "float32")
    reply = answer(make_request(spec, partial, "grpc", "s"), spec, recv, "grpc", "r", ALLOWED)
    assert not reply.accepted and "tp rank 0 of 1 over 2 kv heads, which holds [0, 2)" in reply.reason
    # the receiver's own layout is checked too
    reply = answer(make_request(spec, group(2, 1)[0], "grpc", "s"), spec, partial, "grpc", "r", ALLOWED)
    assert not reply.accepted and "receiver layout inconsistent" in reply.reason


def test_handshake_refusals_of_wire_fields_name_both_sides():
    spec = _spec(2)
    recv = group(2, 2)[1]
    req = make_request(spec, group(2, 2)[1], "grpc", "s")
    req.layout.tp_rank = 5  # rank outside its group
    reply = answer(req, spec, recv, "grpc", "r", ALLOWED)
    assert not reply.accepted and "sender layout invalid: KVLayout.tp_rank must be in [0, tp_size=2), got 5" \
        in reply.reason and "/ receiver tp 2 rank 1 heads [1, 2)" in reply.reason
    other = ModelSpec("other-model", num_layers=2, num_kv_heads=2, head_dim=8)
    reply = answer(make_request(other, group(2, 2)[1], "grpc", "s"), spec, recv, "grpc", "r", ALLOWED)
    assert not reply.accepted and reply.reason.startswith("sender tp 2 rank 1 heads [1, 2)") \
        and "compat.model_id mismatch" in reply.reason
    bf16 = group_layouts(2, 2, num_layers=2, page_size=16, head_dim=8, dtype="bfloat16")[1]
    reply = answer(make_request(spec, bf16, "grpc", "s"), spec, recv, "grpc", "r", ALLOWED)
    assert not reply.accepted and "compat.dtype mismatch" in reply.reason and "bfloat16" in reply.reason
    # a peer from before the topology fields: reads as tp 1 rank 0, accepted when it holds every head
    legacy = make_request(spec, group(2, 1)[0], "grpc", "s")
    legacy.layout.ClearField("tp_size"), legacy.layout.ClearField("tp_rank")
    assert answer(legacy, spec, recv, "grpc", "r", ALLOWED).accepted


def test_pool_from_tensors_carries_topology():
    layers = [torch.zeros(4, 2, 16, 1, 8) for _ in range(2)]
    pool = KVPool.from_tensors(layers, "tiny-kv", head_start=1, num_kv_heads=2, tp_size=4, tp_rank=2)
    assert (pool.layout.tp_size, pool.layout.tp_rank, pool.layout.head_start) == (4, 2, 1)
    assert pool.spec.num_kv_heads == 2
    assert KVPool.from_tensors(layers, "tiny-kv").layout.tp_size == 1  # the existing call, unchanged
    with pytest.raises(ValueError, match=r"KVPool.layout \(tp 4 rank 1 heads \[1, 2\).*which holds \[0, 1\)"):
        KVPool.from_tensors(layers, "tiny-kv", head_start=1, num_kv_heads=2, tp_size=4, tp_rank=1)


def test_local_sender_surfaces_the_refusal_in_its_transfer_error():
    spec = _spec(2)
    hub = LocalHub()
    recv_pool = KVPool.allocate(spec, group(2, 2)[0], 8)
    receiver = LocalReceiver(recv_pool, hub=hub)
    sender = LocalSender(KVPool.allocate(spec, group(2, 1)[0], 8), hub=hub)
    bad = LocalSender(KVPool.allocate(spec, group(2, 2)[1], 8), hub=hub)
    try:
        desc = receiver.expect("r1", [0, 1], 20)
        # rank 1 of 2 (head 1) to the rank holding head 0: heads do not overlap
        status = bad.start("r1", [desc], [0, 1], 20)
        assert status.state == TransferState.FAILED
        assert "sender tp 2 rank 1 heads [1, 2)" in status.error and "receiver tp 2 rank 0 heads [0, 1)" \
            in status.error and "do not overlap" in status.error
        assert receiver.status("r1").state == TransferState.BOOTSTRAPPING  # nothing began
        assert sender.start("r1", [desc], [0, 1], 20).state == TransferState.WAITING
    finally:
        for obj in (bad, sender, receiver):
            obj.close()
