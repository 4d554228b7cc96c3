"""`pdcluster generate`: stream one answer from a running cluster to the terminal, then its
usage and timings (TTFT, ITL as measured here)."""
from __future__ import annotations

import argparse
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt (with --chat: the user message)")
    parser.add_argument("--address", default="127.0.0.1:50051", help="router HOST:PORT")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--min-p", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds")
    parser.add_argument("--show-ids", action="store_true", help="also print the generated token ids")
    from proto.client import add_client_arguments

    add_client_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import grpc

    from proto.client import client_auth
    from proto.pdcluster.v1 import inference_pb2 as pb
    from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc

    sampling = pb.SamplingParams(stop=args.stop)
    for field, value in (("max_tokens", args.max_tokens), ("temperature", args.temperature), ("top_p", args.top_p),
                         ("top_k", args.top_k), ("min_p", args.min_p), ("seed", args.seed)):
        if value is not None:
            setattr(sampling, field, value)
    if args.ignore_eos:
        sampling.ignore_eos = True
    req = pb.GenerateRequest(sampling=sampling)
    if args.chat:
        req.messages.append(pb.ChatMessage(role="user", content=args.prompt))
    else:
        req.prompt = args.prompt
    times, last, ids = [], None, []
    start = time.perf_counter()
    with client_auth(args).channel(args.address) as ch:
        try:
            for chunk in pb_grpc.InferenceStub(ch).Generate(req, timeout=args.timeout):
                if chunk.token_ids:
                    times.append(time.perf_counter())
                    ids += chunk.token_ids
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                last = chunk
        except grpc.RpcError as exc:
            print(f"\npdcluster generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print()
    gaps = [b - a for a, b in zip(times, times[1:])]
    u, t = last.usage, last.timings
    itl = f"{sum(gaps) / len(gaps) * 1e3:.1f} ms" if gaps else "n/a"
    ttft = f"{(times[0] - start) * 1e3:.1f} ms" if times else "n/a"
    # decode rate as the client sees it: tokens after the first over the time they took
    rate = f"{(len(ids) - 1) / (times[-1] - times[0]):.1f} tokens/s" if len(times) > 1 and times[-1] > times[0] else "n/a"
    if args.show_ids:
        print(f"ids: {ids}")
    print(f"[{last.request_id}] finish={last.finish_reason} prompt={u.prompt_tokens} completion={u.completion_tokens} "
          f"cached={u.cached_prompt_tokens}; TTFT {ttft} (router {t.ttft_s * 1e3:.1f} ms: queue "
          f"{t.queue_s * 1e3:.1f}, prefill {t.prefill_s * 1e3:.1f}, transfer {t.transfer_s * 1e3:.1f}), ITL {itl}, "
          f"{rate}; "
          f"prefill on {last.placement.prefill_worker or '(decode worker)'}, decode on {last.placement.decode_worker}",
          file=sys.stderr)
    return 0
