"""Multi-turn workloads (loadgen/conversations.py) and the pure parts of `bench multiturn`: a
Mooncake replay's prompts share tokens exactly where the trace's block ids are equal, turns
follow the shared prefixes, and the per-turn figures and ratios come out of the records."""
from __future__ import annotations

import json

import pytest

from bench.multiturn_bench import per_turn, ratios
from loadgen.conversations import chat_tokens, mooncake_conversations, synthetic_chats, trace_parents

BLOCK = 16  # tokens per trace block after scaling (512 -> 16)


def write_trace(path, rows):
    path.write_text("".join(json.dumps(dict(zip(("timestamp", "input_length", "output_length", "hash_ids"), r))) + "\n"
                            for r in rows))
    return path


def blocks_of(ids, n):
    return [tuple(ids[i * BLOCK:(i + 1) * BLOCK]) for i in range(n)]


def test_equal_hash_ids_give_equal_token_blocks_and_different_ones_differ(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [
        (0, 4 * 512, 320, [0, 1, 2, 3]),          # conversation A, turn 1
        (1000, 3 * 512, 320, [0, 7, 8]),          # conversation B, turn 1 (shares block 0 only)
        (60000, 6 * 512 + 100, 320, [0, 1, 2, 3, 4, 5, 6]),  # A, turn 2: A's 4 blocks, then new ones
        (90000, 5 * 512, 320, [0, 7, 8, 9, 10]),  # B, turn 2
    ])
    replay = mooncake_conversations(trace, vocab_size=1000, max_model_len=2048, conversations=5, block_tokens=BLOCK,
                                    time_scale=0.01, seed=3)
    reqs = replay.workload.requests
    assert [r.prompt_len for r in reqs] == [4 * BLOCK, 3 * BLOCK, round((6 * 512 + 100) / 32), 5 * BLOCK]
    assert [r.output_len for r in reqs] == [10] * 4   # 320 x 16/512
    a1, b1, a2, b2 = (blocks_of(r.prompt_token_ids, len(r.prompt_token_ids) // BLOCK) for r in reqs)
    assert a2[:4] == a1 and b2[:3] == b1                # equal ids -> equal tokens, block for block
    assert a1[0] == b1[0]                               # the common block 0
    assert a1[1] != b1[1] and a2[4] != b2[3]            # different ids -> different tokens
    assert len(set(a2)) == len(a2)
    # a partial last block (100 tokens of block id 6 -> 3 tokens) is the request's own tail
    assert len(reqs[2].prompt_token_ids) == reqs[2].prompt_len
    assert replay.turns == [1, 1, 2, 2] and replay.conversations == [0, 1, 0, 1]
    assert replay.reusable == [0, BLOCK, 4 * BLOCK, 3 * BLOCK]
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 0.01, 0.6, 0.9])
    # the same seed gives the same prompts; another seed other tokens
    again = mooncake_conversations(trace, vocab_size=1000, max_model_len=2048, conversations=5, block_tokens=BLOCK,
                                   time_scale=0.01, seed=3)
    other = mooncake_conversations(trace, vocab_size=1000, max_model_len=2048, conversations=5, block_tokens=BLOCK,
                                   time_scale=0.01, seed=4)
    assert [r.prompt_token_ids for r in again.workload.requests] == [r.prompt_token_ids for r in reqs]
    assert other.workload.requests[0].prompt_token_ids != reqs[0].prompt_token_ids


def test_only_conversations_that_reach_min_turns_in_the_window_are_replayed(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [
        (0, 1024, 64, [0, 1]),                    # one turn only: left out
        (0, 1024, 64, [0, 2]),                    # 3 turns, the last outside the window
        (50000, 2048, 64, [0, 2, 3, 4]),
        (500000, 3072, 64, [0, 2, 3, 4, 5, 6]),
        (60000, 1024, 64, [0, 9]),                # 2 turns
        (70000, 1536, 64, [0, 9, 10]),
    ])
    replay = mooncake_conversations(trace, vocab_size=1000, max_model_len=2048, window_s=100, block_tokens=BLOCK)
    assert replay.turns == [1, 2, 1, 2] and replay.conversations == [0, 0, 1, 1]
    assert replay.meta["trace_requests_in_window"] == 5
    one = mooncake_conversations(trace, vocab_size=1000, max_model_len=2048, window_s=100, block_tokens=BLOCK,
                                 conversations=1)
    assert one.turns == [1, 2]
    with pytest.raises(ValueError, match="no conversation of 4"):
        mooncake_conversations(trace, vocab_size=1000, max_model_len=2048, window_s=100, min_turns=4)


def test_lengths_are_capped_to_the_model_and_the_limits(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [(0, 100 * 512, 100 * 512, list(range(100)) + [0]),
                                               (10, 100 * 512, 100 * 512, list(range(100)) + [1])])
    replay = mooncake_conversations(trace, vocab_size=1000, max_model_len=512, block_tokens=BLOCK,
                                    max_prompt_tokens=1024, max_output_tokens=64)
    for r in replay.workload.requests:
        assert r.output_len == 64 and r.prompt_len == 512 - 64 and len(r.prompt_token_ids) == r.prompt_len


def test_a_request_continues_the_first_that_had_its_longest_shared_run_of_two_blocks_or_more():
    got = trace_parents([(0, 1), (0, 1, 2), (0, 5), (0, 1, 2, 3), (0, 1, 7)])
    # (0, 1, 7) branches off after block 1: it continues request 0, not its sibling 3
    assert got == [(None, 0), (0, 2), (None, 0), (1, 3), (0, 2)]


def test_synthetic_chats_have_the_asked_lengths_and_share_nothing():
    chats = synthetic_chats(3, 4, prompt_tokens=24, answer_tokens=200, user_tokens=8, vocab_size=500, seed=1)
    assert [len(n) for n in chats[0].new_tokens] == [24, 8, 8, 8]
    assert chat_tokens(chats[0]) == 24 + 3 * 8 + 4 * 200
    assert len({tuple(c.new_tokens[0][:4]) for c in chats}) == 3
    assert all(10 <= t < 500 for c in chats for n in c.new_tokens for t in n)
    assert synthetic_chats(3, 4, 24, 200, 8, 500, seed=1)[2].new_tokens == chats[2].new_tokens
    with pytest.raises(ValueError, match="turns must be >= 1"):
        synthetic_chats(1, 0, 24, 200, 8, 500, seed=1)


def turn(t, ttft, prompt, cached, reusable=0, ok=True, local=False):
    return dict(turn=t, ttft_s=ttft, prompt_len=prompt, cached_tokens=cached, reusable_tokens=reusable, ok=ok,
                server={"local_prefill": local})


def test_per_turn_figures_and_the_disaggregated_over_colocated_ratio():
    coloc = [turn(1, 0.1, 100, 0), turn(2, 0.2, 300, 200, 280, local=True), turn(2, 0.4, 300, 100, 280),
             turn(5, 1.0, 900, 0, ok=False)]
    rows = per_turn(coloc, fold_from=4)
    assert list(rows) == ["1", "2", "4+"]
    assert rows["2"]["hit_rate"] == pytest.approx(300 / 600) and rows["2"]["reusable_rate"] == pytest.approx(560 / 600)
    assert rows["2"]["ttft_p50_ms"] == pytest.approx(300) and rows["2"]["local_prefill_share"] == 0.5
    assert rows["4+"]["failed"] == 1 and rows["4+"]["ttft_p50_ms"] is None
    disagg = [turn(1, 0.2, 100, 0), turn(2, 0.6, 300, 0), turn(2, 0.6, 300, 0)]

    def entry(arm, turns):
        return {"arm": arm, "policy": "prefix-aware", "per_turn": per_turn(turns),
                "later_turns": per_turn([dict(t, turn=2) for t in turns if t["turn"] >= 2])["2"]}

    r = ratios([entry("colocated", coloc), entry("disaggregated", disagg)])
    main = r["disagg_over_colocated[prefix-aware]"]
    assert main["later_turns_ttft_p50"] == pytest.approx(600 / 300)
    assert main["per_turn_ttft_p50"]["1"] == pytest.approx(2.0)
    assert r["target_met"] is False
