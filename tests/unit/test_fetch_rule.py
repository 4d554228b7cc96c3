"""Fetch or recompute (router/fetch_rule.py): the rule the router and the simulator share."""
from __future__ import annotations

import pytest

from router.fetch_rule import DEFAULT_FETCH_OVERHEAD_S, FetchCosts, Offer, choose

PS = 16


def test_fetches_when_moving_the_pages_beats_computing_them():
    # 10 extra pages: 160 tokens at 1 ms = 0.16 s computed, against 5 ms + 10 x 0.2 ms moved
    assert choose(2, [Offer("store", 12, 2e-4)], PS, 1e-3, 5e-3) == Offer("store", 12, 2e-4)


def test_computes_when_the_fetch_costs_more_than_it_saves():
    # 1 extra page: 16 tokens at 0.1 ms = 1.6 ms computed, against 5 ms of fixed cost
    assert choose(3, [Offer("store", 4, 2e-4)], PS, 1e-4, 5e-3) is None
    # a slow transport: computing is faster per page
    assert choose(0, [Offer("far", 50, 0.05)], PS, 1e-3, 0.0) is None


def test_nothing_more_than_held_here_or_under_min_pages_is_no_offer():
    assert choose(5, [Offer("a", 5, 0.0), Offer("b", 4, 0.0)], PS, 1.0, 0.0) is None
    assert choose(5, [Offer("a", 7, 0.0)], PS, 1.0, 0.0, min_pages=3) is None
    assert choose(5, [Offer("a", 8, 0.0)], PS, 1.0, 0.0, min_pages=3) == Offer("a", 8, 0.0)


def test_the_largest_gain_wins_and_ties_go_to_the_first_offer():
    offers = [Offer("store", 10, 1e-3), Offer("peer", 10, 1e-3), Offer("peer-more", 12, 1e-3)]
    assert choose(0, offers, PS, 1e-3, 0.0).holder == "peer-more"
    assert choose(0, offers[:2], PS, 1e-3, 0.0).holder == "store"
    # more pages, but each much dearer to move: the nearer, smaller offer gains more
    assert choose(0, [Offer("near", 10, 1e-4), Offer("far", 12, 1.5e-2)], PS, 1e-3, 0.0).holder == "near"


def test_costs_learn_from_what_they_observe():
    c = FetchCosts("grpc")
    assert c.prefill_s_per_token == pytest.approx(1e-3) and c.s_per_page == pytest.approx(1e-3)
    c.observe_prefill(100, 0.5)
    assert c.prefill_s_per_token == pytest.approx(5e-3)  # the first observation replaces the seed
    c.observe_prefill(100, 0.0)  # nothing to learn from
    c.observe_prefill(4, 1.0)    # too few tokens to say
    assert c.prefill_s_per_token == pytest.approx(5e-3)
    c.observe_prefill(100, 1.0)
    assert c.prefill_s_per_token == pytest.approx(0.8 * 5e-3 + 0.2 * 1e-2)
    c.observe_fetch(10, DEFAULT_FETCH_OVERHEAD_S + 0.01)
    assert c.s_per_page == pytest.approx(1e-3)
    assert c.offer("s", 3) == Offer("s", 3, c.s_per_page)


def test_each_source_kind_learns_its_own_fixed_cost():
    """A worker's export waits for its engine's step, a store's does not: the rule sees it."""
    c = FetchCosts("nixl")
    c.observe_fetch(4, 4 * c.s_per_page + 0.05, "worker")   # 50 ms past the pages' own time
    c.observe_fetch(4, 4 * c.s_per_page + 0.002, "store")
    assert c.source_overhead_s["worker"] == pytest.approx(0.05) and c.source_overhead_s["store"] == pytest.approx(0.002)
    worker, store = c.offer("decode-0", 10, "worker"), c.offer("kv-store-0", 9, "store")
    assert (worker.overhead_s, store.overhead_s) == (pytest.approx(0.05), pytest.approx(0.002))
    # 10 pages from the busy worker against 9 from the store: the store's page less costs 16 ms
    # of compute, the worker's wait 48 ms more
    assert choose(0, [store, worker], PS, 1e-3, DEFAULT_FETCH_OVERHEAD_S).holder == "kv-store-0"
    assert choose(0, [c.offer("decode-0", 10)], PS, 1e-3, 0.5) is None, "no kind: the caller's fixed cost"
