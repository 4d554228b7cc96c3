"""What the in-process router tests share: real prefill and decode workers over the `local`
transport, hosted by `AsyncWorker`s in this process and reached through `WorkerHandle`s (the
same two objects a Ray deployment puts between the router and the engine), an event loop on a
thread for the router, and small gRPC and /metrics helpers."""
from __future__ import annotations

import asyncio
import threading
import time
import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from decode_worker.worker import DecodeWorker
from engine.async_worker import AsyncWorker
from kv_transfer.config import TransferConfig
from kv_transfer.local import LocalHub
from prefill_worker.worker import PrefillWorker
from proto.pdcluster.v1 import inference_pb2 as pb
from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc
from router.handles import InProcess, WorkerHandle
from tests.conftest import register_engine

ENGINE = dict(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=256)


class Loop:
    """An asyncio loop on its own thread, for the router's server."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def in_process(worker, worker_id: str, role: str, pool: str | None = None) -> WorkerHandle:
    """A worker hosted by an AsyncWorker in this process, and the router's handle on it; the
    worker's engine is page-leak checked after each test."""
    register_engine(worker.core)
    return WorkerHandle(InProcess(AsyncWorker(worker, worker_id)), worker_id, pool or role, role)


def close(*handles: WorkerHandle) -> None:
    for h in handles:
        h.remote.host.close()


def local_pair(model, num_pages: int, cfg: TransferConfig | None = None, hub: LocalHub | None = None):
    """One prefill and one decode worker over a local KV hub, and their handles."""
    hub = hub or LocalHub()
    cfg = cfg or TransferConfig(deadline_s=20)
    prefill = PrefillWorker(model, transport="local", transfer_config=cfg, transport_kwargs={"hub": hub},
                            page_size=16, num_pages=num_pages, **ENGINE)
    decode = DecodeWorker(model, transport="local", transfer_config=cfg, transport_kwargs={"hub": hub},
                          page_size=16, num_pages=num_pages, **ENGINE)
    return prefill, decode, in_process(prefill, "prefill-0", "prefill"), in_process(decode, "decode-0", "decode")


def hold_engine_thread(handle: WorkerHandle, seconds: float):
    """Keep a worker's engine thread busy for `seconds`, as one long step would; returns the
    call's future (done when the hold ends)."""
    return handle.remote.host.engine.submit(lambda: time.sleep(seconds))


def stub(server):
    return pb_grpc.InferenceStub(grpc.insecure_channel(server.address))


def collect(stub_, req, timeout=60):
    chunks = list(stub_.Generate(req, timeout=timeout))
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1]


def wait_free(stub_, timeout_s=10.0):
    """ClusterStatus once every worker's pages are all free (or the timeout passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = stub_.ClusterStatus(pb.ClusterStatusRequest())
        if all(w.free_pages == w.total_pages for w in st.workers) or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def per_worker(samples, name) -> dict[str, float]:
    return {dict(k[1])["worker"]: v for k, v in samples.items() if k[0] == name}


def kv_bytes_moved(decode_worker, prompt_lens) -> int:
    """KV bytes the prefill side wrote into the decode worker's pages for these prompts, from
    the decode worker's own KV tensors: every page a prompt occupies, K and V, every layer."""
    layers = decode_worker.core.runner.kv_caches
    page_bytes_all_layers = sum(layer[0].nbytes for layer in layers)
    page_size = layers[0].shape[2]
    return sum(-(-n // page_size) * page_bytes_all_layers for n in prompt_lens)
