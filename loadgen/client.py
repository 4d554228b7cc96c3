"""Load client: sends a Workload to a pdcluster.v1.Inference endpoint over grpc.aio, each
request at its arrival time (optionally capped by --max-concurrency), and records per-chunk
receive times plus the server's usage/timings/placement from the final chunk.

Queue depth (requests in flight, and requests waiting for a concurrency slot) is sampled on
every change, so plots show how load built up.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from engine.heap import heap_frozen
from loadgen.metrics import RequestRecord
from loadgen.workloads import Workload, WorkloadRequest
from proto.pdcluster.v1 import inference_pb2 as pb
from proto.client import ClientAuth
from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc


@dataclass(slots=True)
class Timeline:
    """(time offset, in flight, waiting for concurrency) after every change."""
    samples: list[tuple[float, int, int]] = field(default_factory=list)


async def model_info(address: str, timeout_s: float = 10.0, auth: ClientAuth | None = None) -> pb.ModelInfoResponse:
    async with (auth or ClientAuth()).aio_channel(address) as ch:
        return await pb_grpc.InferenceStub(ch).ModelInfo(pb.ModelInfoRequest(), timeout=timeout_s)


async def decode_worker_ids(address: str, timeout_s: float = 10.0, auth: ClientAuth | None = None) -> list[str]:
    """Ids of the cluster's decode and colocated workers (what GenerateRequest.decode_worker takes)."""
    async with (auth or ClientAuth()).aio_channel(address) as ch:
        st = await pb_grpc.InferenceStub(ch).ClusterStatus(pb.ClusterStatusRequest(), timeout=timeout_s)
    return [w.worker_id for w in st.workers if w.role in ("decode", "colocated")]


async def run_benchmark(address: str, workload: Workload, *, max_concurrency: int | None = None,
                        progress: bool = True, timeout_s: float = 600.0,
                        run_tag: str = "bench", auth: ClientAuth | None = None
                        ) -> tuple[list[RequestRecord], float, Timeline]:
    """Run the workload; prompt_token_ids must be materialized. Returns records (in workload
    order), the run's duration (first send to last finish) and the queue-depth timeline."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if any(r.prompt_token_ids is None for r in workload.requests):
        raise ValueError("workload prompts are not materialized (call materialize_prompts)")
    from tqdm import tqdm

    bar = tqdm(total=len(workload.requests), disable=not progress, unit="req")
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    timeline = Timeline()
    state = {"in_flight": 0, "waiting": 0}

    def note(key: str, delta: int) -> None:
        state[key] += delta
        timeline.samples.append((time.perf_counter() - t0, state["in_flight"], state["waiting"]))

    async def one(stub: pb_grpc.InferenceStub, req: WorkloadRequest) -> RequestRecord:
        await asyncio.sleep(max(0.0, req.arrival_s - (time.perf_counter() - t0)))
        note("waiting", +1)
        if sem:
            await sem.acquire()
        note("waiting", -1)
        note("in_flight", +1)
        try:
            return await send_request(stub, req, t0, timeout_s, f"{run_tag}-{req.index}")
        finally:
            if sem:
                sem.release()
            note("in_flight", -1)
            bar.update(1)

    # a full garbage collection of this process (which may also hold Ray and the cluster's
    # driver) would delay every stream's next chunk at once: an ITL stall the client made
    with heap_frozen():
        t0 = time.perf_counter()  # after the freeze's collection, which takes a while
        async with (auth or ClientAuth()).aio_channel(address) as ch:
            stub = pb_grpc.InferenceStub(ch)
            records = await asyncio.gather(*(one(stub, r) for r in workload.requests))
    bar.close()
    return list(records), max(time.perf_counter() - t0, 1e-9), timeline


async def send_request(stub: pb_grpc.InferenceStub, req: WorkloadRequest, t0: float, timeout_s: float,
                       request_id: str, output_ids: list[int] | None = None) -> RequestRecord:
    """One greedy, `ignore_eos` request, streamed: its record, timed from `t0`. The answer's token
    ids go into `output_ids` when given (a multi-turn client appends them to the history)."""
    sampling = pb.SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)
    msg = pb.GenerateRequest(request_id=request_id, prompt_token_ids=req.prompt_token_ids, sampling=sampling,
                             decode_worker=req.decode_worker)
    start = time.perf_counter()
    rec = RequestRecord(index=req.index, request_id=request_id, scheduled_s=req.arrival_s, start_s=start - t0,
                        prompt_len=req.prompt_len, max_tokens=req.output_len)
    last = None
    try:
        async for chunk in stub.Generate(msg, timeout=timeout_s):
            now = time.perf_counter() - start
            if chunk.token_ids:
                rec.chunk_times_s.append(now)
                rec.output_tokens += len(chunk.token_ids)
                if output_ids is not None:
                    output_ids.extend(chunk.token_ids)
            last = chunk
    except grpc.aio.AioRpcError as exc:
        rec.error, rec.error_detail = exc.code().name, exc.details() or ""
        return rec
    if not rec.chunk_times_s or last is None:
        rec.error, rec.error_detail = "NO_TOKENS", "the stream ended without a token"
        return rec
    rec.ok = True
    rec.ttft_s, rec.e2e_s = rec.chunk_times_s[0], rec.chunk_times_s[-1]
    if last.HasField("usage"):
        rec.output_tokens = last.usage.completion_tokens or rec.output_tokens
        rec.cached_tokens = last.usage.cached_prompt_tokens
    t, p = last.timings, last.placement
    rec.server = {"queue_s": t.queue_s, "prefill_s": t.prefill_s, "transfer_s": t.transfer_s,
                  "server_ttft_s": t.ttft_s, "server_e2e_s": t.e2e_s, "prefill_worker": p.prefill_worker,
                  "decode_worker": p.decode_worker, "local_prefill": p.local_prefill, "attempts": p.attempts}
    return rec


def run_benchmark_sync(address: str, workload: Workload, **kwargs) -> tuple[list[RequestRecord], float, Timeline]:
    return asyncio.run(run_benchmark(address, workload, **kwargs))
