"""`pdcluster bench multiturn --quick` end to end on a real local cluster (tiny model, one arm):
the report has a row per turn, every turn completed, and under prefix-aware placement the later
turns of a conversation find their history in the cache, which turn 1 cannot.

Slow (a benchmark's smoke run, ~25 s): the default run covers the conversations' prompt building
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
