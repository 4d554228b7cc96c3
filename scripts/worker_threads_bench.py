"""Batch-1 decode tokens/s of a lone colocated worker on a real local Ray, by reserved CPUs (its
torch threads: cluster.config.ResourceShape.threads), alternating the settings in one run.

    PYTHONPATH=. python scripts/worker_threads_bench.py --threads 1 2 --rounds 2 --model llama-bench

Each round starts a cluster of one colocated worker with `resources.num_cpus = T`, checks that
ClusterStatus reports T threads, warms up, then times greedy streams of `--tokens` tokens from the
first token to the last (decode only), one at a time; prints the median tokens/s per setting.
"""
from __future__ import annotations

import argparse
import statistics
import time


def one_setting(model: str, threads: int, tokens: int, streams: int) -> list[float]:
    import grpc

    from cluster.config import ClusterConfig
    from cluster.runtime import Cluster
    from proto.pdcluster.v1 import inference_pb2 as pb
    from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc

    cfg = ClusterConfig.model_validate(dict(
        model=model, router=dict(port=0),
        pools=[dict(name="solo", role="colocated", resources=dict(num_cpus=threads),
                    engine=dict(num_pages=256, max_model_len=1024, max_num_seqs=4))]))
    cluster = Cluster(cfg)
    cluster.start()
    try:
        s = pb_grpc.InferenceStub(grpc.insecure_channel(cluster.router_address))
        (w,) = s.ClusterStatus(pb.ClusterStatusRequest(), timeout=10).workers
        assert w.num_threads == threads, w
        req = pb.GenerateRequest(prompt_token_ids=list(range(10, 42)), sampling=pb.SamplingParams(
            max_tokens=tokens, temperature=0, ignore_eos=True))
        list(s.Generate(req, timeout=600))  # warm-up
        rates = []
        for _ in range(streams):
            first, n = None, 0
            for msg in s.Generate(req, timeout=600):
                if first is None:
                    first = time.perf_counter()
                    n0 = len(msg.token_ids)
                n += len(msg.token_ids)
            rates.append((n - n0) / (time.perf_counter() - first))
        return rates
    finally:
        cluster.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-bench")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=2, help="passes over the settings, alternating")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--streams", type=int, default=3, help="timed streams per setting and round")
    args = p.parse_args()
    rates: dict[int, list[float]] = {t: [] for t in args.threads}
    for r in range(args.rounds):
        for t in args.threads:
            got = one_setting(args.model, t, args.tokens, args.streams)
            rates[t] += got
            print(f"round {r}: {t} thread(s): " + " ".join(f"{x:.1f}" for x in got) + " tok/s", flush=True)
    for t in args.threads:
        print(f"{t} thread(s): median {statistics.median(rates[t]):.1f} tok/s over {len(rates[t])} streams "
              f"(min {min(rates[t]):.1f}, max {max(rates[t]):.1f})")


if __name__ == "__main__":
    main()
