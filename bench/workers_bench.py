"""`pdcluster bench workers`: one prefill and one decode worker process (one thread each)
against colocated baselines measured in the same run.

- second_token_ratio: time to the second token (the first the decode worker samples) for a
  2,048-token prompt, disaggregated (admit, prefill, transfer, join, one decode step) over
  one process doing the prefill plus one decode step (engine.LLM, max_tokens=2). Target <= 1.15.
- itl_p99_ratio: decode ITL p99 of a few streaming requests while long prompts keep arriving,
  disaggregated (prefills run in the other process) over colocated engine.LLM doing both.
  Target <= 0.3. p50 is reported too.
Each worker process runs a step loop fed through a multiprocessing pipe; token timestamps are
taken in the process that samples them (CLOCK_MONOTONIC is shared by processes on Linux).
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SECOND_TOKEN_TARGET = 1.15
ITL_P99_TARGET = 0.3


@dataclass(slots=True)
class Sizes:
    prompt_len: int = 2048
    reps: int = 3
    streams: int = 4
    stream_prompt_len: int = 64
    stream_tokens: int = 160
    long_prompt_len: int = 1536
    long_prompts: int = 6
    long_every_s: float = 0.5


QUICK = Sizes(prompt_len=512, reps=1, streams=2, stream_tokens=40, long_prompt_len=384, long_prompts=2,
              long_every_s=0.2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-bench", help="checkpoint folder or built-in name")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--transport", default="nixl", choices=["nixl", "grpc"])
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write every figure here as JSON")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not a measurement")


# ---- child processes ----------------------------------------------------------------------
def _child(role: str, conn, model: str, dtype: str, transport: str, max_batched: int) -> None:
    import torch

    torch.set_num_threads(1)
    from engine.sampling_params import SamplingParams

    engine = dict(dtype=dtype, max_num_batched_tokens=max_batched, max_num_seqs=32, detokenize=False,
                  max_model_len=4096)
    if role == "prefill":
        from prefill_worker import PrefillTask, PrefillWorker

        w = PrefillWorker(model, transport=transport, page_size=16, num_pages=600, **engine)
    elif role == "decode":
        from decode_worker import Admission, DecodeWorker

        w = DecodeWorker(model, transport=transport, page_size=32, num_pages=400, **engine)
    else:
        from engine.llm import LLM

        w = LLM(model, page_size=16, num_pages=800, **engine)
    conn.send(("ready",))
    while True:
        busy = w.has_work if role != "colocated" else w.has_unfinished_requests()
        if conn.poll(0 if busy else 0.002):
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, rid, prompt, max_tokens, desc = msg
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            if role == "prefill":
                w.submit(PrefillTask(rid, prompt, params, [desc]))
            elif role == "decode":
                adm = w.admit(rid, prompt, params)
                conn.send(("admission", rid, adm.descriptor))
            else:
                w.add_request(prompt, params, rid)
            continue
        if not busy:
            continue
        if role == "prefill":
            for r in w.step():
                conn.send(("first", r.request_id, time.monotonic()))
        elif role == "decode":
            outs = w.step()
            now = time.monotonic()
            for o in outs:
                if isinstance(o, Admission):  # a queued request got its pages
                    conn.send(("admission", o.request_id, o.descriptor))
                else:
                    conn.send(("tokens", o.request_id, now, len(o.new_token_ids), o.source.value, o.finished))
        else:
            outs = w.step()
            now = time.monotonic()
            for o in outs:
                conn.send(("tokens", o.request_id, now, len(o.new_token_ids), "colocated", o.finished))
    if hasattr(w, "close"):
        w.close()
    conn.send(("stopped",))


class Proc:
    def __init__(self, ctx, role: str, args, max_batched: int) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(role, child, str(args.model_dir), args.dtype, args.transport,
                                                     max_batched), daemon=True)
        self.proc.start()
        self.expect("ready", timeout=300)

    def expect(self, kind: str, timeout: float = 120):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no {kind} within {timeout}s")
        msg = self.conn.recv()
        assert msg[0] == kind, msg
        return msg

    def stop(self) -> None:
        try:
            self.conn.send(("stop",))
            self.conn.poll(30)
        finally:
            self.proc.join(timeout=30)
            if self.proc.is_alive():
                self.proc.kill()


class Disagg:
    """Plays the router for a prefill and a decode process; collects token timestamps."""

    def __init__(self, prefill: Proc, decode: Proc) -> None:
        self.prefill, self.decode = prefill, decode
        self.prompts: dict[str, tuple[list[int], int]] = {}
        self.times: dict[str, list[tuple[float, int, str]]] = {}
        self.done: set[str] = set()

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        self.prompts[rid] = (prompt, max_tokens)
        self.times[rid] = []
        self.decode.conn.send(("add", rid, prompt, max_tokens, None))

    def pump(self, timeout: float = 0.01) -> None:
        for p in (self.decode, self.prefill):
            while p.conn.poll(0 if p is self.prefill else timeout):
                msg = p.conn.recv()
                if msg[0] == "admission" and msg[2] is not None:
                    prompt, mt = self.prompts[msg[1]]
                    self.prefill.conn.send(("add", msg[1], prompt, mt, msg[2]))
                elif msg[0] == "tokens":
                    self.times[msg[1]].append((msg[2], msg[3], msg[4]))
                    if msg[5]:
                        self.done.add(msg[1])


class Colocated(Disagg):
    def __init__(self, proc: Proc) -> None:
        super().__init__(proc, proc)

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        self.prompts[rid] = (prompt, max_tokens)
        self.times[rid] = []
        self.decode.conn.send(("add", rid, prompt, max_tokens, None))

    def pump(self, timeout: float = 0.01) -> None:
        while self.decode.conn.poll(timeout):
            msg = self.decode.conn.recv()
            self.times[msg[1]].append((msg[2], msg[3], msg[4]))
            if msg[5]:
                self.done.add(msg[1])
            timeout = 0


def _wait(side: Disagg, rids, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not set(rids) <= side.done:
        if time.monotonic() > deadline:
            raise TimeoutError(f"unfinished: {set(rids) - side.done}")
        side.pump()


def _second_token(side: Disagg, rid: str, prompt: list[int]) -> float:
    t0 = time.monotonic()
    side.add(rid, prompt, 2)
    _wait(side, [rid])
    return side.times[rid][-1][0] - t0  # the output carrying the second token


def _itl_run(side: Disagg, tag: str, sizes: Sizes, rng: random.Random, vocab: int) -> list[float]:
    streams = [f"{tag}-s{i}" for i in range(sizes.streams)]
    for rid in streams:
        side.add(rid, _prompt(rng, sizes.stream_prompt_len, vocab), sizes.stream_tokens)
    # long prompts start arriving once every stream is decoding
    while not all(sum(n for _, n, _ in side.times[r]) >= 3 for r in streams):
        side.pump()
    longs = []
    next_at = time.monotonic()
    while len(longs) < sizes.long_prompts or not set(streams) <= side.done:
        if len(longs) < sizes.long_prompts and time.monotonic() >= next_at:
            rid = f"{tag}-long{len(longs)}"
            side.add(rid, _prompt(rng, sizes.long_prompt_len, vocab), 4)
            longs.append(rid)
            next_at += sizes.long_every_s
        side.pump(0.002)
    _wait(side, longs)
    gaps = []
    for rid in streams:
        stamps = [t for t, n, _ in side.times[rid] if n]
        gaps += [b - a for a, b in zip(stamps[2:], stamps[3:])]  # steady decode, after warm-up
    return gaps


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run(args: argparse.Namespace) -> int:
    import multiprocessing as mp
    import statistics

    import torch

    from engine.config import ModelConfig
    from engine.llm import resolve_model

    torch.set_num_threads(1)
    sizes = QUICK if args.quick else Sizes()
    args.model_dir = resolve_model(args.model)
    vocab = ModelConfig.from_pretrained(args.model_dir).vocab_size
    rng = random.Random(0)
    ctx = mp.get_context("spawn")
    print(f"workers bench: {args.model_dir} dtype={args.dtype} transport={args.transport} threads=1 "
          f"{'quick' if args.quick else 'full'}", flush=True)
    prefill = Proc(ctx, "prefill", args, 2048)
    decode = Proc(ctx, "decode", args, 2048)
    colo = Proc(ctx, "colocated", args, 2048)
    try:
        disagg, coloc = Disagg(prefill, decode), Colocated(colo)
        _second_token(disagg, "warm-d", _prompt(rng, 256, vocab))
        _second_token(coloc, "warm-c", _prompt(rng, 256, vocab))
        st_d, st_c = [], []
        for i in range(sizes.reps):
            st_d.append(_second_token(disagg, f"st-d{i}", _prompt(rng, sizes.prompt_len, vocab)))
            st_c.append(_second_token(coloc, f"st-c{i}", _prompt(rng, sizes.prompt_len, vocab)))
        gaps_d = _itl_run(disagg, "itl-d", sizes, rng, vocab)
        gaps_c = _itl_run(coloc, "itl-c", sizes, rng, vocab)
    finally:
        for p in (prefill, decode, colo):
            p.stop()
    second_d, second_c = statistics.median(st_d), statistics.median(st_c)
    result = {
        "benchmark": "workers",
        "second_token_ratio": second_d / second_c,
        "itl_p99_ratio": _pct(gaps_d, 0.99) / _pct(gaps_c, 0.99),
        "itl_p50_ratio": _pct(gaps_d, 0.5) / _pct(gaps_c, 0.5),
        "second_token_s": {"disaggregated": st_d, "colocated": st_c},
        "itl_s": {"disaggregated": {"p50": _pct(gaps_d, 0.5), "p99": _pct(gaps_d, 0.99), "n": len(gaps_d)},
                  "colocated": {"p50": _pct(gaps_c, 0.5), "p99": _pct(gaps_c, 0.99), "n": len(gaps_c)}},
        "targets": {"second_token_ratio": SECOND_TOKEN_TARGET, "itl_p99_ratio": ITL_P99_TARGET},
        "settings": {"model": str(args.model_dir), "dtype": args.dtype, "transport": args.transport,
                     "threads": 1, "quick": args.quick, "sizes": asdict(sizes), "torch": torch.__version__,
                     "python": platform.python_version()},
    }
    result["passed"] = (result["second_token_ratio"] <= SECOND_TOKEN_TARGET
                        and result["itl_p99_ratio"] <= ITL_P99_TARGET)
    rows = [(f"second token ({sizes.prompt_len}-token prompt)", second_d, second_c, result["second_token_ratio"],
             f"<= {SECOND_TOKEN_TARGET}"),
            ("decode ITL p50 under long prompts", _pct(gaps_d, 0.5), _pct(gaps_c, 0.5), result["itl_p50_ratio"], "-"),
            ("decode ITL p99 under long prompts", _pct(gaps_d, 0.99), _pct(gaps_c, 0.99), result["itl_p99_ratio"],
             f"<= {ITL_P99_TARGET}")]
    print(f"{'figure':36} {'disagg s':>10} {'coloc s':>10} {'ratio':>7}  target")
    for name, d, c, r, t in rows:
        print(f"{name:36} {d:10.4f} {c:10.4f} {r:7.3f}  {t}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
