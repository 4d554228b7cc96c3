"""What a move request (`pdcluster scale --move N --from A --to B`) may ask: the router's check
(router.service.PoolTargets.check_move) names the field and its allowed range, the targets it
shows count moves the driver has not taken yet, and the config decides which pools can trade
workers (cluster.scaler.move_refusal: engines built alike on the same resources, no tensor
parallelism)."""
from __future__ import annotations

import time

import pytest

from cluster.config import ClusterConfig
from cluster.scaler import move_refusal, move_refusals
from router.service import PoolTargets


def config(**decode_engine) -> ClusterConfig:
    return ClusterConfig(model="tiny", pools=[
        {"name": "prefill", "role": "prefill", "replicas": 2},
        {"name": "decode", "role": "decode", "replicas": 1, "engine": decode_engine},
    ])


def test_pools_built_alike_can_trade_workers_and_the_step_limits_may_differ():
    cfg = config(max_num_seqs=8, max_num_batched_tokens=512, reserve_pages=4)
    assert move_refusal(cfg, "prefill", "decode") is None and move_refusals(cfg) == {}


@pytest.mark.parametrize("engine, said", [
    ({"page_size": 32}, "engine.page_size 16 vs 32"),
    ({"dtype": "bfloat16"}, "engine.dtype None vs 'bfloat16'"),
    ({"num_pages": 100}, "engine.num_pages"),
    ({"tensor_parallel_size": 2}, "tensor-parallel workers cannot switch roles"),
])
def test_pools_built_differently_cannot(engine, said):
    cfg = config(**engine)
    why = move_refusal(cfg, "prefill", "decode")
    assert why is not None and said in why, why
    assert set(move_refusals(cfg)) == {("prefill", "decode"), ("decode", "prefill")}


def test_other_resources_cannot():
    cfg = ClusterConfig(model="tiny", pools=[
        {"name": "prefill", "role": "prefill", "resources": {"custom": {"prefill_node": 1}}},
        {"name": "decode", "role": "decode"}])
    assert "resources differ" in move_refusal(cfg, "decode", "prefill")


def targets(refusals=None) -> PoolTargets:
    return PoolTargets({"prefill": "prefill", "decode": "decode"}, {"prefill": 1, "decode": 3}, 4, refusals)


@pytest.mark.parametrize("pool, to, n, said", [
    ("nope", "decode", 1, "pool must be one of ['decode', 'prefill'], got 'nope'"),
    ("decode", "decode", 1, "to_pool must be one of ['prefill'] (a pool other than 'decode'), got 'decode'"),
    ("decode", "x", 1, "to_pool must be one of ['prefill']"),
    ("decode", "prefill", 3, "move must be in [1, 2] for pools 'decode' -> 'prefill', got 3"),
    ("prefill", "decode", 1, "no worker can move now"),   # prefill has 1: it stays
])
def test_invalid_moves_name_the_field_and_range(pool, to, n, said):
    why = targets().check_move(pool, to, n)
    assert why is not None and said in why, why


def test_a_refused_pair_says_why():
    t = targets({("decode", "prefill"): "engine.page_size 16 vs 32"})
    assert t.check_move("decode", "prefill", 1) == ("workers cannot move from pool 'decode' to 'prefill': "
                                                    "engine.page_size 16 vs 32")


def test_targets_count_moves_until_the_driver_takes_them():
    t = targets()
    assert t.check_move("decode", "prefill", 2) is None
    assert t.move("decode", "prefill", 2) == (3, 1)
    assert (t.target("decode"), t.target("prefill")) == (1, 3)
    # the driver took it: its pushed targets carry the move's time, the move is not counted twice
    stamp = t.moves[-1][0]
    t.status = {"pools": {"decode": {"target": 1, "stamp": stamp}, "prefill": {"target": 3, "stamp": stamp}}}
    assert (t.target("decode"), t.target("prefill")) == (1, 3)
    # a resize after the move, then another move: each on top of the last
    t.set("prefill", 4)
    time.sleep(0.001)
    t.move("prefill", "decode", 1)
    assert (t.target("decode"), t.target("prefill")) == (2, 3)
