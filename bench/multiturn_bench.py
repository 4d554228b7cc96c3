"""`pdcluster bench multiturn`: what a conversation's cached history buys, per turn.

Each turn of a conversation resends the whole conversation so far (loadgen/conversations.py):
a synthetic chat with growing history (closed loop, the default) or a replay of the Mooncake
conversation trace (shared prefixes from its `hash_ids`). The same conversations, with the same
tokens, run on one real local cluster per (arm, policy), one after the other:

  arms      colocated      `--colocated-workers` (2) workers that each prefill and decode
            disaggregated  1 prefill + 1 decode worker, KV over `--transport`; the decode worker
                           prefills a turn itself when less than `--local-prefill-threshold`
                           tokens of it are uncached there (default 0: never, the config's default)
  policies  prefix-aware   the router places by cached prefix (its KV index)
            round-robin    cache-aware routing off: the baseline

  store     the disaggregated arm once per `--kv-store-size` (default: the config's, auto),
            labelled `disaggregated store=SIZE` (0: the tier off); colocated workers have no KV
            connector, hence no store: that arm runs once (bench/multiturn_tier.py)

`--num-pages` sizes every worker's KV cache (engine.num_pages), small enough that the workers
evict history and the store has something to serve; `--fetch-min-pages` defaults to the
config's (1: prefill workers fetch cached leading pages from a store or a peer when it pays).

Per arm, policy and turn it reports TTFT p50/p90 and the prefix hit rate: the router's
`usage.cached_prompt_tokens` (the prompt tokens that the worker which prefilled the request found
in its cache, fetched ones included) over the prompt tokens, beside the share a perfect cache
would hit (the history); per arm, what router 0's /metrics says the tier did during the rounds
(tokens fetched by source, offloads, store hit rate). The ratios: later turns' (2..T) TTFT
disaggregated / colocated under each policy and store size (issue 37's target: <= 1.5x with
prefix-aware), tier on / tier off per store size, and round-robin / prefix-aware per arm.

Benchmarks are not tests: on a shared machine only ratios within one run mean much.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

from bench import multiturn_tier as tier
from bench.multiturn_tier import parse_store_sizes

ARMS = ("colocated", "disaggregated")
POLICIES = ("prefix-aware", "round-robin")
WORKLOADS = ("synthetic", "mooncake")
TTFT_RATIO_TARGET = 1.5   # later turns' TTFT p50, disaggregated / colocated, prefix-aware (issue 37)
TRACE_TURN_ROWS = 4       # mooncake: turns from this one up share a row ("4+")
QUICK = dict(turns=3, prompt_tokens=16, answer_tokens=16, user_tokens=8, rounds=1, trace_conversations=3,
             window_s=300.0, max_output_tokens=8, time_scale=0.02)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="small", help="built-in preset or checkpoint folder (default small)")
    p.add_argument("--dtype", default="float32", help="engine dtype on every arm (default float32: CPUs without "
                                                      "native bfloat16)")
    p.add_argument("--workload", default="synthetic", choices=WORKLOADS)
    p.add_argument("--conversations", type=int, default=2, help="synthetic: conversations at once (default 2)")
    p.add_argument("--turns", type=int, default=None, help="synthetic: turns per conversation (default 6)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="synthetic: turn 1's prompt (default 24)")
    p.add_argument("--answer-tokens", type=int, default=None, help="synthetic: every answer's length (default 200)")
    p.add_argument("--user-tokens", type=int, default=None, help="synthetic: new tokens of turns 2.. (default 24)")
    p.add_argument("--think-ms", type=float, default=0.0,
                   help="synthetic: pause between an answer's end and the conversation's next turn (a user "
                        "reading; default 0: at once). Offloads into the KV store run after a request ends, so "
                        "with 0 the store's copy of the last answer is rarely there when the next turn is placed")
    p.add_argument("--rounds", type=int, default=None,
                   help="the conversations again, with fresh tokens, after the previous round finished: more "
                        "samples per turn (default 3)")
    p.add_argument("--trace", default="mooncake-conv", help="mooncake: a dataset name or a trace file's path")
    p.add_argument("--trace-conversations", type=int, default=None,
                   help="mooncake: the first N conversations of 2+ turns in the window (default 8)")
    p.add_argument("--window-s", type=float, default=None, help="mooncake: the trace's first seconds (default 900)")
    p.add_argument("--block-tokens", type=int, default=16, help="mooncake: tokens per 512-token trace block "
                                                                "(default 16: lengths x 1/32)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="mooncake: longest prompt (default 1024)")
    p.add_argument("--max-output-tokens", type=int, default=None, help="mooncake: longest answer (default 64)")
    p.add_argument("--time-scale", type=float, default=None,
                   help="mooncake: trace seconds x this (default 0.05: 900 s of trace in 45 s)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma list of {', '.join(POLICIES)}")
    p.add_argument("--colocated-workers", type=int, default=2, help="workers of the colocated arm (default 2)")
    p.add_argument("--transport", default="nixl", choices=("nixl", "grpc"))
    p.add_argument("--kv-store-size", default="auto",
                   help="comma list of kv_store.size values (auto, 0 = off, 16MiB, ...): the disaggregated arm runs "
                        "once per size (default: auto, the config's default)")
    p.add_argument("--num-pages", type=int, default=None,
                   help="KV cache pages of every worker (engine.num_pages), to put the caches under pressure so "
                        "that they evict history; default: the config's (large: nothing is evicted)")
    p.add_argument("--fetch-min-pages", type=int, default=None,
                   help="the disaggregated arm's router.fetch_min_pages: its prefill worker fetches a turn's cached "
                        "leading pages from a node's KV store or the worker holding at least this many more of them "
                        "when moving them is estimated faster than computing them; 0: never; default: the config's "
                        "(1)")
    p.add_argument("--local-prefill-threshold", type=int, default=None,
                   help="the disaggregated arm's decode pool prefills a prompt whose uncached part there is under "
                        "this many tokens itself (engine.local_prefill_threshold); default: the config's (0, never)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="multiturn.json")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 3 short turns (synthetic) or 3 conversations (mooncake), 1 round")


def _choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    items = [a.strip() for a in text.split(",") if a.strip()]
    if not items or len(set(items)) != len(items) or any(a not in allowed for a in items):
        raise SystemExit(f"{flag} must list distinct items of {', '.join(allowed)}, got {text!r}")
    return items


def _settle(args: argparse.Namespace) -> None:
    """Fill the defaults that --quick changes, and check every setting."""
    full = dict(turns=6, prompt_tokens=24, answer_tokens=200, user_tokens=24, rounds=3, trace_conversations=8,
                window_s=900.0, max_output_tokens=64, time_scale=0.05)
    for key, value in full.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else value)
    for key in ("conversations", "turns", "prompt_tokens", "answer_tokens", "user_tokens", "rounds",
                "trace_conversations", "block_tokens", "max_prompt_tokens", "max_output_tokens", "colocated_workers"):
        if getattr(args, key) < 1:
            raise SystemExit(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    for key in ("window_s", "time_scale"):
        if not getattr(args, key) > 0:
            raise SystemExit(f"--{key.replace('_', '-')} must be > 0, got {getattr(args, key)}")
    args.store_sizes = parse_store_sizes(args.kv_store_size)
    if args.think_ms < 0:
        raise SystemExit(f"--think-ms must be >= 0, got {args.think_ms}")
    if args.num_pages is not None and args.num_pages < 1:
        raise SystemExit(f"--num-pages must be >= 1, got {args.num_pages}")
    if args.fetch_min_pages is not None and args.fetch_min_pages < 0:
        raise SystemExit(f"--fetch-min-pages must be >= 0, got {args.fetch_min_pages}")
    if args.local_prefill_threshold is not None and args.local_prefill_threshold < 0:
        raise SystemExit(f"--local-prefill-threshold must be >= 0, got {args.local_prefill_threshold}")
    if args.workload == "mooncake":
        args.trace = str(_trace_path(args.trace))  # before any cluster starts


def _trace_path(trace: str) -> Path:
    from loadgen.workloads import DATASETS, dataset_path, missing_dataset

    path = dataset_path(trace) if trace in DATASETS else Path(trace)
    if not path.is_file():
        raise SystemExit(missing_dataset(trace) if trace in DATASETS else f"--trace {trace}: no file there")
    return path


def _config(arm: str, policy: str, args: argparse.Namespace, store: str | None = None):
    """The arm's cluster: router 0 serves /metrics (a free port); `store`: the disaggregated
    arm's kv_store.size (None: the config's)."""
    from cluster.config import ClusterConfig

    engine = {"dtype": args.dtype}
    if args.num_pages is not None:
        engine["num_pages"] = args.num_pages
    router = {"metrics_port": 0}
    if arm == "disaggregated":
        if args.local_prefill_threshold is not None:  # a decode pool's setting: the prefill pool ignores it
            engine["local_prefill_threshold"] = args.local_prefill_threshold
        if args.fetch_min_pages is not None:
            router["fetch_min_pages"] = args.fetch_min_pages
        cfg = ClusterConfig.embedded(model=args.model, prefill=1, decode=1, transport=args.transport, port=0,
                                     policy=policy, engine=engine)
    else:
        cfg = ClusterConfig.embedded(model=args.model, decode=args.colocated_workers, mode="colocated",
                                     transport=args.transport, port=0, policy=policy, engine=engine)
    update = {"router": cfg.router.model_copy(update=router)}
    if store is not None:
        update["kv_store"] = cfg.kv_store.model_copy(update={"size": store})
    return ClusterConfig.model_validate(cfg.model_copy(update=update).model_dump())


def _model_info(address: str):
    from loadgen.client import model_info

    return asyncio.run(model_info(address))


def _play(args: argparse.Namespace, address: str, vocab_size: int, max_model_len: int, round_: int) -> list:
    """One round of the workload against the cluster at `address`; the same tokens on every arm."""
    from loadgen import conversations as conv

    seed = args.seed * 1000 + round_ + 1
    if args.workload == "synthetic":
        chats = conv.synthetic_chats(args.conversations, args.turns, args.prompt_tokens, args.answer_tokens,
                                     args.user_tokens, vocab_size, seed)
        need = conv.chat_tokens(chats[0])
        if need > max_model_len:
            raise SystemExit(f"a conversation needs {need} positions, the model has {max_model_len}: fewer "
                             f"--turns or shorter --answer-tokens/--user-tokens")
        return asyncio.run(conv.run_chats(address, chats, run_tag=f"mt{round_}", think_s=args.think_ms / 1e3))
    return asyncio.run(conv.run_trace(address, _replay(args, vocab_size, max_model_len, seed), run_tag=f"mt{round_}"))


def _replay(args: argparse.Namespace, vocab_size: int, max_model_len: int, seed: int):
    from loadgen import conversations as conv

    return conv.mooncake_conversations(args.trace, vocab_size=vocab_size, max_model_len=max_model_len,
                                       conversations=args.trace_conversations, window_s=args.window_s,
                                       block_tokens=args.block_tokens, max_prompt_tokens=args.max_prompt_tokens,
                                       max_output_tokens=args.max_output_tokens, time_scale=args.time_scale,
                                       seed=seed)


def _warm_up(address: str, vocab_size: int) -> None:
    """Unmeasured short chats on fresh tokens, so every worker has run its first steps (and no
    measured prompt shares a prefix with them)."""
    from loadgen import conversations as conv

    chats = conv.synthetic_chats(4, 2, 24, 8, 8, vocab_size, seed=-1)
    asyncio.run(conv.run_chats(address, chats, run_tag="warmup"))


def _measure(args: argparse.Namespace, arm: str, policy: str, store: str | None = None) -> dict:
    from cluster.runtime import Cluster

    name = f"[{tier.label(arm, store)} {policy}]"
    cluster = Cluster(_config(arm, policy, args, store))
    t_start = time.time()
    address = cluster.start()
    try:
        info = _model_info(address)
        print(f"{name} serving on {address} (started in {time.time() - t_start:.0f} s)", flush=True)
        _warm_up(address, info.vocab_size)

        def rounds() -> list[dict]:
            turns = []
            for r in range(args.rounds):
                t0 = time.time()
                for t in _play(args, address, info.vocab_size, info.max_model_len, r):
                    turns.append(dict(round=r, conversation=t.conversation, turn=t.turn,
                                      reusable_tokens=t.reusable_tokens, **asdict(t.record)))
                print(f"{name} round {r + 1}/{args.rounds}: {time.time() - t0:.1f} s", flush=True)
            return turns

        turns, figures = tier.measured(cluster.metrics_url, rounds)
    finally:
        cluster.stop()
    entry = {"arm": arm, "policy": policy, "label": tier.label(arm, store), "turns": turns, "tier": figures}
    if arm == "disaggregated":
        entry["store"] = store if store is not None else "auto"
    entry["per_turn"] = per_turn(turns, TRACE_TURN_ROWS if args.workload == "mooncake" else None)
    entry["later_turns"] = summarize_turns([t for t in turns if t["turn"] >= 2])
    _print_entry(entry)
    return entry


def summarize_turns(turns: list[dict]) -> dict:
    """TTFT p50/p90 (ms), hit rate (cached / prompt tokens), the share a perfect cache would hit,
    local prefills, failures, of some turn records (completed ones for the figures)."""
    from loadgen.metrics import percentile

    ok = [t for t in turns if t["ok"]]
    ttft = sorted(t["ttft_s"] * 1e3 for t in ok)
    prompt = sum(t["prompt_len"] for t in ok)
    return {"n": len(turns), "failed": len(turns) - len(ok),
            "ttft_p50_ms": percentile(ttft, 50) if ttft else None,
            "ttft_p90_ms": percentile(ttft, 90) if ttft else None,
            "prompt_tokens": prompt, "cached_tokens": sum(t["cached_tokens"] for t in ok),
            "hit_rate": sum(t["cached_tokens"] for t in ok) / prompt if prompt else None,
            "reusable_rate": sum(min(t["reusable_tokens"], t["prompt_len"]) for t in ok) / prompt if prompt else None,
            "local_prefill_share": sum(bool(t["server"].get("local_prefill")) for t in ok) / len(ok) if ok else None}


def per_turn(turns: list[dict], fold_from: int | None = None) -> dict[str, dict]:
    """summarize_turns per turn index ("1", "2", ...); turns >= fold_from share the row "N+"."""
    def key(t: int) -> str:
        return f"{fold_from}+" if fold_from and t >= fold_from else str(t)

    keys = sorted({key(t["turn"]) for t in turns}, key=lambda k: int(k.rstrip("+")))
    return {k: summarize_turns([t for t in turns if key(t["turn"]) == k]) for k in keys}


def ratios(entries: list[dict]) -> dict:
    """Disaggregated / colocated per policy (later turns and per turn), and round-robin /
    prefix-aware per arm, from entries of the same run; with store sizes (entries with a
    "store"), per size and tier on / off too (bench/multiturn_tier.py)."""
    def get(arm, policy, label=None):
        return next((e for e in entries if e["arm"] == arm and e["policy"] == policy
                     and (e.get("label", arm) == label if label else "store" not in e)), None)

    def div(a, b):
        return a / b if a is not None and b else None

    out: dict = {"ttft_target_disagg_over_colocated": TTFT_RATIO_TARGET}
    for policy in POLICIES:
        d, c = get("disaggregated", policy), get("colocated", policy)
        if d and c:
            out[f"disagg_over_colocated[{policy}]"] = {
                "later_turns_ttft_p50": div(d["later_turns"]["ttft_p50_ms"], c["later_turns"]["ttft_p50_ms"]),
                "later_turns_ttft_p90": div(d["later_turns"]["ttft_p90_ms"], c["later_turns"]["ttft_p90_ms"]),
                "per_turn_ttft_p50": {k: div(v["ttft_p50_ms"], c["per_turn"].get(k, {}).get("ttft_p50_ms"))
                                      for k, v in d["per_turn"].items()}}
    out.update(tier.ratios(entries, POLICIES, TTFT_RATIO_TARGET))
    for arm, name in dict.fromkeys((e["arm"], e.get("label", e["arm"])) for e in entries):
        rr, pa = get(arm, "round-robin", name), get(arm, "prefix-aware", name)
        if rr and pa:
            out[f"round_robin_over_prefix_aware[{name}]"] = {
                "later_turns_ttft_p50": div(rr["later_turns"]["ttft_p50_ms"], pa["later_turns"]["ttft_p50_ms"]),
                "later_turns_hit_rate": div(rr["later_turns"]["hit_rate"], pa["later_turns"]["hit_rate"])}
    main = out.get("disagg_over_colocated[prefix-aware]")
    if main and main["later_turns_ttft_p50"] is not None:
        out["target_met"] = main["later_turns_ttft_p50"] <= TTFT_RATIO_TARGET
    return out


def _ms(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def _pct(v) -> str:
    return "-" if v is None else f"{v:.0%}"


def table(entries: list[dict]) -> str:
    rows = [["arm", "policy", "turn", "n", "TTFT p50 ms", "TTFT p90 ms", "hit rate", "perfect cache", "local prefill",
             "failed"]]
    for e in entries:
        for k, s in list(e["per_turn"].items()) + [("2..", e["later_turns"])]:
            rows.append([e.get("label", e["arm"]), e["policy"], k, str(s["n"]), _ms(s["ttft_p50_ms"]), _ms(s["ttft_p90_ms"]),
                         _pct(s["hit_rate"]), _pct(s["reusable_rate"]), _pct(s["local_prefill_share"]), str(s["failed"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i > 2 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def _print_entry(e: dict) -> None:
    s, name = e["later_turns"], f"[{e.get('label', e['arm'])} {e['policy']}]"
    print(f"{name} turns 2..: TTFT p50 {_ms(s['ttft_p50_ms'])} ms p90 {_ms(s['ttft_p90_ms'])} ms, "
          f"hit rate {_pct(s['hit_rate'])} (perfect cache {_pct(s['reusable_rate'])}), failed {s['failed']}", flush=True)
    for t in e["turns"]:
        if not t["ok"]:
            print(f"{name} conversation {t['conversation']} turn {t['turn']}: {t['error']} "
                  f"{t['error_detail']}", flush=True)


def _provenance() -> dict:
    """Where and on what the run happened: the commit (and whether the tree differed from it), the
    machine, the load beside it, the library versions."""
    root = Path(__file__).resolve().parents[1]

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    cpu = ""
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), "")
    except OSError:
        pass
    import torch

    return {"commit": git("rev-parse", "HEAD"), "tree_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "host": platform.node(), "cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "load_average_start": os.getloadavg()}


def run(args: argparse.Namespace) -> int:
    _settle(args)
    arms = _choices(args.arms, ARMS, "--arms")
    policies = _choices(args.policies, POLICIES, "--policies")
    out = {"config": dict(vars(args)), "provenance": _provenance(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    out["config"].pop("_run", None)
    t_start = time.time()
    entries = []
    # policies outside, arms inside: the two arms of the headline ratio run back to back
    # (the colocated arm has no store: once; the disaggregated arm once per store size)
    for policy in policies:
        for arm in arms:
            for store in (args.store_sizes if arm == "disaggregated" else [None]):
                entries.append(_measure(args, arm, policy, store))
    out.update(wall_s=time.time() - t_start, load_average_end=os.getloadavg(), ratios=ratios(entries), runs=entries)
    print(table(entries))
    print(tier.table(entries))
    print(json.dumps(out["ratios"], indent=1))
    print("\n".join(tier.summary_lines(out["ratios"], TTFT_RATIO_TARGET)), flush=True)
    Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    failed = sum(e["later_turns"]["failed"] + e["per_turn"].get("1", {}).get("failed", 0) for e in entries)
    return 1 if failed else 0
