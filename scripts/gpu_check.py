"""Device timings for the attention backends on the built-in `bench` model (llama, ~100M, bf16).

(i) one decode step (plan + model + logits of the sampled rows) at batch 1/8/64, context 2k,
    per backend, against the HBM floor: bytes of weights + KV read per step / HBM bandwidth;
(ii) prefill of 1,024..8,192 tokens (sequences of at most max_position_embeddings tokens)
    against the FLOP ceiling: (2 * params * tokens + causal attention FLOPs) / dense bf16 peak;
(iii) the attention kernel alone (FlashInfer wrapper `run`) vs torch SDPA on the same shapes;
(iv) the whole engine (`LLM.generate`: scheduler, runner, sampler) decoding 64 and 1 sequences,
    per step, against (i): the difference is the per-step overhead that the planner's roofline
    (`planning.roofline.Roofline.overhead_s`) guesses at 2 ms.
Rows (i) and (ii) also carry the roofline's prediction for the same shape on an H200, and its error.
Times are medians of CUDA-event timed repeats after warm-ups. Each section is guarded, so one
failure still leaves the rest of the table and the JSON.

Usage: python scripts/gpu_check.py [--json PATH] [--budget-s SECONDS]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.attention import AttentionSpec, BatchLayout, create_backend  # noqa: E402
from engine.builtin import ensure_builtin  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.model_runner import allocate_kv_caches  # noqa: E402
from planning.hardware import get_gpu  # noqa: E402
from planning.roofline import Roofline  # noqa: E402

H200_HBM_BYTES_PER_S = 4.8e12  # datasheet
H200_BF16_DENSE_FLOPS = 989e12  # datasheet, dense
PAGE_SIZE = 16
DEV = torch.device("cuda")
DTYPE = torch.bfloat16


def cuda_time(fn, warmup: int = 3, iters: int = 20) -> float:
    """Median seconds of `fn()` over `iters` CUDA-event timed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def make_layout(seq_lens: list[int], query_lens: list[int], num_decodes: int) -> BatchLayout:
    """Sequences in contiguous page runs; the new tokens are the last `query_len` of each."""
    tables, slots, first = [], [], 0
    for ctx, q in zip(seq_lens, query_lens):
        n = -(-ctx // PAGE_SIZE)
        tables.append(list(range(first, first + n)))
        slots.append(torch.arange(ctx - q, ctx) + first * PAGE_SIZE)
        first += n
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return BatchLayout(PAGE_SIZE, list(query_lens), list(seq_lens), tables, num_decodes,
                       torch.cat(slots).to(DEV), qsl.to(DEV), DEV)


class Bench:
    def __init__(self, budget_s: float) -> None:
        self.deadline = time.monotonic() + budget_s
        self.model_dir = ensure_builtin("llama", "bench")
        self.cfg = cfg = ModelConfig.from_pretrained(self.model_dir)
        self.max_len = cfg.max_position_embeddings
        self.model = load_model(self.model_dir, cfg, DTYPE, DEV, max_positions=self.max_len)
        self.params = sum(p.numel() for p in self.model.parameters())
        self.embed_params = self.model.embed_tokens.weight.numel()
        self.spec = AttentionSpec(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, PAGE_SIZE, DTYPE, DEV, cfg.head_dim**-0.5)
        self.results: dict = {
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": str(self.model_dir.name),
            "params": self.params, "layers": cfg.num_layers, "heads": [cfg.num_heads, cfg.num_kv_heads, cfg.head_dim],
            "hbm_bytes_per_s": H200_HBM_BYTES_PER_S, "bf16_dense_flops": H200_BF16_DENSE_FLOPS,
            "decode": [], "prefill": [], "kernel": [], "engine": [], "errors": [],
        }
        self.roofline = Roofline(cfg, get_gpu("H200"))
        try:
            import flashinfer

            self.results["flashinfer"] = getattr(flashinfer, "__version__", "unknown")
        except ImportError:
            self.results["flashinfer"] = None
        self.backends = ["torch"] + (["flashinfer"] if self.results["flashinfer"] else [])
        self._attn: dict = {}

    def attn(self, name):
        if name not in self._attn:
            self._attn[name] = create_backend(name, self.spec)
        return self._attn[name]

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def guarded(self, what: str, fn) -> None:
        if self.out_of_time():
            self.results["errors"].append(f"{what}: skipped, out of time budget")
            return
        try:
            fn()
        except Exception as e:  # keep going: a table with holes beats no table
            traceback.print_exc()
            self.results["errors"].append(f"{what}: {type(e).__name__}: {e}")

    def kv_bytes(self, tokens: int) -> int:
        c = self.cfg
        return tokens * 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2

    def step(self, name: str, layout: BatchLayout, ids, positions, caches, sample_rows):
        attn = self.attn(name)

        def run():
            attn.plan(layout)
            hidden = self.model(ids, positions, attn, caches)
            self.model.compute_logits(hidden[sample_rows])

        t0 = time.monotonic()
        run()  # first call: FlashInfer JIT-compiles its kernels here
        torch.cuda.synchronize()
        first_s = time.monotonic() - t0
        return cuda_time(run), first_s

    def decode(self, batch: int, context: int = 2048) -> None:
        layout = make_layout([context] * batch, [1] * batch, batch)
        caches = allocate_kv_caches(self.cfg, sum(len(t) for t in layout.block_tables), PAGE_SIZE, DTYPE, DEV)
        for c in caches:
            c.normal_()
        ids = torch.randint(0, self.cfg.vocab_size, (batch,), device=DEV)
        positions = torch.full((batch,), context - 1, device=DEV)
        weight_bytes = (self.params - self.embed_params) * 2 + batch * self.cfg.hidden_size * 2
        floor = (weight_bytes + self.kv_bytes(batch * context)) / H200_HBM_BYTES_PER_S
        row = {"batch": batch, "context": context, "hbm_floor_s": floor,
               "roofline_s": self.roofline.decode_time(batch, batch * context)}
        for name in self.backends:
            t, first = self.step(name, layout, ids, positions, caches, list(range(batch)))
            row[f"{name}_s"], row[f"{name}_first_call_s"], row[f"{name}_of_floor"] = t, first, floor / t
        self.results["decode"].append(row)

    def prefill(self, tokens: int) -> None:
        seq = min(tokens, self.max_len)
        lens = [seq] * (tokens // seq)
        layout = make_layout(lens, lens, 0)
        caches = allocate_kv_caches(self.cfg, sum(len(t) for t in layout.block_tables), PAGE_SIZE, DTYPE, DEV)
        ids = torch.randint(0, self.cfg.vocab_size, (tokens,), device=DEV)
        positions = torch.cat([torch.arange(n) for n in lens]).to(DEV)
        c = self.cfg
        attn_flops = c.num_layers * sum(2 * c.num_heads * c.head_dim * n * n for n in lens)  # causal QK^T + PV
        flops = 2 * (self.params - self.embed_params) * tokens + attn_flops
        ceiling = flops / H200_BF16_DENSE_FLOPS
        rows = list(torch.tensor(lens).cumsum(0).sub(1).tolist())
        row = {"tokens": tokens, "seq_len": seq, "flops": flops, "flop_ceiling_s": ceiling,
               "roofline_s": sum(self.roofline.prefill_time(n) for n in lens) - (len(lens) - 1) * (
                   self.roofline.overhead_s + 4 * c.num_layers * self.roofline.gemm_launch_s)}
        for name in self.backends:
            t, first = self.step(name, layout, ids, positions, caches, rows)
            row[f"{name}_s"], row[f"{name}_first_call_s"] = t, first
            row[f"{name}_tflops"], row[f"{name}_of_ceiling"] = flops / t / 1e12, ceiling / t
        self.results["prefill"].append(row)

    def kernel(self, kind: str, batch: int, q_len: int, context: int) -> None:
        """Attention of one layer alone: FlashInfer wrapper run vs torch SDPA on dense K/V."""
        c = self.cfg
        hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        layout = make_layout([context] * batch, [q_len] * batch, batch if q_len == 1 else 0)
        cache = torch.randn(sum(len(t) for t in layout.block_tables), 2, PAGE_SIZE, hkv, d, dtype=DTYPE, device=DEV)
        q = torch.randn(batch * q_len, hq, d, dtype=DTYPE, device=DEV)
        k = torch.randn(batch, hkv, context, d, dtype=DTYPE, device=DEV)
        v = torch.randn_like(k)
        qd = q.view(batch, q_len, hq, d).transpose(1, 2)
        causal = q_len > 1
        sdpa = cuda_time(lambda: F.scaled_dot_product_attention(qd, k, v, is_causal=causal, enable_gqa=True))
        row = {"kind": kind, "batch": batch, "q_len": q_len, "context": context, "sdpa_s": sdpa}
        kv_read = batch * context * 2 * hkv * d * 2
        row["sdpa_gb_per_s"] = kv_read / sdpa / 1e9
        if "flashinfer" in self.backends:
            fi = self.attn("flashinfer")
            fi.plan(layout)
            wrapper = fi.decode_wrapper if q_len == 1 else fi.prefill_wrapper
            t = cuda_time(lambda: wrapper.run(q, cache))
            row.update(flashinfer_s=t, flashinfer_gb_per_s=kv_read / t / 1e9, sdpa_over_flashinfer=sdpa / t)
        self.results["kernel"].append(row)


    def engine(self, batch: int, prompt_len: int = 512, out_len: int = 128) -> None:
        """Decode time per step of the whole engine: generate(out_len) minus generate(1), over out_len - 1."""
        from engine import LLM, SamplingParams

        gen = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(3, self.cfg.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
        row = {"batch": batch, "prompt_len": prompt_len, "out_len": out_len}
        for name in self.backends:
            # no prefix caching: the second generate of the same prompts must prefill them again
            llm = LLM(self.model_dir, dtype=DTYPE, device=DEV, attention_backend=name, enable_prefix_caching=False)
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
            times = {}
            for n in (1, out_len):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                torch.cuda.synchronize()
                times[n] = time.perf_counter() - t0
            step = (times[out_len] - times[1]) / (out_len - 1)
            row[f"{name}_step_s"], row[f"{name}_prefill_s"] = step, times[1]
            del llm
            torch.cuda.empty_cache()
        self.results["engine"].append(row)


def print_table(r: dict) -> None:
    print(f"\n== gpu_check: {r['device']}, torch {r['torch']}, flashinfer {r['flashinfer']}, "
          f"{r['model']} ({r['params'] / 1e6:.0f}M params)")
    print("\n(i) decode step, context 2k            floor    torch (x floor)       flashinfer (x floor)  roofline")
    for d in r["decode"]:
        fi = f"{d['flashinfer_s'] * 1e3:8.3f} ms ({d['flashinfer_s'] / d['hbm_floor_s']:5.1f}x)" if "flashinfer_s" in d else "-"
        print(f"    batch {d['batch']:3d}                     {d['hbm_floor_s'] * 1e3:7.3f} ms "
              f"{d['torch_s'] * 1e3:8.3f} ms ({d['torch_s'] / d['hbm_floor_s']:5.1f}x)  {fi}  {d['roofline_s'] * 1e3:7.3f} ms")
    print("\n(ii) prefill                           ceiling  torch (TFLOP/s)       flashinfer (TFLOP/s)  roofline")
    for p in r["prefill"]:
        fi = f"{p['flashinfer_s'] * 1e3:8.3f} ms ({p['flashinfer_tflops']:5.0f})" if "flashinfer_s" in p else "-"
        print(f"    {p['tokens']:5d} tokens (seq {p['seq_len']:4d})       {p['flop_ceiling_s'] * 1e3:7.3f} ms "
              f"{p['torch_s'] * 1e3:8.3f} ms ({p['torch_tflops']:5.0f})  {fi}  {p['roofline_s'] * 1e3:7.3f} ms")
    print("\n(iii) attention kernel, one layer       SDPA (GB/s of KV)     flashinfer (GB/s)     SDPA/flashinfer")
    for k in r["kernel"]:
        fi = (f"{k['flashinfer_s'] * 1e6:8.1f} us ({k['flashinfer_gb_per_s']:6.0f})   {k['sdpa_over_flashinfer']:5.2f}x"
              if "flashinfer_s" in k else "-")
        print(f"    {k['kind']:7s} b{k['batch']:<3d} q{k['q_len']:<5d} ctx {k['context']:5d}  "
              f"{k['sdpa_s'] * 1e6:8.1f} us ({k['sdpa_gb_per_s']:6.0f})  {fi}")
    print("\n(iv) whole engine, 512-token prompts   per decode step (ms)    prefill of the batch (ms)")
    for e in r["engine"]:
        cols = "  ".join(f"{k[:-7]} {e[k] * 1e3:8.3f}" for k in e if k.endswith("_step_s"))
        pre = "  ".join(f"{k[:-10]} {e[k] * 1e3:8.1f}" for k in e if k.endswith("_prefill_s"))
        print(f"    batch {e['batch']:3d}                    {cols}    {pre}")
    for e in r["errors"]:
        print(f"  ! {e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting new sections after this long")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check.py needs a CUDA device", file=sys.stderr)
        return 2
    b = Bench(args.budget_s)
    for batch in (1, 8, 64):
        b.guarded(f"decode batch {batch}", lambda: b.decode(batch))
    for tokens in (1024, 2048, 4096, 8192):
        b.guarded(f"prefill {tokens}", lambda: b.prefill(tokens))
    b.guarded("kernel decode", lambda: b.kernel("decode", 64, 1, 2048))
    b.guarded("kernel decode", lambda: b.kernel("decode", 1, 1, 8192))
    b.guarded("kernel prefill", lambda: b.kernel("prefill", 1, 4096, 4096))
    for batch in (64, 1):
        b.guarded(f"engine batch {batch}", lambda: b.engine(batch))
    print_table(b.results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(b.results, indent=1))
        print(f"\nwrote {args.json}")
    return 1 if b.results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
