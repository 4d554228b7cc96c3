"""`pdcluster bench decode-step`: the engine's decode step at serving batch sizes, with decode
attention in the compiled CPU kernel (`attention_backend="cpu"`, the default on a CPU) against
the torch reference backend (gather + SDPA), in one process on the same requests.

For each shape (streams, prompt tokens) one `EngineCore` takes that many requests (prompt
lengths spread +-50 % around the given one, random token ids, `ignore_eos`), prefills them,
then times `step()` in rounds that alternate the two backends (swapped on the runner: neither
keeps state across steps), so the machine's drift falls on both alike. Each figure is the
median step; the ratio is cpu / torch (below 1: the kernel is faster).

(The torch backend's cache-sized gather against one call per bucket is not measured here;
those figures are in docs/notebook/2026-12-05-decode-attention-runs.md.)
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import random
import sys
from pathlib import Path

from bench._timing import Summary, timed

DEFAULT_SHAPES = "16x400,64x400,128x400,64x1000,128x150"


def _shapes(text: str) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(x) for x in part.split("x")) for part in text.split(",")]
    except ValueError:
        out = []
    if not out or any(len(s) != 2 or s[0] < 1 or s[1] < 2 for s in out):
        raise argparse.ArgumentTypeError(f"--shapes must be STREAMSxPROMPT[,...] with STREAMS >= 1 and PROMPT >= 2, "
                                         f"got {text!r}")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="small", help="built-in preset or checkpoint folder (default small)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--shapes", type=_shapes, default=_shapes(DEFAULT_SHAPES),
                        help=f"STREAMSxPROMPT list (default {DEFAULT_SHAPES})")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds per shape (default 4)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per round and setting (default 8)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, metavar="OUT")


def _measure(model: str, dtype: str, streams: int, prompt: int, rounds: int, steps: int) -> dict:
    from engine.core import EngineCore
    from engine.sampling_params import SamplingParams

    decode_tokens = 2 * rounds * steps + 4
    core = EngineCore(model, dtype=dtype, max_num_seqs=max(streams, 1), detokenize=False,
                      enable_prefix_caching=False, max_num_batched_tokens=max(2048, prompt * 2))
    rng = random.Random(streams * 100003 + prompt)
    vocab = core.config.vocab_size
    longest = core.max_model_len - decode_tokens - 1
    total = 0
    for _ in range(streams):
        n = min(max(2, prompt + rng.randrange(-prompt // 2, prompt // 2 + 1)), longest)
        core.add_request([rng.randrange(10, vocab) for _ in range(n)],
                         SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True))
        total += n
    while core.num_computed_prompt_tokens < total:
        core.step()
    from engine.attention import cpu_ext, create_backend

    if not cpu_ext.available():
        raise SystemExit(f"this benchmark compares the CPU kernel with the torch backend: {cpu_ext.unavailable_reason()}")
    spec = core.runner.attn.spec
    backends = {"cpu": create_backend("cpu", spec), "torch": create_backend("torch", spec)}
    samples: dict[str, list[float]] = {name: [] for name in backends}
    core.step()
    for r in range(rounds):
        for name in (("cpu", "torch") if r % 2 == 0 else ("torch", "cpu")):
            core.runner.attn = backends[name]
            samples[name] += [timed(core.step)[0] for _ in range(steps)]
    core.runner.attn = backends["cpu"]
    cpu, ref = Summary.of(samples["cpu"]), Summary.of(samples["torch"])
    return {"streams": streams, "prompt": prompt, "cpu": cpu.as_dict(), "torch": ref.as_dict(),
            "ratio": cpu.median / ref.median}


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1 or args.steps < 1 or args.threads < 1:
        print("--rounds, --steps and --threads must be >= 1", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(args.threads)
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    print(f"decode step: {args.model} {args.dtype}, {args.threads} thread(s), torch {torch.__version__}, "
          f"{args.rounds} rounds x {args.steps} steps per setting", flush=True)
    print(f"{'streams':>8} {'prompt':>7} {'cpu (ms)':>10} {'torch (ms)':>11} {'ratio':>7}")
    rows = []
    for streams, prompt in args.shapes:
        row = _measure(args.model, args.dtype, streams, prompt, args.rounds, args.steps)
        rows.append(row)
        print(f"{streams:>8} {prompt:>7} {row['cpu']['median'] * 1e3:>10.1f} {row['torch']['median'] * 1e3:>11.1f} "
              f"{row['ratio']:>7.2f}", flush=True)
    if args.json is not None:
        doc = {"benchmark": "decode-step", "rows": rows, "started_at": started,
               "settings": {"model": args.model, "dtype": args.dtype, "threads": args.threads,
                            "rounds": args.rounds, "steps": args.steps, "torch": torch.__version__,
                            "python": platform.python_version(), "machine": platform.machine()}}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
