"""`pdcluster bench tp`: registered, its --quick defaults, and the KV part's JSON for one pairing
(grpc 1:1 and 2:1 over 127.0.0.1, a small KV: a few seconds; not a benchmark, a check it runs)."""
from __future__ import annotations

import argparse
import json

import pytest

from bench import kv_tp_bench, tp_bench
from cluster.cli import build_parser


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    tp_bench.add_arguments(parser)
    args = parser.parse_args(list(argv))
    tp_bench.resolve(args)
    return args


def test_registered_as_bench_tp():
    args = build_parser().parse_args(["bench", "tp", "--quick", "--skip-engine"])
    assert args.quick and args.skip_engine


def test_quick_defaults_and_explicit_values_win():
    quick = _args("--quick")
    assert (quick.prompt, quick.rounds, quick.steps, quick.transports, quick.lm_heads) == (256, 2, 4, "socket",
                                                                                           "replicated")
    assert (quick.kv_tokens, quick.kv_repeats) == (512, 2)
    full = _args()
    assert (full.prompt, full.rounds, full.kv_tokens, full.kv_repeats) == (512, 4, 2048, 5)
    assert _args("--quick", "--rounds", "3", "--kv-tokens", "64").rounds == 3
    assert _args("--quick", "--kv-tokens", "64").kv_tokens == 64


def test_pairings_always_hold_the_baseline():
    assert kv_tp_bench._parse_pairings("2:1") == [(1, 1), (2, 1)]
    assert kv_tp_bench._parse_pairings("1:1,1:2") == [(1, 1), (1, 2)]


def test_skip_both_is_refused():
    assert tp_bench.run(_args("--skip-engine", "--skip-kv")) == 2


@pytest.mark.timeout(120)
def test_kv_part_moves_and_verifies_one_pairing(tmp_path):
    out = tmp_path / "tp.json"
    args = _args("--skip-engine", "--kv-shape", "small", "--kv-tokens", "256", "--kv-repeats", "1",
                 "--kv-transports", "grpc", "--kv-pairings", "2:1", "--json", str(out))
    assert tp_bench.run(args) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "tp" and "rows" not in doc
    table = doc["kv"]["table"]
    assert set(table) == {"grpc 1:1", "grpc 2:1"}
    assert all(row["verified"] for row in table.values())
    assert table["grpc 1:1"]["vs_1to1"] == 1.0
    assert [r[:2] for r in table["grpc 2:1"]["routes"]] == [[0, 0], [1, 0]]
    # the receiver holds every head once whatever the pairing: the same pages, the same checksum
    assert table["grpc 2:1"]["checksums"] == table["grpc 1:1"]["checksums"]
