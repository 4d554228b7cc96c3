"""Time prefill and decode through a real local cluster: what a user of the endpoint sees.

The engine profile (profile.py) times bare `EngineCore` steps. A served request pays more: the
router's placement and Ray calls before the prefill, and, on every decode step, one output per
stream through the decode actor, Ray and the router, work that shares the decode process with
the engine thread. On this machine that made served decode steps ~1.7x the bare ones, which no
engine profile can predict. So, as Dynamo's profiler does, this one measures the deployment
itself with synthetic requests of controlled shapes (never the workload being predicted):

- prefill: single requests one at a time (idle cluster), prompt t new tokens after a cached
  prefix c; the served TTFT minus the engine's prefill step time is the first token's fixed
  delay (router, Ray and gRPC latency, which does not occupy the worker);
- decode: b equal streams at once; the gaps between chunks while all b decode are the served
  decode step, fitted as d0 + d1*b + d2*context like the engine's.
"""
from __future__ import annotations

import asyncio
import random
import statistics

from tqdm import tqdm

from bench.serve.workloads import Workload, WorkloadRequest
from cluster.planning.fit import fit_decode

FULL = {"prefill": ((16, 0), (128, 0), (512, 0), (1024, 0), (2048, 0), (128, 512), (512, 512)), "repeats": 3,
        "batch": (1, 2, 4, 8, 16, 32), "ctx": (64, 512), "decode_tokens": 24}
QUICK = {"prefill": ((16, 0), (128, 0), (256, 64)), "repeats": 2, "batch": (1, 2, 4), "ctx": (32,),
         "decode_tokens": 12}


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def _run(address: str, reqs: list[WorkloadRequest], concurrency: int | None):
    from bench.serve.client import run_benchmark

    records, _, _ = asyncio.run(run_benchmark(address, Workload(reqs, 0, "serving-profile"),
                                              max_concurrency=concurrency, progress=False, run_tag="profile"))
    bad = [r for r in records if not r.ok]
    if bad:
        raise RuntimeError(f"serving profile request failed: {bad[0].error} {getattr(bad[0], 'error_detail', '')}")
    return records


def measure_serving(address: str, vocab: int, quick: bool = False, seed: int = 1) -> dict:
    """Points measured against the router at `address`: prefill (t, c, served TTFT s) and
    decode (b, context, served step s)."""
    grid = QUICK if quick else FULL
    rng = random.Random(seed)
    prefill = []
    for t, c in tqdm(grid["prefill"], desc="served prefill", leave=False):
        for _ in range(grid["repeats"]):
            prefix = _ids(rng, c, vocab)
            if c:
                _run(address, [WorkloadRequest(0, 0.0, c, 1, prompt_token_ids=prefix)], 1)
            ids = prefix + _ids(rng, t, vocab)
            rec = _run(address, [WorkloadRequest(0, 0.0, len(ids), 1, prompt_token_ids=ids)], 1)[0]
            prefill.append((t, c, rec.ttft_s))
    decode = []
    k = grid["decode_tokens"]
    for b in tqdm(grid["batch"], desc="served decode", leave=False):
        for L in grid["ctx"]:
            reqs = [WorkloadRequest(i, 0.0, L, k, prompt_token_ids=_ids(rng, L, vocab)) for i in range(b)]
            records = _run(address, reqs, None)
            # the middle third of the stream: every one of the b requests is decoding then
            lo, hi = k // 3, 2 * k // 3
            gaps = [g for r in records for g in r.itls_s[lo:hi]]
            decode.append((b, b * (L + (lo + hi) // 2), statistics.median(gaps)))
    return {"prefill": prefill, "decode": decode}


def profile_serving(model: str, dtype: str, engine_lm, quick: bool = False, transport: str = "nixl") -> dict:
    """Start a 1 prefill + 1 decode cluster here, measure, stop it. Returns the points, the
    served decode fit and the first token's delay over the engine's prefill fit."""
    from bench.serve.client import model_info
    from cluster.config import ClusterConfig
    from cluster.runtime import Cluster

    cfg = ClusterConfig.embedded(model=model, prefill=1, decode=1, transport=transport, port=0,
                                 engine={"dtype": dtype})
    cluster = Cluster(cfg)
    address = cluster.start()
    try:
        info = asyncio.run(model_info(address))
        points = measure_serving(address, info.vocab_size, quick)
    finally:
        cluster.stop()
    delays = [ttft - engine_lm.prefill_time(t, c) for t, c, ttft in points["prefill"]]
    fd = fit_decode(points["decode"])
    return {"points": points, "decode_fit": fd.as_dict(), "first_token_delay_s": max(statistics.median(delays), 0.0)}
