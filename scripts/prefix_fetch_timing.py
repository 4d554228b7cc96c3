"""Fetch a cached prefix from a peer, or recompute it? Side by side, in one process: two decode
workers over one transport (a holder whose prefix cache holds a prompt, a requester with an empty
cache), for a few prefix lengths. Per length, the median of `--reps` runs of:

  fetch_ms      admit with RemotePrefix(k) -> the holder's export_prefix -> the KV of the k pages
                is in the requester's pages (its connector has the event)
  recompute_ms  the requester's engine step that prefills the same k pages' tokens (cache empty)
  ttft_*_ms     admit -> first token of the whole prompt (k pages + 16 tokens), with and without
                the fetch

    PYTHONPATH=. python scripts/prefix_fetch_timing.py --model tiny --transport nixl grpc \
        --lengths 256 960 --out /tmp/prefix_fetch.json

Prints a table and writes the rows as JSON. Not a test: numbers on a shared machine are noisy,
compare only the ratios of one run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from decode_worker import DecodeConfig, DecodeWorker
from engine.builtin import ensure_builtin
from engine.outputs import RemotePrefix
from engine.sampling_params import SamplingParams
from kv_transfer.config import TransferConfig

PAGE = 16
ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def drain(*ws) -> list:
    outs = []
    while any(w.has_requests for w in ws):
        for w in ws:
            outs += w.step()
        if not any(w.has_work for w in ws):
            time.sleep(0.0002)
    return outs


def first_token_s(w, rid: str, t0: float, other) -> float:
    while True:
        for out in w.step():
            if out.request_id == rid and out.new_token_ids:
                return time.perf_counter() - t0
        other.step()


def measure(model: str, transport: str, lengths: list[int], reps: int) -> list[dict]:
    path = ensure_builtin(arch="llama", preset=model)
    cfg = TransferConfig(deadline_s=30.0)
    engine = dict(page_size=PAGE, num_pages=max(lengths) // PAGE * 3 + 16, max_num_batched_tokens=4096,
                  max_num_seqs=8, detokenize=False)
    local = DecodeConfig(local_prefill_threshold=1 << 20)  # every plain admission prefills locally
    holder = DecodeWorker(path, transport=transport, transfer_config=cfg, config=local, **engine)
    req = DecodeWorker(path, transport=transport, transfer_config=cfg, config=local, **engine)
    rows = []
    try:
        vocab = holder.core.config.vocab_size
        for n in lengths:
            k = n // PAGE
            if k * PAGE + 16 >= holder.core.max_model_len:
                print(f"{model}: {n} tokens do not fit max_model_len {holder.core.max_model_len}: skipped")
                continue
            prompt = torch.randint(0, vocab, (k * PAGE + 16,), generator=torch.Generator().manual_seed(n)).tolist()
            holder.admit(f"warm-{n}", prompt, ONE)
            drain(holder)
            fetch, recompute, ttft_fetch, ttft_plain = [], [], [], []
            for i in range(reps + 1):  # the first round warms the connections up and is dropped
                req.core.reset_prefix_cache()
                t0 = time.perf_counter()
                adm = req.admit(f"f{n}-{i}", prompt, ONE, remote_prefix=RemotePrefix(k))
                exp = holder.export_prefix(adm.prefix_fetch, prompt)
                assert exp.num_tokens == k * PAGE, exp
                while not req.connector.has_events:  # sleeping: a spin would keep the GIL from the transport
                    time.sleep(0.0001)
                t_fetch = time.perf_counter() - t0
                t_first = first_token_s(req, f"f{n}-{i}", t0, holder)
                drain(req, holder)

                req.core.reset_prefix_cache()
                req.admit(f"r{n}-{i}", prompt[:k * PAGE], ONE)  # the prefix alone: one step prefills it
                t1 = time.perf_counter()
                req.step()
                t_recompute = time.perf_counter() - t1
                drain(req)

                req.core.reset_prefix_cache()
                t2 = time.perf_counter()
                req.admit(f"p{n}-{i}", prompt, ONE)
                t_plain = first_token_s(req, f"p{n}-{i}", t2, holder)
                drain(req)
                if i:
                    fetch.append(t_fetch)
                    recompute.append(t_recompute)
                    ttft_fetch.append(t_first)
                    ttft_plain.append(t_plain)
            caches = holder.core.runner.kv_caches
            kv_bytes = k * caches[0][0].nbytes * len(caches)  # one page of every layer, K and V
            row = dict(model=model, transport=transport, prefix_tokens=k * PAGE, pages=k, kv_mib=kv_bytes / 2**20,
                       fetch_ms=1e3 * statistics.median(fetch), recompute_ms=1e3 * statistics.median(recompute),
                       ttft_fetch_ms=1e3 * statistics.median(ttft_fetch),
                       ttft_plain_ms=1e3 * statistics.median(ttft_plain))
            row["recompute_over_fetch"] = row["recompute_ms"] / row["fetch_ms"]
            rows.append(row)
            print(f"{model:5} {transport:4} {k * PAGE:5} tok {row['kv_mib']:6.2f} MiB  fetch {row['fetch_ms']:7.2f} ms  "
                  f"recompute {row['recompute_ms']:7.2f} ms  x{row['recompute_over_fetch']:5.2f}  "
                  f"TTFT fetch {row['ttft_fetch_ms']:7.2f} / plain {row['ttft_plain_ms']:7.2f} ms", flush=True)
    finally:
        holder.close()
        req.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", nargs="+", default=["tiny"])
    ap.add_argument("--transport", nargs="+", default=["nixl", "grpc"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[256, 960])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [r for m in args.model for t in args.transport for r in measure(m, t, args.lengths, args.reps)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
