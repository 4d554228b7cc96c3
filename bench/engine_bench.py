"""`pdcluster bench engine`: this engine against Hugging Face transformers on the same
checkpoint, dtype and thread count, measured side by side in one run.

Three figures, each a ratio ours/theirs:
  serving throughput  64 mixed requests (random token ids, ignore_eos): our continuous batching
                      with 32 sequence slots, all submitted at once, versus `generate` over
                      left-padded static batches of 32 in submission order; generated tokens/s
                      counts only each request's own max_tokens on both sides.
  decode step         batch-1, 512-token prompt: our whole `llm.step()` versus one HF forward of
                      one token with its KV cache plus argmax, at the same context lengths.
  prefill             one 1,024-token prompt: our prefill step (a fresh prompt every repeat, so no
                      prefix-cache help) versus one HF forward with `logits_to_keep=1`.
Both sides are warmed up first, then timed round by round in alternating order so that noise
from the shared machine falls on both alike; each figure is a median.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from bench._timing import Summary, timed

SEED = 0


@dataclass(slots=True, frozen=True)
class Sizes:
    num_requests: int
    prompt_len_range: tuple[int, int]  # inclusive
    max_tokens_range: tuple[int, int]  # inclusive
    max_num_seqs: int  # our sequence slots, and the HF static batch size
    serving_rounds: int
    decode_prompt_len: int
    decode_steps: int
    decode_rounds: int
    prefill_len: int
    prefill_repeats: int


FULL = Sizes(64, (32, 512), (16, 256), 32, 2, 512, 64, 3, 1024, 8)
QUICK = Sizes(12, (16, 96), (4, 24), 4, 1, 128, 8, 2, 256, 3)


@dataclass(slots=True, frozen=True)
class Figure:
    name: str
    unit: str
    ours: float
    theirs: float
    target: float
    higher_is_better: bool  # for the ratio ours/theirs

    @property
    def ratio(self) -> float:
        return self.ours / self.theirs

    @property
    def passed(self) -> bool:
        return self.ratio >= self.target if self.higher_is_better else self.ratio <= self.target


@dataclass(slots=True, frozen=True)
class ServingRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-bench",
                        help="checkpoint folder or built-in name (default: the built-in llama bench preset)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="weights and activations on both sides (default: bfloat16, AMX on this CPU)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for both sides (default: 1)")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write every figure here as JSON")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not a measurement")


def run(args: argparse.Namespace) -> int:
    if args.threads < 1:
        print(f"--threads must be >= 1, got {args.threads}", file=sys.stderr)
        return 2
    import torch
    import transformers

    from engine.llm import resolve_model

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    sizes = QUICK if args.quick else FULL
    model_dir = resolve_model(args.model)
    dtype = getattr(torch, args.dtype)
    started = _now()
    print(f"engine bench: {model_dir} dtype={args.dtype} threads={args.threads} "
          f"{'quick' if args.quick else 'full'} torch={torch.__version__} transformers={transformers.__version__}",
          flush=True)

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    vocab = hf.config.vocab_size
    pad_id = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0

    serving = _bench_serving(model_dir, args.dtype, hf, sizes, vocab, pad_id)
    decode, prefill = _bench_decode_and_prefill(model_dir, args.dtype, hf, sizes, vocab)

    figures = [serving.pop("figure"), decode.pop("figure"), prefill.pop("figure")]
    _print_table(figures)
    finished = _now()
    if args.json is not None:
        result = {
            "benchmark": "engine",
            "serving_throughput_ratio": figures[0].ratio,
            "decode_step_ratio": figures[1].ratio,
            "prefill_ratio": figures[2].ratio,
            "all_passed": all(f.passed for f in figures),
            "figures": [{**asdict(f), "ratio": f.ratio, "passed": f.passed} for f in figures],
            "serving": serving,
            "decode": decode,
            "prefill": prefill,
            "settings": {
                "model": str(model_dir), "dtype": args.dtype, "threads": args.threads, "quick": args.quick,
                "seed": SEED, "sizes": asdict(sizes), "torch": torch.__version__,
                "transformers": transformers.__version__, "python": platform.python_version(),
                "machine": platform.machine(), "cpu_count": _cpu_count(),
                "hf_attn_implementation": hf.config._attn_implementation,
            },
            "started_at": started,
            "finished_at": finished,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


# ---- 1. serving throughput ---------------------------------------------------------------------
def make_workload(sizes: Sizes, vocab: int, round_index: int) -> list[ServingRequest]:
    """Lengths and max_tokens are fixed by SEED; the token ids change every round so that a round
    never finds the previous round's prompts in our prefix cache (HF has none)."""
    shape_rng = random.Random(SEED)
    token_rng = random.Random(f"{SEED}-tokens-{round_index}")
    low_id = 3  # keep clear of the usual special ids (eos/bos/pad)
    out = []
    for _ in range(sizes.num_requests):
        n = shape_rng.randint(*sizes.prompt_len_range)
        max_tokens = shape_rng.randint(*sizes.max_tokens_range)
        out.append(ServingRequest([token_rng.randrange(low_id, vocab) for _ in range(n)], max_tokens))
    return out


def _ours_serving(llm, workload: list[ServingRequest]) -> tuple[float, list[list[int]]]:
    from engine import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in workload]
    seconds, outs = timed(lambda: llm.generate([r.prompt_token_ids for r in workload], params))
    tokens = [list(o.token_ids) for o in outs]
    for r, t in zip(workload, tokens):
        if len(t) != r.max_tokens:
            raise RuntimeError(f"engine generated {len(t)} tokens for a request with max_tokens={r.max_tokens}")
    return seconds, tokens


def _hf_serving(hf, workload: list[ServingRequest], batch_size: int, pad_id: int) -> tuple[float, list[list[int]]]:
    import torch
    from transformers import GenerationConfig

    def go() -> list[list[int]]:
        tokens: list[list[int]] = []
        for b in range(0, len(workload), batch_size):
            batch = workload[b : b + batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, r in enumerate(batch):  # left padding
                input_ids[i, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
                mask[i, width - len(r.prompt_token_ids) :] = 1
            new = max(r.max_tokens for r in batch)
            # eos_token_id=None: like ignore_eos, every batch runs its full max_new_tokens.
            config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=pad_id)
            with torch.inference_mode():
                out = hf.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
            if out.shape[1] != width + new:
                raise RuntimeError(f"HF generated {out.shape[1] - width} tokens, expected {new}")
            tokens.extend(out[i, width : width + r.max_tokens].tolist() for i, r in enumerate(batch))
        return tokens

    return timed(go)


def _bench_serving(model_dir: Path, dtype: str, hf, sizes: Sizes, vocab: int, pad_id: int) -> dict:
    from engine import LLM

    llm = LLM(model_dir, dtype=dtype, max_num_seqs=sizes.max_num_seqs, detokenize=False)
    # Warm-up: a few requests through both, so lazy init and allocator growth are not timed.
    warm = make_workload(sizes, vocab, -1)[: max(2, sizes.max_num_seqs // 4)]
    warm = [ServingRequest(r.prompt_token_ids, min(r.max_tokens, 8)) for r in warm]
    _ours_serving(llm, warm)
    _hf_serving(hf, warm, sizes.max_num_seqs, pad_id)

    ours_s, theirs_s, agree = [], [], []
    generated = 0
    for rnd in range(sizes.serving_rounds):
        workload = make_workload(sizes, vocab, rnd)
        generated = sum(r.max_tokens for r in workload)
        order = ("ours", "theirs") if rnd % 2 == 0 else ("theirs", "ours")
        results = {}
        for side in order:
            if side == "ours":
                results[side] = _ours_serving(llm, workload)
            else:
                results[side] = _hf_serving(hf, workload, sizes.max_num_seqs, pad_id)
        ours_s.append(results["ours"][0])
        theirs_s.append(results["theirs"][0])
        agree.extend(_common_prefix(a, b) / len(a) for a, b in zip(results["ours"][1], results["theirs"][1]))
        print(f"  serving round {rnd}: ours {generated / ours_s[-1]:.1f} tok/s, "
              f"transformers {generated / theirs_s[-1]:.1f} tok/s", flush=True)
    ours, theirs = Summary.of(ours_s), Summary.of(theirs_s)
    num_preemptions = llm.scheduler.num_preemptions
    del llm
    return {
        "figure": Figure("serving throughput", "generated tok/s", generated / ours.median, generated / theirs.median,
                         2.0, True),
        "generated_tokens_per_round": generated,
        "prompt_tokens_per_round": sum(len(r.prompt_token_ids) for r in make_workload(sizes, vocab, 0)),
        "ours_seconds": ours.as_dict(),
        "transformers_seconds": theirs.as_dict(),
        "ours_tokens_per_s": generated / ours.median,
        "transformers_tokens_per_s": generated / theirs.median,
        "ours_preemptions": num_preemptions,
        # Greedy tokens in bf16 drift apart once two near-tied logits round differently; this is
        # a sanity check that both sides run the same model, not a correctness test.
        "greedy_prefix_agreement_mean": sum(agree) / len(agree),
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---- 2. batch-1 decode step and 3. prefill -------------------------------------------------------
def _random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _ours_decode(llm, prompt: list[int], steps: int) -> list[float]:
    from engine import SamplingParams

    llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    llm.step()  # prefill, samples the first token
    times = []
    for _ in range(steps):
        seconds, _ = timed(llm.step)
        times.append(seconds)
    if llm.has_unfinished_requests():
        raise RuntimeError("decode request did not finish after max_tokens steps")
    return times


def _hf_decode(hf, prompt: list[int], steps: int) -> list[float]:
    import inspect

    import torch

    # transformers 5.x renamed `past_key_values` to `cache` (the old name warns); take either.
    cache_name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    times = []
    with torch.inference_mode():
        out = hf(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        past = getattr(out, cache_name)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            def one():
                out = hf(input_ids=token, use_cache=True, **{cache_name: past})
                return getattr(out, cache_name), out.logits[:, -1].argmax(-1, keepdim=True)

            seconds, (past, token) = timed(one)
            int(token)
            times.append(seconds)
    return times


def _ours_prefill(llm, prompt: list[int]) -> float:
    from engine import SamplingParams

    llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    seconds, outs = timed(llm.step)
    if len(outs) != 1 or not outs[0].finished or llm.has_unfinished_requests():
        raise RuntimeError("the prefill step did not finish the one-token request in one step")
    return seconds


def _hf_prefill(hf, prompt: list[int]) -> float:
    import torch

    input_ids = torch.tensor([prompt])

    def one() -> int:
        out = hf(input_ids=input_ids, use_cache=True, logits_to_keep=1)
        return int(out.logits[:, -1].argmax(-1))

    with torch.inference_mode():
        seconds, _ = timed(one)
    return seconds


def _bench_decode_and_prefill(model_dir: Path, dtype: str, hf, sizes: Sizes, vocab: int) -> tuple[dict, dict]:
    from engine import LLM

    llm = LLM(model_dir, dtype=dtype, max_num_batched_tokens=max(2048, sizes.prefill_len),
              enable_prefix_caching=False, detokenize=False)
    rng = random.Random(f"{SEED}-decode-prefill")

    warm = _random_prompt(rng, sizes.decode_prompt_len, vocab)
    _ours_decode(llm, warm, 4)
    _hf_decode(hf, warm, 4)
    ours_steps, theirs_steps = [], []
    for rnd in range(sizes.decode_rounds):
        prompt = _random_prompt(rng, sizes.decode_prompt_len, vocab)
        for side in (("ours", "theirs") if rnd % 2 == 0 else ("theirs", "ours")):
            if side == "ours":
                ours_steps.extend(_ours_decode(llm, prompt, sizes.decode_steps))
            else:
                theirs_steps.extend(_hf_decode(hf, prompt, sizes.decode_steps))
    ours_d, theirs_d = Summary.of(ours_steps), Summary.of(theirs_steps)
    print(f"  decode step: ours {ours_d.median * 1e3:.2f} ms, transformers {theirs_d.median * 1e3:.2f} ms", flush=True)
    decode = {
        "figure": Figure("decode step (batch 1)", "ms", ours_d.median * 1e3, theirs_d.median * 1e3, 1.1, False),
        "context_lens": [sizes.decode_prompt_len + 1, sizes.decode_prompt_len + sizes.decode_steps],
        "ours_seconds": ours_d.as_dict(),
        "transformers_seconds": theirs_d.as_dict(),
    }

    warm = _random_prompt(rng, sizes.prefill_len, vocab)
    _ours_prefill(llm, warm)
    _hf_prefill(hf, warm)
    ours_p, theirs_p = [], []
    for rep in range(sizes.prefill_repeats):
        prompt = _random_prompt(rng, sizes.prefill_len, vocab)  # fresh tokens: no cache can help
        for side in (("ours", "theirs") if rep % 2 == 0 else ("theirs", "ours")):
            if side == "ours":
                ours_p.append(_ours_prefill(llm, prompt))
            else:
                theirs_p.append(_hf_prefill(hf, prompt))
    ours_s, theirs_s = Summary.of(ours_p), Summary.of(theirs_p)
    n = sizes.prefill_len
    print(f"  prefill {n}: ours {n / ours_s.median:.0f} tok/s, transformers {n / theirs_s.median:.0f} tok/s",
          flush=True)
    prefill = {
        "figure": Figure(f"prefill {n} tokens", "tok/s", n / ours_s.median, n / theirs_s.median, 0.9, True),
        "prompt_len": n,
        "ours_seconds": ours_s.as_dict(),
        "transformers_seconds": theirs_s.as_dict(),
    }
    del llm
    return decode, prefill


# ---- report --------------------------------------------------------------------------------------
def _print_table(figures: list[Figure]) -> None:
    rows = [("figure", "unit", "ours", "transformers", "ratio", "target", "result")]
    for f in figures:
        target = f"{'>=' if f.higher_is_better else '<='} {f.target:g}"
        rows.append((f.name, f.unit, f"{f.ours:.2f}", f"{f.theirs:.2f}", f"{f.ratio:.3f}", target,
                     "pass" if f.passed else "FAIL"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for j, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _cpu_count() -> int | None:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count()
