"""`pdcluster bench tp`: tensor parallelism in the engine: prefill tokens/s and decode step time
at TP=N against TP=1, in one run on the same cores; then KV bandwidth between TP groups (P:D of
1:1, 2:1, 1:2 over nixl and grpc, bench/kv_tp_bench.py) against 1:1 in the same run.
`--quick` runs a short version of both (`--skip-engine`, `--skip-kv`: one part only).

Both engines are built first and stay up; the rounds alternate between them so that the
machine's drift (other processes on shared cores) falls on both alike. Threads: TP=1 runs
with `--threads` torch threads, each rank of TP=N with `--threads // N` (at least 1), so both
use the same cores. Per round:
- prefill: one fresh prompt of `--prompt` tokens (prefix caching off), timed from `add` to its
  first token; tokens/s = prompt / time;
- decode: `--streams` requests with ~`--prompt // 4`-token prompts, prefilled untimed, then
  `--steps` decode steps timed one by one (median).
TP=N runs with each CPU transport of `--transports` (gloo, socket: engine/parallel.py) and each
LM head of `--lm-heads`: replicated (the default: the leader computes all logits) and
vocab-parallel (each rank its rows, gathered by the leader). The LM head's time alone on
the leader (the logits of `--streams` rows, its own rows only when vocab-parallel) is printed
too.
Ratios are TP=N / TP=1 (prefill: tokens/s, above 1 is faster; decode: step time, below 1 is
faster). On a machine whose cores other processes share, TP=1 with all the threads can lose
to TP=1 with one rank's share (OpenMP threads wait on each other), so TP=1 is measured both ways.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import sys
from pathlib import Path

from bench._timing import Summary, timed


# engine options whose default --quick changes: (default, quick)
_QUICK = {"prompt": (512, 256), "rounds": (4, 2), "steps": (8, 4), "transports": ("gloo,socket", "socket"),
          "lm_heads": ("replicated,vocab", "replicated")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bench import kv_tp_bench

    parser.add_argument("--quick", action="store_true",
                        help="short run: prompt 256, 2 rounds of 4 steps, socket transport, replicated LM head; "
                             "KV 512 tokens, 2 rounds")
    parser.add_argument("--skip-engine", action="store_true", help="only the KV bandwidth between TP groups")
    parser.add_argument("--skip-kv", action="store_true", help="only the engine's TP=N vs TP=1")
    parser.add_argument("--model", default="small", help="built-in preset or checkpoint folder (default small)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size compared with 1 (default 2)")
    parser.add_argument("--prompt", type=int, default=None, help="prefill prompt tokens (default 512; --quick 256)")
    parser.add_argument("--streams", type=int, default=8, help="decoding requests (default 8)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 4; --quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps per round (default 8; --quick 4)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads of TP=1; each TP rank gets threads // tp (default: the CPUs)")
    parser.add_argument("--transports", default=None,
                        help="CPU all-reduce transports of TP=N to run, comma-separated (default gloo,socket; "
                             "--quick socket)")
    parser.add_argument("--lm-heads", default=None,
                        help="LM heads of TP=N to run: replicated, vocab (default both; --quick replicated)")
    kv_tp_bench.add_arguments(parser)
    parser.add_argument("--json", type=Path, default=None, metavar="OUT")


def resolve(args: argparse.Namespace) -> None:
    """Fill the options left unset with their default, or their --quick value."""
    from bench import kv_tp_bench

    for name, (default, quick) in _QUICK.items():
        if getattr(args, name, None) is None:
            setattr(args, name, quick if args.quick else default)
    kv_tp_bench.resolve(args)


def _engine(model: str, tp: int, vocab_parallel: bool, transport: str, args):
    from engine.core import EngineCore

    return EngineCore(model, dtype="float32", tensor_parallel_size=tp, vocab_parallel_lm_head=vocab_parallel,
                      tp_transport=transport, detokenize=False, enable_prefix_caching=False,
                      max_num_seqs=max(args.streams, 1), max_num_batched_tokens=max(2048, args.prompt))


def _step(core) -> None:
    """One engine step; a request that failed makes the figures meaningless: stop."""
    for out in core.step():
        if out.finish_reason == "error":
            raise SystemExit(f"a request failed, the run is void: {out.error}")


def _prefill(core, rng: random.Random, n: int) -> float:
    from engine.sampling_params import SamplingParams

    vocab = core.config.vocab_size
    core.add_request([rng.randrange(10, vocab) for _ in range(n)], SamplingParams(temperature=0.0, max_tokens=1))

    def run():
        while core.has_unfinished_requests():
            _step(core)

    return timed(run)[0]


def _decode(core, rng: random.Random, streams: int, prompt: int, steps: int) -> list[float]:
    from engine.sampling_params import SamplingParams

    vocab = core.config.vocab_size
    for _ in range(streams):
        core.add_request([rng.randrange(10, vocab) for _ in range(prompt)],
                         SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True))
    sched = core.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
        _step(core)  # the prefills, untimed
    samples = [timed(lambda: _step(core))[0] for _ in range(steps)]
    while core.has_unfinished_requests():
        _step(core)
    return samples


def _lm_head(core, streams: int, reps: int = 20) -> float:
    import torch

    hidden = torch.randn(streams, core.config.hidden_size)
    return Summary.of([timed(lambda: core.runner.model.compute_logits(hidden))[0] for _ in range(reps)]).median


def run(args: argparse.Namespace) -> int:
    resolve(args)
    if args.skip_engine and args.skip_kv:
        print("--skip-engine and --skip-kv leave nothing to run", file=sys.stderr)
        return 2
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    doc: dict = {"benchmark": "tp", "started_at": started}
    if not args.skip_engine:
        rc = _run_engine(args, doc)
        if rc:
            return rc
    if not args.skip_kv:
        from bench import kv_tp_bench

        print(flush=True)
        doc["kv"] = kv_tp_bench.run_kv(args)
    doc["settings"] = {**doc.get("settings", {}), "quick": args.quick, "cpus": os.cpu_count(),
                       "python": platform.python_version(), "machine": platform.machine(),
                       "processor": platform.processor()}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _run_engine(args: argparse.Namespace, doc: dict) -> int:
    if min(args.rounds, args.steps, args.threads, args.streams, args.tp - 1) < 1 or args.prompt < 2:
        print("--rounds, --steps, --threads, --streams must be >= 1, --tp >= 2, --prompt >= 2", file=sys.stderr)
        return 2
    import torch

    n, per_rank = args.tp, max(1, args.threads // args.tp)
    print(f"tensor parallel: {args.model} float32, TP={n} ({per_rank} thread(s) per rank) vs TP=1 "
          f"({args.threads} thread(s){f' and {per_rank}' if per_rank != args.threads else ''}), "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.rounds} rounds", flush=True)
    # (label, tp, threads per rank): TP=1 on all the threads, and on one rank's share of them;
    # TP=N with the LM head replicated (the default) and vocab-parallel
    configs = [("tp1", 1, args.threads)]
    if per_rank != args.threads:
        configs.append((f"tp1_{per_rank}t", 1, per_rank))
    setup = {c[0]: ("gloo", False) for c in configs}
    for transport in args.transports.split(","):
        for head in args.lm_heads.split(","):
            label = f"tp{n}_{transport}" + ("_vocab" if head == "vocab" else "")
            configs.append((label, n, per_rank))
            setup[label] = (transport, head == "vocab")
    engines = {}
    try:
        for label, tp, threads in configs:
            torch.set_num_threads(threads)  # the followers take the leader's count at start
            engines[label] = _engine(args.model, tp, setup[label][1], setup[label][0], args)
        rng = random.Random(0)
        prefill = {c[0]: [] for c in configs}
        decode = {c[0]: [] for c in configs}
        lm_head = {c[0]: [] for c in configs}
        for label, _, threads in configs:  # warm-up
            torch.set_num_threads(threads)
            _prefill(engines[label], rng, min(args.prompt, 32))
        for r in range(args.rounds):
            for label, _, threads in (configs if r % 2 == 0 else configs[::-1]):
                torch.set_num_threads(threads)
                core = engines[label]
                prefill[label].append(args.prompt / _prefill(core, rng, args.prompt))
                decode[label] += _decode(core, rng, args.streams, max(2, args.prompt // 4), args.steps)
                lm_head[label].append(_lm_head(core, args.streams))
    finally:
        for core in engines.values():
            core.close()
    torch.set_num_threads(args.threads)
    rows = {}
    print(f"{'':<24} {'prefill tok/s':>14} {'decode step ms':>15} {'LM head ms':>11}")
    for label, tp, threads in configs:
        p, d, h = Summary.of(prefill[label]), Summary.of(decode[label]), Summary.of(lm_head[label])
        rows[label] = {"tp": tp, "threads_per_rank": threads, "vocab_parallel": setup[label][1],
                       "transport": setup[label][0] if tp > 1 else None,
                       "prefill_tokens_per_s": p.as_dict(), "decode_step_s": d.as_dict(), "lm_head_s": h.as_dict()}
        name = f"TP={tp} {threads}t" + (f" {setup[label][0]}" if tp > 1 else "") + (" vocab" if setup[label][1] else "")
        print(f"{name:<24} {p.median:>14.0f} {d.median * 1e3:>15.1f} {h.median * 1e3:>11.2f}")
    # ratios of each TP=N row against each TP=1 row: prefill tokens/s (above 1: TP=N faster),
    # decode step time (below 1: TP=N faster)
    ratios = {}
    for label, tp, _ in configs:
        for base, btp, _ in configs:
            if tp == n and btp == 1:
                r = rows[label]["prefill_tokens_per_s"]["median"] / rows[base]["prefill_tokens_per_s"]["median"]
                q = rows[label]["decode_step_s"]["median"] / rows[base]["decode_step_s"]["median"]
                ratios[f"{label}/{base}"] = {"prefill_tokens_per_s": r, "decode_step_s": q}
                print(f"{label}/{base}: prefill tokens/s x{r:.2f}, decode step time x{q:.2f} ({args.streams} streams)")
    doc.update(rows=rows, ratios=ratios,
               settings={"model": args.model, "tp": n, "prompt": args.prompt, "streams": args.streams,
                         "rounds": args.rounds, "steps": args.steps, "threads": args.threads,
                         "transports": args.transports, "lm_heads": args.lm_heads, "torch": torch.__version__})
    return 0


if __name__ == "__main__":
    from cluster.cli import main

    sys.exit(main(["bench", "tp", *sys.argv[1:]]))
