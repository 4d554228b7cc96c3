"""`pdcluster demo`: the embedded default job. Builds the built-in `small` model (deterministic,
no download), runs a handful of concurrent requests through the engine with continuous
batching, and prints each answer with its TTFT, ITL and the engine's throughput.

The weights are random, so the text is gibberish; what the demo shows is the machinery.
"""
from __future__ import annotations

import argparse
import time

DEFAULT_PROMPTS = (
    "The prefill pool builds the KV cache,",
    "Disaggregated serving moves pages between machines so that",
    "Tokens per second on the decode pool depend on",
    "A request's way through the router is",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="small", help="checkpoint folder or built-in name (default: small)")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16, float16")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads (default 1: on a shared machine, contending OpenMP threads cost more than they give)",
    )
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default: four built-in ones")


def run(args: argparse.Namespace) -> int:
    import torch

    from engine import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype)
    cfg = llm.config
    print(
        f"loaded {llm.model_dir} ({cfg.architecture}, {cfg.num_layers} layers, vocab {cfg.vocab_size}) "
        f"in {time.perf_counter() - t0:.2f}s; {llm.num_pages} KV pages of {llm.page_size} tokens, "
        f"dtype {str(llm.dtype).removeprefix('torch.')}, attention {llm.runner.attn.name}"
    )
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    params = [
        SamplingParams(temperature=0, max_tokens=args.max_tokens),
        SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=args.max_tokens),
    ]
    start = time.perf_counter()
    ids = [llm.add_request(p, params[i % 2]) for i, p in enumerate(prompts)]
    token_times: dict[str, list[float]] = {rid: [] for rid in ids}
    finals = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            now = time.perf_counter()
            token_times[out.request_id].extend([now] * len(out.new_token_ids))
            if out.finished:
                finals[out.request_id] = out
    wall = time.perf_counter() - start
    total = 0
    for i, rid in enumerate(ids):
        out, times = finals[rid], token_times[rid]
        total += len(out.token_ids)
        ttft = (out.metrics.first_token_time - out.metrics.arrival_time) * 1e3
        gaps = [b - a for a, b in zip(times, times[1:])]
        itl = sum(gaps) / len(gaps) * 1e3 if gaps else float("nan")
        mode = "greedy" if params[i % 2].greedy else "sampled"
        print(f"\n[{rid}] ({mode}) {prompts[i]!r}")
        print(f"  -> {out.text!r}")
        print(f"  {len(out.token_ids)} tokens, finish={out.finish_reason}, TTFT {ttft:.1f} ms, mean ITL {itl:.1f} ms")
    print(f"\n{len(ids)} requests, {total} tokens in {wall:.2f}s: {total / wall:.1f} tokens/s; "
          f"free pages {llm.num_free_pages}/{llm.num_pages}")
    return 0
