"""`pdcluster bench chaos`: faults against a real local cluster, and what its clients see.

For each KV transport it starts a local Ray cluster of a built-in model (cluster.runtime.Cluster,
on 127.0.0.1 only) and runs scenarios against the router's gRPC endpoint:

  fuzz                  Generate requests with random values over every field of GenerateRequest
                        and SamplingParams: valid, boundary, invalid and extreme values, strings
                        that are not UTF-8 (raw bytes), garbage bytes, huge prompts, duplicate
                        request ids. Each answer is judged against the rules of docs/api.md: OK
                        for a valid request, the documented code with a message naming the field
                        for an invalid one, never UNKNOWN or INTERNAL, never a hang.
  cancel                concurrent streams the client cancels at random points (before the
                        first token, mid-stream) and client deadlines that expire mid-request.
  overflow              more concurrent requests than max_inflight + max_queue: the surplus gets
                        RESOURCE_EXHAUSTED, the rest completes.
  flood                 client processes sending oversized requests (a million token ids,
                        megabytes of text, prompts at the size limits) while this process calls
                        ModelInfo in a loop: its p50/p99 latency with and without the flood.
  http-flood            HTTP clients sending 50 MB bodies and bodies just under the cap in a loop
                        while gRPC ModelInfo and GET /v1/models are timed (bench/chaos_http.py).
  kill-prefill          kill -9 of a prefill worker while long prompts are being prefilled.
  kill-decode-transfer  kill -9 of a decode worker while long prompts' KV is on its way to it.
  kill-decode-stream    kill -9 of a decode worker while greedy streams decode on it; their
                        tokens are compared with the same requests' tokens from an
                        uninterrupted run (run first, on the healthy cluster).
  kill-router           kill -9 of the router's process while greedy streams run through it
                        (bench/chaos_router.py): the streams end UNAVAILABLE after a prefix of
                        the reference tokens, the router serves again on the same port.
  hang-decode           SIGSTOP of a decode worker for 2x router.worker_timeout_s while greedy
                        streams decode on it, then SIGCONT (bench/chaos_hang.py).
  hang-prefill          the same for a prefill worker while long prompts are being prefilled.
  http-fuzz             random requests to the HTTP API (/v1/completions, /v1/chat/completions, streamed
                        and not; random JSON in known and unknown fields, deep nesting, huge numbers,
                        lone surrogates, NUL, bodies that are not JSON, wrong content types, methods and
                        paths): a 4xx in OpenAI's error shape naming the field, or a valid 200; never a
                        5xx or a hang (bench/chaos_client.py).
  disconnect            gRPC and HTTP (streamed and not) clients that leave while queued, prefilling,
                        transferring and decoding: the router's slot free within 1 s, every page
                        within 2 s of each leave (bench/chaos_client.py).

In the kill scenarios a trickle of short requests keeps arriving from just before the kill until
the worker is back. The pid comes from ClusterStatus; Ray restarts the process and the router
warms it up: the time to recover runs from the kill to the worker's state "serving" again, and a
recovery slower than RECOVERY_TARGET_S makes the row unclean. In the hang scenarios it runs from
SIGCONT to "serving" (the same process, warmed up again).

After every scenario it waits (condition-based, bounded) until no request is in flight anywhere
and checks every worker's free_pages == total_pages (a page that only holds a prefix-cache entry
counts as free: engine/block_pool.py), and that every worker is serving.

Everything heavy (ray, torch, the cluster) is imported inside the functions that need it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import signal
import struct
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

SCENARIOS = ("fuzz", "cancel", "overflow", "flood", "http-flood", "kill-prefill", "kill-decode-transfer",
             "kill-decode-stream", "kill-router", "hang-decode", "hang-prefill", "http-fuzz", "disconnect")
GENERATE = "/pdcluster.v1.Inference/Generate"
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
CHAT_ROLES = ("system", "user", "assistant", "tool")
WATCHDOG_S = 15.0        # a call with no status this long after its own deadline is a hang
NEVER = ("UNKNOWN", "INTERNAL")  # never a right answer in any scenario
KILLS = ("kill-prefill", "kill-decode-transfer", "kill-decode-stream", "hang-decode", "hang-prefill")
RECOVERY_TARGET_S = 15.0  # a killed worker serves again within this (issue 34); slower is a failure


# ---- settings and results -----------------------------------------------------------------------
@dataclass
class ChaosSettings:
    model: str = "small"
    dtype: str = "float32"
    transport: str = "nixl"
    prefill: int = 2
    decode: int = 2
    max_model_len: int = 1024
    max_num_batched_tokens: int = 512
    max_inflight: int = 16       # router admission, small so that `overflow` can overflow it
    max_queue: int = 16
    scenarios: tuple[str, ...] = SCENARIOS
    fuzz_requests: int = 1000
    http_fuzz_requests: int = 300
    disconnect_reps: int = 2     # clients per stage and door in `disconnect`
    cancel_streams: int = 64
    overflow_factor: int = 4     # overflow sends this many times max_inflight + max_queue at once
    flood_clients: int = 3
    flood_s: float = 10.0
    baseline_s: float = 3.0      # ModelInfo without the flood, just before it
    stream_tokens: int = 400     # greedy tokens of a kill-decode-stream stream (capped by the context)
    concurrency: int = 16        # fuzz and cancel clients in flight at once
    seed: int = 0
    call_timeout_s: float = 120.0
    idle_bound_s: float = 90.0   # bound on the wait for "nothing in flight, every page free"
    recover_bound_s: float = 180.0
    worker_timeout_s: float = 10.0  # router.worker_timeout_s; the hang scenarios stop a worker for twice this
    log: Callable[[str], None] | None = None


@dataclass
class Row:
    """One scenario on one transport. A request is counted once, in exactly one of ok,
    clean_errors, wrong_codes, bad_responses, hangs, lost."""

    scenario: str
    transport: str
    tried: int = 0
    ok: int = 0              # completed, the response checked (final message, usage, lengths, logprobs)
    clean_errors: int = 0    # the expected code with a message naming the field (or the worker)
    wrong_codes: int = 0     # an unexpected code (UNKNOWN, INTERNAL, OK for an invalid request, ...) or a
                             # message that does not name the field
    bad_responses: int = 0   # OK, but the stream breaks a rule (usage, lengths, ids, logprobs)
    hangs: int = 0           # DEADLINE_EXCEEDED where no deadline was meant to expire, or no status at all
    lost: int = 0            # the stream ended with OK but without its final message
    stuck_requests: int = 0  # still in flight (router or workers) when the idle wait gave up
    leaked_pages: int = 0    # sum over workers of total_pages - free_pages after the idle wait
    killed: int = 0
    replaced: int = 0        # killed workers back in state "serving" (new pid)
    recover_s_max: float | None = None
    greedy_identical: int = 0  # greedy streams on a killed worker that completed with the reference tokens
    greedy_total: int = 0      # greedy streams on a killed worker
    crashed: str = ""        # the scenario itself failed (the suite's own error): why
    codes: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    problems: list = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.crashed or self.wrong_codes or self.bad_responses or self.hangs or self.lost
                    or self.stuck_requests or self.leaked_pages or self.replaced != self.killed
                    or (self.recover_s_max or 0.0) > RECOVERY_TARGET_S)


@dataclass
class Expect:
    """What a request may get: code -> words its message must contain one of (empty: any)."""

    codes: dict
    why: str = "valid"
    prompt_len: int | None = None
    max_tokens: int = 16
    exact_length: bool = False   # ignore_eos and no stop condition: finish "length" with max_tokens tokens
    logprobs: int | None = None
    request_id: str = ""


@dataclass
class Outcome:
    code: str = "OK"             # a grpc.StatusCode name; WATCHDOG when the call gave no status at all
    details: str = ""
    chunks: list = field(default_factory=list)
    elapsed_s: float = 0.0
    done: bool = False

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    @property
    def final(self):
        return self.chunks[-1] if self.chunks and self.chunks[-1].finish_reason else None


@dataclass
class Case:
    payload: bytes
    expect: Expect
    desc: dict
    timeout_s: float = 60.0


# ---- the command --------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    d = ChaosSettings()
    p.add_argument("--model", default=d.model, help="built-in model name or checkpoint folder (default: small)")
    p.add_argument("--dtype", default=d.dtype, help="weights and KV dtype of the workers (default: float32)")
    p.add_argument("--transport", nargs="+", choices=("nixl", "grpc"), default=["nixl", "grpc"],
                   help="KV transports to run, one cluster each (default: both)")
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS), metavar="NAME",
                   help=f"scenarios to run, in this order (default: all of {', '.join(SCENARIOS)})")
    p.add_argument("--prefill", type=int, default=d.prefill, help="prefill workers (default: 2)")
    p.add_argument("--decode", type=int, default=d.decode, help="decode workers (default: 2; kills need 2 to "
                                                                "have somewhere to go)")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len, help="engine max_model_len (default: 1024)")
    p.add_argument("--max-inflight", type=int, default=d.max_inflight, help="router max_inflight (default: 16)")
    p.add_argument("--max-queue", type=int, default=d.max_queue, help="router max_queue (default: 16)")
    p.add_argument("--fuzz-requests", type=int, default=d.fuzz_requests, help="fuzz requests (default: 1000)")
    p.add_argument("--http-fuzz-requests", type=int, default=d.http_fuzz_requests,
                   help="http-fuzz requests (default: 300)")
    p.add_argument("--cancel-streams", type=int, default=d.cancel_streams, help="cancel-storm streams (default: 64)")
    p.add_argument("--flood-clients", type=int, default=d.flood_clients, help="flooding processes (default: 3)")
    p.add_argument("--flood-seconds", type=float, default=d.flood_s, help="flood duration (default: 10)")
    p.add_argument("--stream-tokens", type=int, default=d.stream_tokens,
                   help="greedy tokens per stream in kill-decode-stream (default: 400)")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="fuzz/cancel calls in flight (default: 16)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", help="write the table, the settings, the machine and every problem found here")


def run(args: argparse.Namespace) -> int:
    for name in ("prefill", "decode", "max_model_len", "max_inflight", "fuzz_requests", "http_fuzz_requests",
                 "concurrency",
                 "flood_clients", "stream_tokens"):
        if getattr(args, name) < 1:
            print(f"pdcluster bench chaos: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.max_queue < 0 or args.cancel_streams < 0 or not args.flood_seconds > 0:
        print("pdcluster bench chaos: --max-queue and --cancel-streams must be >= 0, --flood-seconds > 0",
              file=sys.stderr)
        return 2
    rows: list[Row] = []
    started = time.monotonic()
    for transport in args.transport:
        s = ChaosSettings(model=args.model, dtype=args.dtype, transport=transport, prefill=args.prefill,
                          decode=args.decode, max_model_len=args.max_model_len, max_inflight=args.max_inflight,
                          max_queue=args.max_queue, scenarios=tuple(args.scenarios),
                          fuzz_requests=args.fuzz_requests, http_fuzz_requests=args.http_fuzz_requests,
                          cancel_streams=args.cancel_streams,
                          flood_clients=args.flood_clients, flood_s=args.flood_seconds,
                          stream_tokens=args.stream_tokens, concurrency=args.concurrency, seed=args.seed,
                          log=lambda m: print(m, file=sys.stderr, flush=True))
        rows += run_transport(s)
    print(format_table(rows))
    print(format_notes(rows))
    if args.json:
        settings = {k: v for k, v in vars(args).items() if not k.startswith("_")}
        write_json(args.json, rows, settings, time.monotonic() - started)
    return 0 if all(r.clean for r in rows) else 1


# ---- one transport: a cluster, the scenarios, stop ----------------------------------------------
def cluster_config(s: ChaosSettings):
    from cluster.config import ClusterConfig

    engine = dict(max_model_len=s.max_model_len, max_num_batched_tokens=s.max_num_batched_tokens,
                  max_num_seqs=32, page_size=16, dtype=s.dtype)
    cfg = ClusterConfig.embedded(model=s.model, prefill=s.prefill, decode=s.decode, transport=s.transport,
                                 port=0, engine=engine)
    cfg.router.max_inflight, cfg.router.max_queue = s.max_inflight, s.max_queue
    cfg.router.worker_timeout_s = s.worker_timeout_s
    if {"http-flood", "http-fuzz", "disconnect"} & set(s.scenarios):
        cfg.router.http_port = 0
    return cfg


def run_transport(s: ChaosSettings) -> list[Row]:
    """Start a local cluster for `s.transport`, run `s.scenarios` against it, stop it."""
    from cluster.runtime import Cluster

    log = s.log or (lambda m: None)
    cluster = Cluster(cluster_config(s))
    t0 = time.monotonic()
    log(f"chaos [{s.transport}]: starting {s.prefill}P+{s.decode}D of {s.model} ({s.dtype})")
    cluster.start()
    try:
        log(f"chaos [{s.transport}]: serving on {cluster.router_address} after {time.monotonic() - t0:.1f} s")
        chaos = Chaos(s, cluster.router_address)
        chaos.http_url = cluster.http_url
        return asyncio.run(chaos.run())
    finally:
        cluster.stop()


class Chaos:
    def __init__(self, s: ChaosSettings, address: str) -> None:
        self.s = s
        self.address = address
        self.log = s.log or (lambda m: None)
        self.rng = random.Random(f"{s.seed}-{s.transport}")
        self.state_noted = False

    async def run(self) -> list[Row]:
        import grpc

        from proto.pdcluster.v1 import inference_pb2 as pb
        from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc
        from router.frontend import FrontendLimits
        from router.tokenizer import RouterTokenizer
        from engine.checkpoint import find_model

        self.channels = [grpc.aio.insecure_channel(self.address) for _ in range(4)]
        self.channel = self.channels[0]
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.info = await self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)
        st = await self.status()
        self.decodes = [w.worker_id for w in st.workers if w.role in ("decode", "colocated")]
        self.prefills = [w.worker_id for w in st.workers if w.role == "prefill"]
        limits = FrontendLimits()
        self.fuzzer = Fuzzer(self.rng, self.info, RouterTokenizer(find_model(self.s.model)), self.decodes,
                             self.prefills, limits)
        rows = []
        try:
            for name in self.s.scenarios:
                row = Row(name, self.s.transport)
                t0 = time.monotonic()
                self.log(f"chaos [{self.s.transport}]: {name} ...")
                try:
                    if name.startswith("hang-"):
                        from types import SimpleNamespace

                        from bench import chaos_hang

                        self.tools = SimpleNamespace(Outcome=Outcome, generate_call=generate_call, _until=_until,
                                                     _until_async=_until_async, _worker=_worker, _cmdline=_cmdline)
                        await getattr(chaos_hang, "scenario_" + name.replace("-", "_"))(self, row)
                    else:
                        await getattr(self, "scenario_" + name.replace("-", "_"))(row)
                except Exception as exc:  # the suite's own failure: reported, the next scenario still runs
                    import traceback

                    row.crashed = f"{type(exc).__name__}: {exc}"
                    row.notes.append("".join(traceback.format_exception(exc))[-1500:])
                await self.settle(row)
                row.extra["duration_s"] = round(time.monotonic() - t0, 1)
                row.codes = dict(sorted(row.codes.items()))
                rows.append(row)
                self.log(f"chaos [{self.s.transport}]: {name}: " + _row_line(row))
        finally:
            for ch in self.channels:
                await ch.close()
        return rows

    # ---- cluster state --------------------------------------------------------------------------
    async def status(self):
        from proto.pdcluster.v1 import inference_pb2 as pb

        return await self.stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=30)

    async def settle(self, row: Row) -> None:
        """Wait until nothing is in flight and every page is free on every serving worker, then
        count what is left."""
        deadline = time.monotonic() + self.s.idle_bound_s
        while True:
            try:
                st = await self.status()
            except Exception as exc:  # the router itself: record, retry within the bound
                st, err = None, exc
            if st is not None:
                busy = _busy(st)
                leaked = sum(w.total_pages - w.free_pages for w in st.workers)
                down = [w.worker_id for w in st.workers if not w.healthy or w.state in ("replacing", "dead")]
                if not busy and not leaked and not down:
                    odd = [f"{w.worker_id} ({w.requests_placed} placed)" for w in st.workers if w.state != "serving"]
                    if odd and not self.state_noted:  # ClusterStatus should say "serving" for a worker in placement
                        self.state_noted = True
                        row.notes.append(f"healthy workers in placement report state other than 'serving': "
                                         f"{', '.join(odd)} ({_worker(st, odd[0].split()[0]).state!r})")
                    return
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        if st is None:
            row.notes.append(f"ClusterStatus failed after the scenario: {err}")
            row.stuck_requests += 1
            return
        row.stuck_requests = busy
        row.leaked_pages = leaked
        for w in st.workers:
            if w.total_pages != w.free_pages or w.running_requests or w.waiting_requests or w.transferring_requests \
                    or not w.healthy:
                row.notes.append(f"after {self.s.idle_bound_s:g} s: {w.worker_id} {w.state} healthy={w.healthy} "
                                 f"free {w.free_pages}/{w.total_pages} running {w.running_requests} waiting "
                                 f"{w.waiting_requests} transferring {w.transferring_requests} {w.error}")
        if st.inflight_requests or st.queued_requests:
            row.notes.append(f"after {self.s.idle_bound_s:g} s: the router has {st.inflight_requests} requests in "
                             f"flight and {st.queued_requests} queued")

    async def wait_replaced(self, wid: str, old_pid: int, old_restarts: int, t_kill: float) -> float | None:
        deadline = t_kill + self.s.recover_bound_s
        while time.monotonic() < deadline:
            try:
                w = _worker(await self.status(), wid)
                if w.state == "serving" and w.healthy and w.pid not in (0, old_pid) and w.restarts > old_restarts:
                    return time.monotonic() - t_kill
            except Exception:
                pass
            await asyncio.sleep(0.1)
        return None

    async def kill(self, row: Row, wid: str, sig: int = signal.SIGKILL) -> tuple[float, int, int]:
        """Send `sig` (kill -9 by default; SIGSTOP hangs it) to the worker's process, its pid from
        ClusterStatus; (time, pid, restarts before)."""
        w = _worker(await self.status(), wid)
        if not w.pid or w.node not in ("127.0.0.1", ""):
            raise RuntimeError(f"{wid} has no local pid to signal (pid {w.pid}, node {w.node!r})")
        cmd = _cmdline(w.pid)
        if "ray" not in cmd and "AsyncWorker" not in cmd:
            raise RuntimeError(f"pid {w.pid} of {wid} is not a Ray worker process: {cmd[:80]!r}")
        os.kill(w.pid, sig)
        row.killed += 1
        what = "killed" if sig == signal.SIGKILL else f"sent {signal.Signals(sig).name} to"
        self.log(f"chaos [{self.s.transport}]: {what} {wid} (pid {w.pid})")
        return time.monotonic(), w.pid, w.restarts

    async def recovered(self, row: Row, wid: str, t_kill: float, pid: int, restarts: int) -> None:
        rec = await self.wait_replaced(wid, pid, restarts, t_kill)
        if rec is None:
            row.notes.append(f"{wid} was not serving again within {self.s.recover_bound_s:g} s of its kill")
            return
        row.replaced += 1
        row.recover_s_max = round(max(row.recover_s_max or 0.0, rec), 2)
        row.extra.setdefault("recover_s", []).append(round(rec, 2))

    # ---- calls ----------------------------------------------------------------------------------
    def chan(self, i: int = 0):
        return self.channels[i % len(self.channels)]

    def judge(self, row: Row, exp: Expect, out: Outcome, desc: dict, extra_ok: Callable | None = None) -> str:
        kind, reason = classify(exp, out, self.info.vocab_size)
        row.tried += 1
        row.codes[out.code] = row.codes.get(out.code, 0) + 1
        attr = {"ok": "ok", "clean": "clean_errors", "wrong": "wrong_codes", "bad": "bad_responses",
                "hang": "hangs", "lost": "lost"}[kind]
        setattr(row, attr, getattr(row, attr) + 1)
        if kind not in ("ok", "clean"):
            _problem(row, kind, out, exp, desc, reason)
        return kind

    async def run_all(self, payloads: list[bytes], timeout_s: float | None = None) -> list[Outcome]:
        return await asyncio.gather(*(generate_call(self.chan(i), p, timeout_s or self.s.call_timeout_s)
                                      for i, p in enumerate(payloads)))

    # ---- scenarios ------------------------------------------------------------------------------
    async def scenario_fuzz(self, row: Row) -> None:
        n = self.s.fuzz_requests
        pairs = max(1, n // 100)  # a stream held open and a second request with its id
        cases = [self.fuzzer.case() for _ in range(n - 2 * pairs)]
        sem = asyncio.Semaphore(self.s.concurrency)
        covered: Counter = Counter()
        for c in cases:
            covered.update(c.desc.get("_fields", ()))
        row.extra["fields_mutated"] = dict(sorted(covered.items()))
        row.extra["expected"] = dict(Counter(_expect_label(c.expect) for c in cases).most_common())

        async def one(i: int, case: Case) -> None:
            async with sem:
                out = await generate_call(self.chan(i), case.payload, case.timeout_s)
            self.judge(row, case.expect, out, case.desc)

        async def pair(i: int) -> None:
            async with sem:
                await self.duplicate_pair(row, i)

        await asyncio.gather(*(one(i, c) for i, c in enumerate(cases)), *(pair(i) for i in range(pairs)))

    async def duplicate_pair(self, row: Row, i: int) -> None:
        from proto.pdcluster.v1 import inference_pb2 as pb

        f = self.fuzzer
        rid = f"dup-pair-{i}"
        ids = f.ids(8)
        holder = pb.GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=pb.SamplingParams(
            max_tokens=min(128, f.mml - len(ids)), temperature=0, ignore_eos=True))
        hexp = f.oracle(holder, holder.ByteSize())
        hout = Outcome()
        htask = asyncio.ensure_future(generate_call(self.chan(i), holder.SerializeToString(), 120, out=hout))
        await _until(lambda: hout.chunks or hout.done, 120)
        dup = f.base()
        dup.request_id = rid
        exp = f.oracle(dup, dup.ByteSize())
        if "OK" in exp.codes:
            exp.codes = {"ALREADY_EXISTS": ("already in flight",)}
            exp.why = "a request with the id of a stream in flight"
        out = await generate_call(self.chan(i + 1), dup.SerializeToString(), 60)
        if hout.done and "ALREADY_EXISTS" in exp.codes:  # the holder had finished: the id was free again
            exp.codes["OK"] = ()
        self.judge(row, exp, out, describe(dup) | {"note": "sent while a stream with this request_id was open"})
        await htask
        self.judge(row, hexp, hout, describe(holder))

    async def scenario_cancel(self, row: Row) -> None:
        from proto.pdcluster.v1 import inference_pb2 as pb

        f, rng = self.fuzzer, self.rng
        cycle = ("before_first", "after_first", "mid", "deadline", "complete", "before_first", "mid", "deadline")
        modes = [cycle[i % len(cycle)] for i in range(self.s.cancel_streams)]
        rng.shuffle(modes)
        landed: Counter = Counter()
        sem = asyncio.Semaphore(self.s.concurrency)

        async def one(i: int) -> None:
            mode = modes[i]
            plen = rng.choice((rng.randint(4, 64), rng.randint(f.mml // 2, f.mml * 3 // 4)))
            ids = f.ids(plen)
            # a deadline stream is long enough that its deadline (<= 1 s) expires mid-request
            mt = f.mml - plen if mode == "deadline" else min(rng.randint(16, 256), f.mml - plen)
            req = pb.GenerateRequest(prompt_token_ids=ids, sampling=pb.SamplingParams(
                max_tokens=mt, temperature=rng.choice((0.0, 0.8)), seed=rng.getrandbits(32), ignore_eos=True))
            exp = f.oracle(req, req.ByteSize())
            timeout, delay, after = self.s.call_timeout_s, None, None
            if mode == "before_first":
                delay = rng.uniform(0.0, 0.05)
                exp.codes["CANCELLED"] = ()
            elif mode == "after_first":
                after = 1
                exp.codes["CANCELLED"] = ()
            elif mode == "mid":
                after = rng.randint(2, max(2, mt - 1))
                exp.codes["CANCELLED"] = ()
            elif mode == "deadline":
                timeout = rng.uniform(0.05, 1.0)
                exp.codes["DEADLINE_EXCEEDED"] = ()
            exp.codes["RESOURCE_EXHAUSTED"] = ("admission queue is full",)  # a cancelled slot frees a moment late
            exp.why = f"cancel storm: {mode}"
            async with sem:
                out = await generate_call(self.chan(i), req.SerializeToString(), timeout, cancel_delay_s=delay,
                                          cancel_after=after)
            self.judge(row, exp, out, describe(req) | {"mode": mode, "timeout_s": round(timeout, 3)})
            when = "before the first token" if not out.chunks else "mid-stream"
            landed[f"{out.code} {when}" if out.code != "OK" else "OK"] += 1

        await asyncio.gather(*(one(i) for i in range(self.s.cancel_streams)))
        row.extra["modes"] = dict(Counter(modes))
        row.extra["outcomes"] = dict(landed.most_common())

    async def scenario_overflow(self, row: Row) -> None:
        from proto.pdcluster.v1 import inference_pb2 as pb

        f = self.fuzzer
        cap = self.s.max_inflight + self.s.max_queue
        n = self.s.overflow_factor * cap
        reqs = []
        for _ in range(n):
            ids = f.ids(self.rng.randint(4, 32))
            reqs.append(pb.GenerateRequest(prompt_token_ids=ids, sampling=pb.SamplingParams(
                max_tokens=min(64, f.mml - len(ids)), temperature=0, ignore_eos=True)))
        outs = await self.run_all([r.SerializeToString() for r in reqs], 300)
        for r, out in zip(reqs, outs):
            exp = f.oracle(r, r.ByteSize())
            exp.codes["RESOURCE_EXHAUSTED"] = ("admission queue is full",)
            exp.why = f"one of {n} at once; admission takes {cap}"
            self.judge(row, exp, out, describe(r))
        refused = sum(o.code == "RESOURCE_EXHAUSTED" for o in outs)
        row.extra.update(sent_at_once=n, admission_capacity=cap, refused=refused,
                         completed=sum(o.code == "OK" for o in outs))
        if not refused:
            row.notes.append(f"{n} requests at once did not overflow max_inflight + max_queue = {cap}")
        # and the router takes new requests right after
        after = pb.GenerateRequest(prompt_token_ids=f.ids(8), sampling=pb.SamplingParams(max_tokens=4, temperature=0,
                                                                                          ignore_eos=True))
        [out] = await self.run_all([after.SerializeToString()], 60)
        self.judge(row, f.oracle(after, after.ByteSize()), out, describe(after) | {"note": "right after the overflow"})

    async def scenario_flood(self, row: Row) -> None:
        import multiprocessing as mp

        f = self.fuzzer
        payloads = f.flood_payloads()
        row.extra["payloads"] = {name: len(p) for name, p, _ in payloads}
        idle = await asyncio.to_thread(_model_info_loop, self.address, self.s.baseline_s)
        ctx = mp.get_context("spawn")
        stop, results = ctx.Event(), ctx.Queue()
        ready = [ctx.Event() for _ in range(self.s.flood_clients)]
        procs = [ctx.Process(target=_flood_client, args=(self.address, payloads, stop, ready[i], results,
                                                         self.s.seed * 1000 + i), daemon=True)
                 for i in range(self.s.flood_clients)]
        for p in procs:
            p.start()
        try:
            await _until(lambda: all(e.is_set() for e in ready) or not any(p.is_alive() for p in procs), 120)
            flood = await asyncio.to_thread(_model_info_loop, self.address, self.s.flood_s)
        finally:
            stop.set()
        reports = []
        for _ in procs:
            try:
                reports.append(await asyncio.to_thread(results.get, True, 120))
            except Exception:
                row.notes.append("a flood client sent no report")
        for p in procs:
            await asyncio.to_thread(p.join, 30)
            if p.is_alive():
                p.terminate()
                await asyncio.to_thread(p.join, 10)
        for rep in reports:
            row.tried += rep["tried"]
            row.ok += rep["ok"]
            row.clean_errors += rep["clean"]
            row.wrong_codes += rep["wrong"]
            row.hangs += rep["hangs"]
            row.lost += rep["lost"]
            for code, n in rep["codes"].items():
                row.codes[code] = row.codes.get(code, 0) + n
            for p in rep["problems"]:
                if len(row.problems) < 50:
                    row.problems.append(p)
        for name, samples in (("idle", idle), ("flood", flood)):
            lat, errors = samples
            row.extra[f"modelinfo_{name}"] = _percentiles(lat) | {"errors": errors}
        p50 = row.extra["modelinfo_flood"].get("p50_ms")
        row.extra["target_p50_under_100ms"] = p50 is not None and p50 < 100.0
        row.notes.append(f"ModelInfo p50/p99: {_fmt_ms(row.extra['modelinfo_idle'])} without the flood, "
                         f"{_fmt_ms(row.extra['modelinfo_flood'])} during it ({self.s.flood_clients} clients, "
                         f"{row.tried} oversized requests in {self.s.flood_s:g} s)")
        if idle[1] or flood[1]:
            row.wrong_codes += idle[1] + flood[1]
            row.notes.append(f"ModelInfo failed {idle[1] + flood[1]} times")

    async def scenario_http_flood(self, row: Row) -> None:
        from bench.chaos_http import scenario_http_flood

        await scenario_http_flood(self, row)

    async def scenario_http_fuzz(self, row: Row) -> None:
        from bench.chaos_client import scenario_http_fuzz

        await scenario_http_fuzz(self, row, sys.modules[__name__])  # the suite's helpers, without an import back

    async def scenario_disconnect(self, row: Row) -> None:
        from bench.chaos_client import scenario_disconnect

        await scenario_disconnect(self, row, sys.modules[__name__])

    # ---- kills ----------------------------------------------------------------------------------
    def greedy(self, ids: list[int], max_tokens: int, pin: str = ""):
        from proto.pdcluster.v1 import inference_pb2 as pb

        return pb.GenerateRequest(prompt_token_ids=ids, decode_worker=pin, sampling=pb.SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True))

    async def references(self, row: Row, reqs: list) -> list[list[int] | None]:
        outs = await self.run_all([r.SerializeToString() for r in reqs])
        refs = []
        for r, out in zip(reqs, outs):
            if out.code == "OK" and out.final is not None and len(out.token_ids) == r.sampling.max_tokens:
                refs.append(out.token_ids)
            else:
                refs.append(None)
                row.notes.append(f"a reference request failed ({out.code}: {out.details[:120]}); not compared")
        return refs

    def bystanders(self, stop: asyncio.Event) -> asyncio.Task:
        """Short requests arriving while a worker dies and comes back: (request, outcome) pairs."""
        async def loop(k: int, done: list) -> None:
            while not stop.is_set():
                req = self.greedy(self.fuzzer.ids(self.rng.randint(4, 24)), 4)
                out = await generate_call(self.chan(k), req.SerializeToString(), 60)
                done.append((req, out))

        async def all_loops() -> list:
            done: list = []
            await asyncio.gather(*(loop(k, done) for k in range(2)))
            return done

        return asyncio.ensure_future(all_loops())

    def judge_bystanders(self, row: Row, pairs: list) -> None:
        for req, out in pairs:
            exp = self.fuzzer.oracle(req, req.ByteSize())
            exp.codes["UNAVAILABLE"] = ()
            exp.why = "a short request sent while a worker was killed and replaced"
            self.judge(row, exp, out, describe(req) | {"note": "bystander"})
        row.extra["bystanders"] = dict(Counter(o.code for _, o in pairs))

    def judge_stream(self, row: Row, req, out: Outcome, ref: list[int] | None, on_victim: bool, victim: str,
                     what: str) -> str:
        """A greedy stream through a kill: completed identical / different / a clear error."""
        exp = self.fuzzer.oracle(req, req.ByteSize())
        exp.why = what
        if on_victim:
            exp.codes["UNAVAILABLE"] = (victim, "prefill")
        kind = self.judge(row, exp, out, describe(req) | {"on_killed_worker": on_victim})
        if kind == "ok" and ref is not None:
            verdict = "completed identical" if out.token_ids == ref else "completed different"
        elif kind == "ok":
            verdict = "completed (no reference)"
        elif kind == "clean":
            verdict = "ended with a clear error"
        else:
            verdict = kind
        if on_victim:
            row.greedy_total += ref is not None
            row.greedy_identical += verdict == "completed identical"
        final = out.final
        if final is not None and getattr(final.placement, "migrations", 0):
            row.extra["migrated_streams"] = row.extra.get("migrated_streams", 0) + 1
        if final is not None and on_victim:
            ends = row.extra.setdefault("killed_worker_streams_finished_on", {})
            where = final.placement.decode_worker if victim in self.decodes else final.placement.prefill_worker
            ends[where] = ends.get(where, 0) + 1
        return verdict

    async def scenario_kill_decode_stream(self, row: Row) -> None:
        f = self.fuzzer
        victim = self.decodes[0]
        others = [d for d in self.decodes if d != victim]
        survivor = others[0] if others else ""
        specs: list[tuple[Any, str]] = []  # (request, "unpinned" | "victim" | "survivor")
        for i in range(4 + 2 + (2 if survivor else 0)):
            plen = self.rng.randint(16, 48)
            mt = min(self.s.stream_tokens, f.mml - plen)
            group = "unpinned" if i < 4 else "victim" if i < 6 else "survivor"
            pin = {"unpinned": "", "victim": victim, "survivor": survivor}[group]
            specs.append((self.greedy(f.ids(plen), mt, pin), group))
        refs = await self.references(row, [r for r, _ in specs])
        outs = [Outcome() for _ in specs]
        tasks: list[asyncio.Task] = []
        placed_on: list[str] = []
        for i, (req, group) in enumerate(specs):
            before = _placed(await self.status())
            tasks.append(asyncio.ensure_future(generate_call(self.chan(i), req.SerializeToString(),
                                                             self.s.call_timeout_s, out=outs[i])))
            if group == "unpinned":
                await _until(lambda o=outs[i]: o.chunks or o.done, 60)
                after = _placed(await self.status())
                moved = [w for w in after if w in self.decodes and after[w] > before.get(w, 0)]
                placed_on.append(moved[0] if len(moved) == 1 else "?")
            else:
                placed_on.append(req.decode_worker)
        await _until(lambda: all(len(o.chunks) >= 2 or o.done for o in outs), 120)
        if any(o.done for o in outs):
            row.notes.append(f"{sum(o.done for o in outs)} streams ended before the kill (too few --stream-tokens?)")
        stop = asyncio.Event()
        by = self.bystanders(stop)
        t_kill, pid, restarts = await self.kill(row, victim)
        row.extra["tokens_before_kill"] = [len(o.token_ids) for o in outs]
        await asyncio.gather(*tasks)
        await self.recovered(row, victim, t_kill, pid, restarts)
        stop.set()
        self.judge_bystanders(row, await by)
        verdicts: dict = {}
        for (req, group), out, ref, where in zip(specs, outs, refs, placed_on):
            on_victim = where == victim or (where == "?" and victim in out.details)
            v = self.judge_stream(row, req, out, ref, on_victim, victim, f"greedy stream ({group}) on "
                                  f"{where} while {victim} was killed mid-stream")
            key = f"{'on ' + victim if on_victim else 'elsewhere'}: {v}"
            verdicts[key] = verdicts.get(key, 0) + 1
        row.extra["streams"] = verdicts
        row.extra["placed_on"] = placed_on
        await self.post_check(row, specs[0][0], refs[0], victim)

    async def scenario_kill_router(self, row: Row) -> None:
        from bench.chaos_router import kill_router

        await kill_router(self, row, sys.modules[__name__])  # the suite's helpers, without an import back

    async def post_check(self, row: Row, req, ref: list[int] | None, pin: str) -> None:
        """The replaced worker serves the same greedy tokens."""
        if ref is None or not pin or pin not in self.decodes:
            return
        again = self.greedy(list(req.prompt_token_ids), req.sampling.max_tokens, pin)
        [out] = await self.run_all([again.SerializeToString()])
        exp = self.fuzzer.oracle(again, again.ByteSize())
        exp.why = f"the same greedy request on {pin} after its replacement"
        kind = self.judge(row, exp, out, describe(again) | {"note": "after recovery"})
        same = kind == "ok" and out.token_ids == ref
        row.extra["after_recovery_identical"] = same
        if kind == "ok" and not same:
            row.bad_responses += 1
            row.ok -= 1
            _problem(row, "bad", out, exp, describe(again), "after recovery: tokens differ from the reference")

    async def scenario_kill_decode_transfer(self, row: Row) -> None:
        f = self.fuzzer
        victim = self.decodes[0]
        survivor = next((d for d in self.decodes if d != victim), "")
        specs = []
        for i in range(6 if survivor else 4):
            plen = self.rng.randint(f.mml * 3 // 5, f.mml * 4 // 5)
            pin = victim if i < 4 else survivor
            specs.append(self.greedy(f.ids(plen), 16, pin))
        outs = [Outcome() for _ in specs]
        tasks = [asyncio.ensure_future(generate_call(self.chan(i), r.SerializeToString(), self.s.call_timeout_s,
                                                     out=outs[i])) for i, r in enumerate(specs)]
        waiting = 0

        async def kv_on_its_way() -> bool:
            nonlocal waiting
            waiting = _worker(await self.status(), victim).transferring_requests
            return waiting > 0 or all(o.done for o in outs)

        await _until_async(kv_on_its_way, 120)
        stop = asyncio.Event()
        by = self.bystanders(stop)
        t_kill, pid, restarts = await self.kill(row, victim)
        row.extra["victim_waiting_for_kv_at_kill"] = waiting
        row.extra["tokens_before_kill"] = [len(o.token_ids) for o in outs]
        await asyncio.gather(*tasks)
        await self.recovered(row, victim, t_kill, pid, restarts)
        stop.set()
        self.judge_bystanders(row, await by)
        # references now, on the recovered cluster: a reference run first would have left these
        # prompts in the prefill worker's prefix cache, and there would be no transfer to interrupt
        refs = await self.references(row, specs)
        verdicts: dict = {}
        for req, out, ref in zip(specs, outs, refs):
            on_victim = req.decode_worker == victim
            v = self.judge_stream(row, req, out, ref, on_victim, victim,
                                  f"a long prompt pinned to {req.decode_worker}, {victim} killed while KV moved")
            key = f"{'on ' + victim if on_victim else 'elsewhere'}: {v}"
            verdicts[key] = verdicts.get(key, 0) + 1
        row.extra["streams"] = verdicts

    async def busy_prefill_pool(self, row: Row, verb: str) -> tuple[list, list, list, str]:
        """Long greedy prompts sent to the prefill pool (4 a worker) and the worker seen busiest
        with them: (requests, outcomes, their tasks, that worker); prefill-0 when every prompt was
        prefilled before a busy worker was seen (a note says so)."""
        f = self.fuzzer
        specs = [self.greedy(f.ids(self.rng.randint(f.mml * 3 // 4, f.mml - 40)), 8)
                 for _ in range(4 * len(self.prefills))]
        outs = [Outcome() for _ in specs]
        tasks = [asyncio.ensure_future(generate_call(self.chan(i), r.SerializeToString(), self.s.call_timeout_s,
                                                     out=outs[i])) for i, r in enumerate(specs)]
        victim = ""

        async def prefilling() -> bool:
            nonlocal victim
            st = await self.status()
            busy = [(w.queued_tokens + w.running_requests, w.worker_id) for w in st.workers
                    if w.role == "prefill" and (w.queued_tokens or w.running_requests or w.waiting_requests)]
            if busy:
                victim = max(busy)[1]
            return bool(busy) or all(o.done for o in outs)

        await _until_async(prefilling, 120)
        if not victim:
            row.notes.append(f"every prompt was prefilled before a prefill worker was seen busy: {verb} prefill-0")
            victim = self.prefills[0]
        return specs, outs, tasks, victim

    async def judge_prefill_prompts(self, row: Row, victim: str, specs: list, outs: list, what: str) -> int:
        """Judge the long prompts of busy_prefill_pool against references run now (run first, they
        would have left the prompts in the prefix cache: nothing to interrupt); how many of them
        were prefilled again (a second attempt)."""
        refs = await self.references(row, specs)
        verdicts: dict = {}
        moved = 0
        for req, out, ref in zip(specs, outs, refs):
            final = out.final
            # on the victim: prefilled again after it failed, or ended with an error about it
            was_moved = final is not None and final.placement.attempts > 1
            on_victim = was_moved or victim in out.details or (out.code != "OK" and "prefill" in out.details)
            moved += was_moved
            v = self.judge_stream(row, req, out, ref, on_victim, victim, f"a long prompt in the prefill pool while "
                                                                           f"{victim} {what}")
            key = f"{'on ' + victim if on_victim else 'elsewhere'}: {v}"
            verdicts[key] = verdicts.get(key, 0) + 1
        row.extra["streams"] = verdicts
        return moved

    async def scenario_kill_prefill(self, row: Row) -> None:
        if not self.prefills:
            row.notes.append("no prefill pool")
            return
        specs, outs, tasks, victim = await self.busy_prefill_pool(row, "killed")
        stop = asyncio.Event()
        by = self.bystanders(stop)
        t_kill, pid, restarts = await self.kill(row, victim)
        row.extra["first_tokens_before_kill"] = sum(bool(o.chunks) for o in outs)
        await asyncio.gather(*tasks)
        await self.recovered(row, victim, t_kill, pid, restarts)
        stop.set()
        self.judge_bystanders(row, await by)
        row.extra["retried_on_another_prefill_worker"] = await self.judge_prefill_prompts(row, victim, specs, outs,
                                                                                          "was killed")


# ---- one call -----------------------------------------------------------------------------------
async def generate_call(channel, payload: bytes, timeout_s: float, *, cancel_after: int | None = None,
                        cancel_delay_s: float | None = None, out: Outcome | None = None) -> Outcome:
    """Send raw request bytes to Generate and read the stream: its chunks and its status.
    `cancel_after` chunks, or `cancel_delay_s` after the start, the client cancels the call. A call
    with no status WATCHDOG_S past its deadline is abandoned (code WATCHDOG)."""
    import grpc

    from proto.pdcluster.v1 import inference_pb2 as pb

    out = out if out is not None else Outcome()
    t0 = time.monotonic()
    call = channel.unary_stream(GENERATE, request_serializer=None,
                                response_deserializer=pb.GenerateResponse.FromString)(payload, timeout=timeout_s)

    async def consume() -> None:
        async for chunk in call:
            out.chunks.append(chunk)
            if cancel_after is not None and len(out.chunks) >= cancel_after:
                call.cancel()
                return

    task = asyncio.ensure_future(consume())
    try:
        if cancel_delay_s is not None:
            done, _ = await asyncio.wait([task], timeout=cancel_delay_s)
            if not done:
                call.cancel()
        done, _ = await asyncio.wait([task], timeout=timeout_s + WATCHDOG_S)
        if not done:
            out.code, out.details = "WATCHDOG", f"no status {WATCHDOG_S:g} s after the {timeout_s:g} s deadline"
            call.cancel()
            await asyncio.wait([task], timeout=5)
            return out
        exc = None if task.cancelled() else task.exception()
        if isinstance(exc, grpc.aio.AioRpcError):
            out.code, out.details = exc.code().name, exc.details() or ""
        elif exc is not None:
            out.code, out.details = f"CLIENT_{type(exc).__name__}", str(exc)[:300]
        else:
            code = await call.code()
            out.code, out.details = code.name, (await call.details()) or ""
        return out
    finally:
        if not task.done():
            task.cancel()
        out.elapsed_s = time.monotonic() - t0
        out.done = True


def classify(exp: Expect, out: Outcome, vocab_size: int) -> tuple[str, str]:
    """ok | clean | wrong | bad | hang | lost, and why."""
    if out.code == "WATCHDOG":
        return "hang", out.details
    if out.code == "DEADLINE_EXCEEDED" and "DEADLINE_EXCEEDED" not in exp.codes:
        return "hang", f"DEADLINE_EXCEEDED after {out.elapsed_s:.1f} s"
    if out.code == "OK":
        if "OK" not in exp.codes:
            return "wrong", f"OK, expected {_codes(exp)}"
        problem = check_response(exp, out, vocab_size)
        if problem == "lost":
            return "lost", f"the stream ended with OK after {len(out.chunks)} chunks and no final message"
        return ("bad", problem) if problem else ("ok", "")
    if out.code in NEVER or out.code not in exp.codes:
        return "wrong", f"expected {_codes(exp)}"
    words = exp.codes[out.code]
    if words and not any(w in out.details for w in words):
        return "wrong", f"the message names none of {list(words)}"
    return "clean", ""


def check_response(exp: Expect, out: Outcome, vocab_size: int) -> str:
    """'' for a well-formed completed stream, 'lost' without a final message, else the rule broken."""
    final = out.final
    if final is None:
        return "lost"
    chunks, ids = out.chunks, out.token_ids
    if any(c.finish_reason for c in chunks[:-1]):
        return "a finish_reason before the last chunk"
    rids = {c.request_id for c in chunks}
    if len(rids) != 1 or not next(iter(rids)) or (exp.request_id and rids != {exp.request_id}):
        return f"request ids {sorted(rids)[:3]} in the chunks, expected {exp.request_id or 'one assigned id'}"
    if final.finish_reason not in ("stop", "length"):
        return f"finish_reason {final.finish_reason!r}"
    u = final.usage
    if u.completion_tokens != len(ids):
        return f"usage.completion_tokens {u.completion_tokens}, {len(ids)} ids streamed"
    if exp.prompt_len is not None and u.prompt_tokens != exp.prompt_len:
        return f"usage.prompt_tokens {u.prompt_tokens}, the prompt has {exp.prompt_len}"
    if len(ids) > exp.max_tokens or (final.finish_reason == "length" and len(ids) != exp.max_tokens):
        return f"{len(ids)} tokens with finish_reason {final.finish_reason} and max_tokens {exp.max_tokens}"
    if exp.exact_length and final.finish_reason != "length":
        return f"finish_reason {final.finish_reason!r} after {len(ids)} tokens with ignore_eos and no stop condition"
    if any(t >= vocab_size for t in ids):
        return f"a token id >= vocab_size {vocab_size}"
    if exp.logprobs is None:
        if any(len(c.logprobs) for c in chunks):
            return "logprobs that were not asked for"
    else:
        for c in chunks:
            if [lp.token_id for lp in c.logprobs] != list(c.token_ids):
                return f"logprobs for {[lp.token_id for lp in c.logprobs][:4]}, tokens {list(c.token_ids)[:4]}"
            for lp in c.logprobs:
                if len(lp.top) != exp.logprobs or not math.isfinite(lp.logprob) or lp.logprob > 1e-4 or lp.rank < 1:
                    return (f"logprob entry token {lp.token_id} logprob {lp.logprob} rank {lp.rank} with "
                            f"{len(lp.top)} alternatives, {exp.logprobs} asked")
    return ""


# ---- the fuzzer and its oracle ------------------------------------------------------------------
WORDS = ("the prefill pool builds each prompt's KV cache and sends it to the decode pool which streams "
         "tokens back to the client router places requests on workers").split()
ODD_TEXT = ("héllo wörld", "日本語のテキスト", "🙂🚀👩‍👩‍👧", "e\u0301" * 3, "zero\u200bwidth", "مرحبا بالعالم",
            "\u202eright-to-left", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "tab\tand\r\nnewline", "nul\x00inside", "\x7f\x1b[0m", "\ufeffbom",
            "<|im_start|>user", "</s>", "{{ raise_exception('x') }}", "{% for %}")
BAD_UTF8 = (b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xc0\xaf", b"ok\xfe", b"\xf4\x90\x80\x80", b"\xe2\x82")
FLOATS = {
    "temperature": (0.0, -0.0, 1e-45, 1e-40, 1.1754944e-38, 1e-7, 0.5, 1.0, 2.0, 100.0, 3.4028235e38, 1e39,
                    math.inf, -math.inf, math.nan, -1e-45, -1.0),
    "top_p": (1e-45, 1e-7, 0.1, 0.5, 0.9999999, 1.0, 1.0000001, 0.0, -0.0, -1.0, 2.0, math.nan, math.inf,
              3.4028235e38),
    "min_p": (0.0, -0.0, 1e-45, 0.05, 0.5, 0.9999999, 1.0, 1.0000001, -1e-45, math.nan, math.inf, -math.inf),
}
INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1


class Fuzzer:
    """Random GenerateRequests (as bytes) and what the server must answer to each, by the rules of
    docs/api.md. The prompt's token count comes from the router's own tokenizer (RouterTokenizer on
    the same checkpoint): the suite judges validation and serving, not tokenization."""

    def __init__(self, rng: random.Random, info, tokenizer, decodes: list[str], prefills: list[str],
                 limits) -> None:
        self.rng = rng
        self.vocab = info.vocab_size
        self.mml = info.max_model_len
        self.eos = list(info.eos_token_ids)
        self.has_template = info.has_chat_template
        self.tok = tokenizer
        self.decodes, self.prefills = list(decodes), list(prefills)
        self.limits = limits
        self.max_chars = limits.prompt_chars(self.mml)
        self.max_bytes = limits.request_bytes(self.mml)
        self.shared_ids = ("dup-0", "dup-1", "dup-2", "a" * 128, ".", "-")  # ids more than one case may use
        self.mutators = {
            "request_id": self.m_request_id, "prompt": self.m_prompt, "prompt_token_ids": self.m_prompt_token_ids,
            "messages": self.m_messages, "sampling": self.m_sampling, "sampling.max_tokens": self.m_max_tokens,
            "sampling.temperature": self.m_float("temperature"), "sampling.top_p": self.m_float("top_p"),
            "sampling.top_k": self.m_top_k, "sampling.min_p": self.m_float("min_p"), "sampling.seed": self.m_seed,
            "sampling.stop": self.m_stop, "sampling.stop_token_ids": self.m_stop_token_ids,
            "sampling.ignore_eos": self.m_ignore_eos, "sampling.logprobs": self.m_logprobs,
            "decode_worker": self.m_decode_worker,
        }

    # ---- values -----------------------------------------------------------------------------
    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def text(self, words: int) -> str:
        parts = [self.rng.choice(WORDS) for _ in range(words)]
        if self.rng.random() < 0.3:
            parts.insert(self.rng.randrange(len(parts) + 1), self.rng.choice(ODD_TEXT))
        return " ".join(parts)

    def ascii_chars(self, n: int) -> str:
        base = " ".join(self.rng.choice(WORDS) for _ in range(n // 4 + 2))
        return (base * (n // max(len(base), 1) + 1))[:n]

    def base(self):
        """A valid request: one input, a few valid sampling fields, short output."""
        from proto.pdcluster.v1 import inference_pb2 as pb

        r, rng = pb.GenerateRequest(), self.rng
        kind = rng.choice(("prompt", "ids", "messages") if self.has_template else ("prompt", "ids"))
        if kind == "prompt":
            r.prompt = self.text(rng.randint(1, 30))
        elif kind == "ids":
            r.prompt_token_ids.extend(self.ids(rng.randint(1, 48)))
        else:
            for i in range(rng.randint(1, 3)):
                r.messages.add(role=rng.choice(CHAT_ROLES) if i else "user", content=self.text(rng.randint(1, 12)))
        if rng.random() < 0.85:
            s = r.sampling
            s.max_tokens = rng.randint(1, 4)
            if rng.random() < 0.4:
                s.temperature = rng.choice((0.0, 0.7, 1.0, 1.5))
            if rng.random() < 0.3:
                s.top_p = rng.choice((0.5, 0.9, 1.0))
            if rng.random() < 0.3:
                s.top_k = rng.choice((-1, 0, 1, 10, 100))
            if rng.random() < 0.3:
                s.min_p = rng.choice((0.0, 0.05, 0.2))
            if rng.random() < 0.4:
                s.seed = rng.getrandbits(63) - (1 << 62)
            if rng.random() < 0.4:
                s.ignore_eos = rng.random() < 0.7
            if rng.random() < 0.2:
                s.logprobs = rng.randint(0, 20)
            if rng.random() < 0.2:
                s.stop.extend(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
            if rng.random() < 0.15:
                s.stop_token_ids.extend(self.ids(rng.randint(1, 4)))
        if rng.random() < 0.15 and self.decodes:
            r.decode_worker = rng.choice(self.decodes)
        if rng.random() < 0.3:
            r.request_id = self.rid()
        return r

    def rid(self) -> str:
        chars = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-"
        return "fz-" + "".join(self.rng.choice(chars) for _ in range(self.rng.randint(1, 37)))

    @staticmethod
    def _set_input(r, kind: str, value, add: bool) -> None:
        if not add:
            for name in ("prompt", "prompt_token_ids", "messages"):
                r.ClearField(name)
        if kind == "prompt":
            r.prompt = value
        elif kind == "prompt_token_ids":
            r.ClearField("prompt_token_ids")
            r.prompt_token_ids.extend(value)
        else:
            r.ClearField("messages")
            for role, content in value:
                r.messages.add(role=role, content=content)

    # ---- mutators: each sets one field to a valid, boundary, invalid or extreme value ---------
    def m_request_id(self, r) -> None:
        rng = self.rng
        r.request_id = rng.choice(("", self.rid(), "a" * 129, "req 1", "ü-1", "a/b", "x\x00y", "A" * 5000,
                                   "日本", rng.choice(self.shared_ids), rng.choice(self.shared_ids)))

    def m_prompt(self, r) -> None:
        rng = self.rng
        choice = rng.randrange(12)
        value = ("", " ", "\n\n", "\x00" * 5, "🙂" * 50, "e\u0301" * 200, self.text(rng.randint(1, 200)),
                 None, None, None, None, rng.choice(ODD_TEXT))[choice]
        if choice == 7:
            value = self.ascii_chars(self.max_chars)          # at the character limit: too many tokens
        elif choice == 8:
            value = self.ascii_chars(self.max_chars + 1)      # one character over
        elif choice == 9:
            value = "x" * (4 << 20)                           # 4 MiB: over the message size limit
        elif choice == 10:
            value = "語" * self.max_chars                      # 3 bytes a character, at the limit
        self._set_input(r, "prompt", value, add=rng.random() < 0.2)

    def m_prompt_token_ids(self, r) -> None:
        rng, v, mml = self.rng, self.vocab, self.mml
        choice = rng.randrange(12)
        if choice == 0:
            value = []
        elif choice == 1:
            value = [0]
        elif choice == 2:
            value = [v - 1] * rng.randint(1, 8)
        elif choice == 3:
            value = self.ids(rng.randint(0, 20)) + [rng.choice((v, v + 1, 2 ** 31, 2 ** 32 - 1))]
            rng.shuffle(value)
        elif choice == 4:
            value = self.ids(mml - 1)
        elif choice == 5:
            value = self.ids(mml)
        elif choice == 6:
            value = self.ids(1_000_000)                        # a million ids: over the size limit
        elif choice == 7:
            value = (self.eos or [0]) * rng.randint(1, 5)
        elif choice == 8:
            value = self.ids(30_000)
        elif choice == 9:                                     # prompt + max_tokens == max_model_len, or one more
            k = rng.randint(1, 3)
            value = self.ids(mml - k)
            r.sampling.max_tokens = k + rng.choice((0, 0, 1))
        else:
            value = self.ids(rng.randint(1, 200))
        self._set_input(r, "prompt_token_ids", value, add=rng.random() < 0.2)

    def m_messages(self, r) -> None:
        rng = self.rng
        choice = rng.randrange(10)
        short = lambda: self.text(rng.randint(1, 6))  # noqa: E731
        if choice == 0:
            value = []
        elif choice == 1:
            value = [("user", short())]
        elif choice == 2:
            value = [("system", short()), ("user", short()), ("assistant", short()), ("tool", short())]
        elif choice == 3:
            value = [(rng.choice(CHAT_ROLES), "hi") for _ in range(256)]
        elif choice == 4:
            value = [("user", "hi")] * 257
        elif choice == 5:
            value = [("user", short()), (rng.choice(("", "USER", "bot", "user\x00", "ユーザー", " user")), short())]
        elif choice == 6:
            value = [("user", short()), ("assistant", "")]
        elif choice == 7:
            value = [("user", self.ascii_chars(self.max_chars + 1))]
        elif choice == 8:
            value = [("user", rng.choice(ODD_TEXT)), ("assistant", rng.choice(ODD_TEXT))]
        else:
            value = [("user", self.ascii_chars(self.max_chars // 2)), ("user", self.ascii_chars(self.max_chars // 2))]
        self._set_input(r, "messages", value, add=rng.random() < 0.2)

    def m_sampling(self, r) -> None:
        from proto.pdcluster.v1 import inference_pb2 as pb

        if self.rng.random() < 0.5:
            r.ClearField("sampling")                          # every default: 16 tokens at temperature 1
        else:
            r.sampling.CopyFrom(pb.SamplingParams())
            r.sampling.SetInParent()                          # set, with no field set

    def m_max_tokens(self, r) -> None:
        r.sampling.max_tokens = self.rng.choice((INT32_MIN, -1, 0, 1, 2, 4, 16, self.mml, INT32_MAX))

    def m_float(self, name: str):
        def mutate(r) -> None:
            setattr(r.sampling, name, self.rng.choice(FLOATS[name]))
        return mutate

    def m_top_k(self, r) -> None:
        v = self.vocab
        r.sampling.top_k = self.rng.choice((INT32_MIN, -2, -1, 0, 1, 2, 50, v - 1, v, v + 1, INT32_MAX))

    def m_seed(self, r) -> None:
        r.sampling.seed = self.rng.choice((-(2 ** 63), -1, 0, 1, 2 ** 63 - 1, self.rng.getrandbits(63)))

    def m_stop(self, r) -> None:
        r.sampling.ClearField("stop")
        r.sampling.stop.extend(self.rng.choice(
            ([], ["\n"], ["a" * 256], ["a" * 257], [""], ["x"] * 16, ["x"] * 17, ["日本", "🙂"], ["the", "pool"],
             ["a" * 100_000], [self.rng.choice(ODD_TEXT)])))

    def m_stop_token_ids(self, r) -> None:
        v = self.vocab
        r.sampling.ClearField("stop_token_ids")
        r.sampling.stop_token_ids.extend(self.rng.choice(
            ([], self.eos, [0], [v - 1], [v], [2 ** 32 - 1], self.ids(64), self.ids(65), self.ids(10_000))))

    def m_ignore_eos(self, r) -> None:
        if self.rng.random() < 0.3:
            r.sampling.ClearField("ignore_eos")
        else:
            r.sampling.ignore_eos = self.rng.random() < 0.5

    def m_logprobs(self, r) -> None:
        r.sampling.logprobs = self.rng.choice((INT32_MIN, -1, 0, 1, 5, 20, 21, INT32_MAX))

    def m_decode_worker(self, r) -> None:
        r.decode_worker = self.rng.choice(("", *self.decodes, *self.prefills, "decode-99", "x" * 5000, "décode-0",
                                           " decode-0", "DECODE-0"))

    # ---- one case -----------------------------------------------------------------------------
    def case(self) -> Case:
        rng = self.rng
        r = self.base()
        fields = rng.sample(list(self.mutators), rng.choice((0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 3)))
        for name in fields:
            self.mutators[name](r)
        if rng.random() < 0.08:
            return self.raw_case(r, fields)
        payload = r.SerializeToString()
        exp = self.oracle(r, len(payload))
        return Case(payload, exp, describe(r) | {"_fields": fields})

    def raw_case(self, r, fields: list[str]) -> Case:
        """Bytes no Python message can hold: strings that are not UTF-8, garbage, unknown fields."""
        from proto.pdcluster.v1 import inference_pb2 as pb

        rng = self.rng
        base = r.SerializeToString()
        bad = rng.choice(BAD_UTF8)
        kind = rng.choice(("request_id", "prompt", "decode_worker", "messages.role", "messages.content",
                           "sampling.stop", "garbage", "truncated", "unknown_field", "wrong_wire_type"))
        n_msgs = len(r.messages)
        path = {"request_id": (_ld(1, bad), "request_id"), "prompt": (_ld(2, bad), "prompt"),
                "decode_worker": (_ld(6, bad), "decode_worker"),
                "messages.role": (_ld(4, _ld(1, bad) + _ld(2, b"hi")), f"messages[{n_msgs}].role"),
                "messages.content": (_ld(4, _ld(1, b"user") + _ld(2, bad)), f"messages[{n_msgs}].content"),
                "sampling.stop": (_ld(5, _ld(7, bad)), "sampling.stop[")}.get(kind)
        desc = describe(r) | {"_fields": fields + [f"raw:{kind}"]}
        if path is not None:
            payload = base + path[0]
            desc["raw"] = f"appended {kind} = {bad!r} (not UTF-8)"
            if len(payload) > self.max_bytes:
                return Case(payload, self.oracle(r, len(payload)), desc)
            return Case(payload, Expect({"INVALID_ARGUMENT": (path[1],)}, why=f"{kind} is not UTF-8"), desc)
        if kind == "garbage":
            payload = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64)))
            desc = {"raw": f"random bytes {payload.hex()}", "_fields": [f"raw:{kind}"]}
        elif kind == "truncated":
            payload = base[: rng.randint(0, max(len(base) - 1, 0))]
            desc["raw"] = f"the request cut to {len(payload)} of {len(base)} bytes"
        elif kind == "unknown_field":
            payload = base + _varint(99 << 3) + _varint(rng.getrandbits(32))
            desc["raw"] = "appended field 99 (unknown, varint)"
        else:
            payload = base + _varint(2 << 3) + _varint(7)  # prompt as a varint: skipped as an unknown field
            desc["raw"] = "appended field 2 (prompt) with wire type varint"
        try:
            parsed = pb.GenerateRequest.FromString(payload)
        except Exception:
            return Case(payload, Expect({"INVALID_ARGUMENT": ("not a valid", "UTF-8")}, why="bytes that do not parse"),
                        desc)
        exp = self.oracle(parsed, len(payload))
        exp.why = f"{exp.why} (parsed from {desc['raw']})"
        desc["parsed_as"] = describe(parsed)
        return Case(payload, exp, desc)

    # ---- the oracle: docs/api.md's rules, in the order the router checks them ----------------
    def oracle(self, r, nbytes: int) -> Expect:
        def bad(words: tuple[str, ...], why: str, code: str = "INVALID_ARGUMENT") -> Expect:
            return Expect({code: words}, why=why)

        if nbytes > self.max_bytes:
            return bad(("larger than max",), f"{nbytes} bytes > the {self.max_bytes}-byte limit", "RESOURCE_EXHAUSTED")
        if r.request_id and not REQUEST_ID_RE.fullmatch(r.request_id):
            return bad(("request_id",), "request_id outside [A-Za-z0-9._:-]{1,128}")
        given = [n for n, present in (("prompt", bool(r.prompt)), ("prompt_token_ids", len(r.prompt_token_ids) > 0),
                                      ("messages", len(r.messages) > 0)) if present]
        if len(given) != 1:
            return bad(("exactly one of",), f"{len(given)} inputs set")
        limit = self.max_chars
        if given[0] == "prompt":
            if len(r.prompt) > limit:
                return bad(("prompt",), f"prompt of {len(r.prompt)} characters > {limit}")
            ids = self.tok.encode(r.prompt)
        elif given[0] == "messages":
            msgs = r.messages
            if len(msgs) > self.limits.max_messages:
                return bad(("messages",), f"{len(msgs)} messages")
            if sum(len(m.content) for m in msgs) > limit:
                return bad(("messages",), "messages' content over the character limit")
            for i, m in enumerate(msgs):
                if m.role not in CHAT_ROLES:
                    return bad((f"messages[{i}].role",), f"role {m.role!r}")
                if not m.content:
                    return bad((f"messages[{i}].content",), "empty content")
            if not self.has_template:
                return bad(("chat template",), "no chat template", "FAILED_PRECONDITION")
            try:
                rendered = self.tok.apply_chat_template([{"role": m.role, "content": m.content} for m in msgs])
            except Exception as exc:
                return bad(("messages",), f"the chat template refused them: {exc}")
            if len(rendered) > limit:
                return bad(("messages",), "rendered chat over the character limit")
            ids = self.tok.encode(rendered)
        else:
            ids = list(r.prompt_token_ids)
            if len(ids) >= self.mml:
                return bad(("max_model_len",), f"{len(ids)} prompt ids >= max_model_len")
            if max(ids) >= self.vocab:
                return bad(("prompt_token_ids[",), "a prompt id >= vocab_size")
        if not ids:
            return bad((given[0],), "no tokens")
        if len(ids) >= self.mml:
            return bad(("max_model_len",), f"{len(ids)} prompt tokens >= max_model_len")
        s = r.sampling
        mt = s.max_tokens if s.HasField("max_tokens") else self.limits.default_max_tokens
        if mt < 1:
            return bad(("sampling.max_tokens",), f"max_tokens {mt}")
        if len(ids) + mt > self.mml:
            return bad(("sampling.max_tokens",), f"{len(ids)} prompt tokens + max_tokens {mt} > max_model_len")
        for name, ok in (("temperature", lambda v: v >= 0), ("top_p", lambda v: 0 < v <= 1),
                         ("min_p", lambda v: 0 <= v <= 1)):
            if s.HasField(name):
                v = getattr(s, name)
                if not (math.isfinite(v) and ok(v)):
                    return bad((f"sampling.{name}",), f"{name} {v!r}")
        if s.HasField("top_k") and s.top_k < -1:
            return bad(("sampling.top_k",), f"top_k {s.top_k}")
        if len(s.stop) > self.limits.max_stop:
            return bad(("sampling.stop",), f"{len(s.stop)} stop strings")
        for i, st in enumerate(s.stop):
            if not st or len(st) > self.limits.max_stop_chars:
                return bad((f"sampling.stop[{i}]",), f"stop[{i}] of {len(st)} characters")
        if len(s.stop_token_ids) > self.limits.max_stop_token_ids:
            return bad(("sampling.stop_token_ids",), f"{len(s.stop_token_ids)} stop ids")
        for i, t in enumerate(s.stop_token_ids):
            if t >= self.vocab:
                return bad((f"sampling.stop_token_ids[{i}]",), f"stop id {t}")
        if s.HasField("logprobs") and not 0 <= s.logprobs <= 20:
            return bad(("sampling.logprobs",), f"logprobs {s.logprobs}")
        codes: dict = {"OK": ()}
        if r.request_id in self.shared_ids:
            codes["ALREADY_EXISTS"] = ("already in flight",)
        if r.decode_worker and r.decode_worker not in self.decodes:
            return Expect({k: v for k, v in codes.items() if k != "OK"} | {"INVALID_ARGUMENT": ("decode_worker",)},
                          why=f"decode_worker {r.decode_worker[:20]!r}")
        ignore_eos = s.HasField("ignore_eos") and s.ignore_eos
        return Expect(codes, why="valid", prompt_len=len(ids), max_tokens=mt, request_id=r.request_id,
                      exact_length=ignore_eos and not s.stop and not s.stop_token_ids,
                      logprobs=s.logprobs if s.HasField("logprobs") else None)

    # ---- the flood's payloads -----------------------------------------------------------------
    def flood_payloads(self) -> list[tuple[str, bytes, dict]]:
        from proto.pdcluster.v1 import inference_pb2 as pb

        S = pb.SamplingParams
        reqs = {
            "1M prompt ids": pb.GenerateRequest(prompt_token_ids=self.ids(1_000_000), sampling=S(max_tokens=1)),
            "4 MiB prompt": pb.GenerateRequest(prompt="x" * (4 << 20), sampling=S(max_tokens=1)),
            "prompt at the byte limit": pb.GenerateRequest(prompt="語" * ((self.max_bytes - 64) // 3)),
            "prompt one character over": pb.GenerateRequest(prompt=self.ascii_chars(self.max_chars + 1)),
            "prompt at the character limit": pb.GenerateRequest(prompt=self.ascii_chars(self.max_chars)),
            "256 messages at the limit": pb.GenerateRequest(messages=[
                pb.ChatMessage(role="user", content=self.ascii_chars(self.max_chars // 256)) for _ in range(256)]),
            "max_model_len prompt ids": pb.GenerateRequest(prompt_token_ids=self.ids(self.mml)),
            "16 stop strings of 256": pb.GenerateRequest(prompt=self.ascii_chars(self.max_chars), sampling=S(
                stop=["s" * 256] * 16)),
        }
        out = []
        for name, r in reqs.items():
            payload = r.SerializeToString()
            out.append((name, payload, self.oracle(r, len(payload)).codes))
        return out


# ---- the flood's processes and the ModelInfo loop ----------------------------------------------
def _flood_client(address: str, payloads: list, stop, ready, results, seed: int) -> None:
    """A separate process: send oversized requests until `stop`, then report what came back."""
    import grpc

    rng = random.Random(seed)
    report = {"tried": 0, "ok": 0, "clean": 0, "wrong": 0, "hangs": 0, "lost": 0, "codes": {}, "problems": []}
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)
        while not stop.is_set():
            name, payload, codes = rng.choice(payloads)
            t0 = time.monotonic()
            try:
                n = sum(1 for _ in call(payload, timeout=60))
                code, details = "OK", ""
            except grpc.RpcError as exc:
                n, code, details = 0, exc.code().name, exc.details() or ""
            ready.set()
            report["tried"] += 1
            report["codes"][code] = report["codes"].get(code, 0) + 1
            words = codes.get(code)
            if code == "DEADLINE_EXCEEDED":
                kind = "hangs"
            elif words is None or code in NEVER:
                kind = "wrong"
            elif words and not any(w in details for w in words):
                kind = "wrong"
            elif code == "OK":
                kind = "ok" if n else "lost"
            else:
                kind = "clean"
            report[kind] += 1
            if kind not in ("ok", "clean") and len(report["problems"]) < 10:
                report["problems"].append({"kind": kind, "code": code, "details": details[:300],
                                           "expected": {k: list(v) for k, v in codes.items()},
                                           "request": {"flood payload": name, "bytes": len(payload)},
                                           "elapsed_s": round(time.monotonic() - t0, 3)})
    results.put(report)


def _model_info_loop(address: str, seconds: float) -> tuple[list[float], int]:
    import grpc

    from proto.pdcluster.v1 import inference_pb2 as pb
    from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc

    lat, errors = [], 0
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)  # connected before timing
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            try:
                stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)
                lat.append(time.perf_counter() - t0)
            except grpc.RpcError:
                errors += 1
    return lat, errors


def _percentiles(lat: list[float]) -> dict:
    from bench.chaos_http import percentiles  # one definition for the gRPC and the HTTP floods

    return percentiles(lat)


def _fmt_ms(p: dict) -> str:
    return f"{p['p50_ms']:.1f}/{p['p99_ms']:.1f} ms" if p.get("samples") else "no samples"


# ---- small helpers ------------------------------------------------------------------------------
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _ld(number: int, data: bytes) -> bytes:
    """One length-delimited field of the protobuf wire format."""
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _short(v: Any) -> Any:
    if isinstance(v, str):
        return v if len(v) <= 40 else f"<{len(v)} chars: {v[:16]!r}...>"
    if isinstance(v, (list, tuple)):
        if len(v) <= 8:
            return [_short(x) for x in v]
        if all(isinstance(x, int) for x in v):
            return f"<{len(v)} ids, first {list(v[:4])}, max {max(v)}>"
        return f"<{len(v)} items, first {[_short(x) for x in v[:2]]}>"
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    return v


def describe(r) -> dict:
    """The fields a request sets, with huge values summarized (for the report)."""
    d: dict = {}
    for name in ("request_id", "prompt", "decode_worker"):
        if getattr(r, name):
            d[name] = _short(getattr(r, name))
    if len(r.prompt_token_ids):
        d["prompt_token_ids"] = _short(list(r.prompt_token_ids))
    if len(r.messages):
        d["messages"] = _short([(m.role, m.content) for m in r.messages]) if len(r.messages) <= 8 else \
            f"<{len(r.messages)} messages, first {[(_short(m.role), _short(m.content)) for m in r.messages[:2]]}>"
    if r.HasField("sampling"):
        s, sd = r.sampling, {}
        for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "logprobs"):
            if s.HasField(name):
                v = getattr(s, name)
                sd[name] = _short(v) if not isinstance(v, float) else (repr(v) if not math.isfinite(v) or (
                    v != 0 and abs(v) < 1e-30) else _f32(v))
        if len(s.stop):
            sd["stop"] = _short(list(s.stop))
        if len(s.stop_token_ids):
            sd["stop_token_ids"] = _short(list(s.stop_token_ids))
        d["sampling"] = sd
    return d


def _f32(v: float) -> float:
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return v


def _problem(row: Row, kind: str, out: Outcome, exp: Expect, desc: dict, reason: str) -> None:
    if len(row.problems) >= 50:
        row.extra["problems_left_out"] = row.extra.get("problems_left_out", 0) + 1
        return
    row.problems.append({"kind": kind, "why": reason, "code": out.code, "details": out.details[:400],
                         "expected": {k: list(v) for k, v in exp.codes.items()}, "oracle": exp.why,
                         "chunks": len(out.chunks), "elapsed_s": round(out.elapsed_s, 3),
                         "request": {k: v for k, v in desc.items() if not k.startswith("_")}})


def _codes(exp: Expect) -> str:
    return " or ".join(sorted(exp.codes)) + f" ({exp.why})"


def _expect_label(exp: Expect) -> str:
    return "+".join(sorted(exp.codes))


def _busy(st) -> int:
    return st.inflight_requests + st.queued_requests + sum(
        w.running_requests + w.waiting_requests + w.transferring_requests for w in st.workers)


def _worker(st, wid: str):
    return next(w for w in st.workers if w.worker_id == wid)


def _placed(st) -> dict[str, int]:
    return {w.worker_id: w.requests_placed for w in st.workers}


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


async def _until(predicate: Callable[[], Any], bound_s: float, interval_s: float = 0.01) -> bool:
    """Wait until `predicate()` holds (True) or `bound_s` passes (False)."""
    deadline = time.monotonic() + bound_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(interval_s)
    return True


async def _until_async(predicate, bound_s: float, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + bound_s
    while not await predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(interval_s)
    return True


# ---- the report ---------------------------------------------------------------------------------
COLUMNS = (("scenario", "scenario", 20), ("transport", "transport", 9), ("tried", "tried", 5), ("ok", "ok", 5),
           ("clean", "clean_errors", 5), ("wrong", "wrong_codes", 5), ("bad", "bad_responses", 3),
           ("hangs", "hangs", 5), ("lost", "lost", 4), ("stuck", "stuck_requests", 5),
           ("leaked", "leaked_pages", 6), ("killed", "killed", 6), ("replaced", "replaced", 8),
           ("recover_s", "recover_s_max", 9), ("greedy same", "greedy", 11))


def _cell(row: Row, attr: str) -> str:
    if attr == "greedy":
        return f"{row.greedy_identical}/{row.greedy_total}" if row.greedy_total or row.scenario in KILLS else "-"
    v = getattr(row, attr)
    if v is None:
        return "-"
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def format_table(rows: list[Row]) -> str:
    head = "  ".join(f"{title:>{w}}" if i > 1 else f"{title:<{w}}" for i, (title, _, w) in enumerate(COLUMNS))
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = [_cell(r, attr) for _, attr, _ in COLUMNS]
        lines.append("  ".join(f"{c:>{w}}" if i > 1 else f"{c:<{w}}" for i, (c, (_, _, w)) in
                               enumerate(zip(cells, COLUMNS))) + ("  CRASHED" if r.crashed else ""))
    return "\n".join(lines)


def format_notes(rows: list[Row]) -> str:
    lines = []
    for r in rows:
        head = f"{r.scenario} [{r.transport}]"
        if r.crashed:
            lines.append(f"{head}: the scenario crashed: {r.crashed}")
        for key in ("streams", "migrated_streams", "killed_worker_streams_finished_on", "bystanders", "outcomes",
                    "refused", "retried_on_another_prefill_worker"):
            if key in r.extra:
                lines.append(f"{head}: {key}: {r.extra[key]}")
        lines += [f"{head}: {n}" for n in r.notes if "Traceback" not in n]
        lines.append(f"{head}: codes {r.codes}")
        seen: Counter = Counter()
        for p in r.problems:
            sig = (p["kind"], p["code"], p.get("oracle", ""))
            seen[sig] += 1
            if seen[sig] <= 3:
                why = p.get("why", "")
                why = "" if why.startswith("expected") else f"; {why}"
                lines.append(f"{head}: {p['kind'].upper()} {p['code']}: {p['details'][:160]!r} -- expected "
                             f"{' or '.join(sorted(p['expected']))} ({p.get('oracle', '')}{why}); request "
                             f"{json.dumps(p['request'], ensure_ascii=True)[:400]}")
    return "\n".join(lines)


def _row_line(r: Row) -> str:
    return (f"{r.tried} tried, {r.ok} ok, {r.clean_errors} clean, {r.wrong_codes} wrong, {r.bad_responses} bad, "
            f"{r.hangs} hangs, {r.lost} lost, {r.stuck_requests} stuck, {r.leaked_pages} leaked pages"
            + (f", killed {r.killed} replaced {r.replaced} in {r.recover_s_max} s" if r.killed else "")
            + (f" [crashed: {r.crashed}]" if r.crashed else "") + f" ({r.extra.get('duration_s', '?')} s)")


def machine() -> dict:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "")
    except OSError:
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo") as fh:
            kb = next(int(ln.split()[1]) for ln in fh if ln.startswith("MemTotal"))
            mem_gib = round(kb / 2 ** 20, 1)
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem_gib, "platform": platform.platform(),
            "python": platform.python_version()}


def write_json(path: str, rows: list[Row], settings: dict, duration_s: float) -> None:
    doc = {"machine": machine(), "settings": settings, "duration_s": round(duration_s, 1),
           "clean": all(r.clean for r in rows), "rows": [asdict(r) for r in rows]}
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1, default=str)
