"""`pdcluster bench multiturn --quick` end to end on a real local cluster (tiny model, one arm):
the report has a row per turn, every turn completed, and under prefix-aware placement the later
turns of a conversation find their history in the cache, which turn 1 cannot.

Slow (a benchmark's smoke runs, ~40 and ~60 s): the default run covers the conversations' prompt building
(tests/unit/test_conversations.py) and a conversation's placement (tests/integration/
test_conversation_affinity.py)."""
from __future__ import annotations

import json

import pytest

from cluster.cli import build_parser


@pytest.mark.slow
def test_quick_multiturn_on_colocated_prefix_aware_reuses_the_history(tiny_model, tmp_path):
    tiny_model("llama")  # built once here; the actors find it in PDCLUSTER_CACHE
    out = tmp_path / "multiturn.json"
    args = build_parser().parse_args(["bench", "multiturn", "--model", "tiny", "--quick", "--arms", "colocated",
                                      "--policies", "prefix-aware", "--json", str(out)])
    assert args._run(args) == 0
    report = json.loads(out.read_text())
    assert report["provenance"]["commit"]
    (run,) = report["runs"]
    assert (run["arm"], run["policy"]) == ("colocated", "prefix-aware")
    turns = run["per_turn"]
    assert list(turns) == ["1", "2", "3"]          # --quick: 3 turns, 2 conversations, 1 round
    assert all(t["n"] == 2 and t["failed"] == 0 for t in turns.values())
    assert all(t["ttft_p50_ms"] > 0 and t["ttft_p90_ms"] >= t["ttft_p50_ms"] for t in turns.values())
    assert turns["1"]["hit_rate"] == 0.0           # fresh tokens: nothing to reuse
    assert turns["2"]["hit_rate"] > 0.0 and turns["3"]["hit_rate"] > turns["2"]["hit_rate"] * 0.9
    assert run["later_turns"]["hit_rate"] > turns["1"]["hit_rate"]
    # each later turn's prompt is the previous prompt, its answer and 8 new tokens
    recs = {(t["conversation"], t["turn"]): t for t in run["turns"]}
    for c in (0, 1):
        assert recs[(c, 2)]["prompt_len"] == recs[(c, 1)]["prompt_len"] + 16 + 8
        assert recs[(c, 3)]["prompt_len"] == recs[(c, 2)]["prompt_len"] + 16 + 8
        assert all(recs[(c, t)]["output_tokens"] == 16 for t in (1, 2, 3))


@pytest.mark.slow
def test_quick_multiturn_runs_the_disaggregated_arm_per_store_size_and_reports_the_tier(tiny_model, tmp_path):
    """`--kv-store-size 0,auto`: the disaggregated arm twice (~50 s), labelled by size; router 0's
    metrics show no store with size 0 and offloads into it with auto; the tier on/off ratio."""
    tiny_model("llama")
    out = tmp_path / "multiturn.json"
    args = build_parser().parse_args(["bench", "multiturn", "--model", "tiny", "--quick", "--arms", "disaggregated",
                                      "--policies", "prefix-aware", "--kv-store-size", "0,auto", "--think-ms", "200",
                                      "--json", str(out)])
    assert args._run(args) == 0
    report = json.loads(out.read_text())
    off, on = report["runs"]
    assert (off["label"], off["store"], on["label"], on["store"]) == (
        "disaggregated store=0", "0", "disaggregated store=auto", "auto")
    assert all(t["failed"] == 0 and t["n"] == 2 for r in (off, on) for t in r["per_turn"].values())
    assert off["tier"]["scraped"] and on["tier"]["scraped"]
    assert not off["tier"]["offloads"] and not off["tier"]["store_hit_rate"]   # size 0: no store at all
    assert off["tier"]["fetched_tokens_by_source"].get("store", 0) == 0
    assert on["tier"]["offloads"]["stored"] > 0 and on["tier"]["offloaded_tokens"] >= 16
    assert set(on["tier"]["store_hit_rate"]) == {"kv-store-0"}
    assert on["tier"]["indexed_blocks"]["kv-store-0"] > 0
    assert on["tier"]["fetched_tokens"] == sum(on["tier"]["fetched_tokens_by_source"].values())
    ratio = report["ratios"]["tier_on_over_off[prefix-aware store=auto]"]
    assert ratio["later_turns_ttft_p50"] > 0 and ratio["later_turns_hit_rate"] is not None


def test_tier_figures_are_the_counters_differences_and_the_gauges_at_the_end():
    from bench import multiturn_tier as tier

    def s(name, value, **labels):
        return {(name, tuple(sorted(labels.items()))): value}

    before = {**s("pdcluster_kv_fetches_total", 2, outcome="fetched"),
              **s("pdcluster_kv_fetched_tokens_by_source_total", 32, source="worker"),
              **s("pdcluster_kv_fetched_tokens_total", 32), **s("pdcluster_kv_store_offloads_total", 1, outcome="stored")}
    after = {**s("pdcluster_kv_fetches_total", 5, outcome="fetched"),
             **s("pdcluster_kv_fetches_total", 1, outcome="recomputed"),
             **s("pdcluster_kv_fetched_tokens_by_source_total", 48, source="worker"),
             **s("pdcluster_kv_fetched_tokens_by_source_total", 64, source="store"),
             **s("pdcluster_kv_fetched_tokens_total", 112), **s("pdcluster_kv_store_offloads_total", 4, outcome="stored"),
             **s("pdcluster_kv_store_offloaded_tokens_total", 160),
             **s("pdcluster_kv_store_hit_rate", 0.5, store="kv-store-0", node="n"),
             **s("pdcluster_kv_store_pages", 10, store="kv-store-0", node="n", kind="total"),
             **s("pdcluster_kv_index_worker_blocks", 7, worker="decode-0", pool="decode", role="decode")}
    f = tier.figures(before, after)
    assert f["fetches"] == {"fetched": 3, "recomputed": 1}
    assert f["fetched_tokens_by_source"] == {"store": 64, "worker": 16} and f["fetched_tokens"] == 80
    assert f["offloads"] == {"stored": 3} and f["offloaded_tokens"] == 160
    assert f["store_hit_rate"] == {"kv-store-0": 0.5} and f["store_pages"] == {"kv-store-0": {"total": 10}}
    assert f["indexed_blocks"] == {"decode-0": 7}
    assert tier.figures({}, {})["scraped"] is False

    def entry(arm, store, p50, hit):
        e = {"arm": arm, "policy": "prefix-aware", "label": tier.label(arm, store),
             "per_turn": {"2": {"ttft_p50_ms": p50}}, "later_turns": {"ttft_p50_ms": p50, "ttft_p90_ms": p50,
                                                                      "hit_rate": hit}}
        return e if store is None else dict(e, store=store)

    r = tier.ratios([entry("colocated", None, 40, 0.9), entry("disaggregated", "0", 120, 0.6),
                     entry("disaggregated", "auto", 50, 0.9)], ("prefix-aware",), 1.5)
    assert r["disagg_over_colocated[prefix-aware store=0]"]["target_met"] is False
    assert r["disagg_over_colocated[prefix-aware store=auto]"]["later_turns_ttft_p50"] == pytest.approx(1.25)
    assert r["disagg_over_colocated[prefix-aware store=auto]"]["target_met"] is True
    assert r["tier_on_over_off[prefix-aware store=auto]"]["later_turns_hit_rate"] == pytest.approx(1.5)
    assert "tier_on_over_off[prefix-aware store=0]" not in r
    assert tier.parse_store_sizes(" 0, auto,16MiB ") == ["0", "auto", "16MiB"]
    with pytest.raises(SystemExit, match="twice"):
        tier.parse_store_sizes("0,0B")
