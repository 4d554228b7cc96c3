"""What the test modules share (fixtures live in the conftest.py files; no test module imports
another):

- references: greedy outputs from Hugging Face transformers, random prompts, random paged
  attention batches;
- synchronization: `wait_until(predicate)`, the one way a test waits for something to happen;
- in-process serving: real prefill and decode workers over the `local` transport, hosted by
  `AsyncWorker`s and reached through `WorkerHandle`s (the two objects a Ray deployment puts
  between the router and the engine), and an event loop on a thread for the router;
- clients: gRPC stubs and helpers for a router or a Ray cluster, /metrics scraping;
- processes: the Ray processes a test started (to check it stopped them all).
"""
from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch

from proto.pdcluster.v1 import inference_pb2 as pb
from proto.pdcluster.v1 import inference_pb2_grpc as pb_grpc

S = pb.SamplingParams
GREEDY = dict(max_tokens=10, temperature=0, ignore_eos=True)


# ---- synchronization --------------------------------------------------------------------------
def wait_until(predicate: Callable[[], Any], timeout_s: float = 10.0, interval_s: float = 0.01, what: str = "") -> Any:
    """Poll `predicate` until it returns something truthy, and return that. The timeout is a
    guard against a hang, never a measurement: it fails the test naming what did not happen."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what or getattr(predicate, '__name__', predicate)}")
        time.sleep(interval_s)


# ---- references -------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy outputs of Hugging Face transformers, one prompt at a time (no padding, an explicit
    all-ones attention mask so a prompt token equal to pad_token_id is not masked)."""
    model = _hf_model(str(model_dir))
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            seq = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
            )
            outs.append(seq[0, len(p):].tolist())
    return outs


def random_prompts(lengths, vocab_size: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


@dataclass(slots=True)
class PagedBatch:
    layout: Any             # engine.attention.BatchLayout
    q: torch.Tensor         # [T, Hq, D]
    k: torch.Tensor         # [T, Hkv, D]
    v: torch.Tensor
    kv_cache: torch.Tensor  # [num_pages, 2, page_size, Hkv, D], prefixes filled, rest random too


def random_paged_batch(
    seqs: list[tuple[int, int]],  # (cached_len, query_len) per sequence, decodes (query_len 1) first
    *, page_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: torch.device, seed: int = 0, spare_pages: int = 7,
) -> PagedBatch:
    """One step's `BatchLayout` over a randomly filled paged KV cache: sequences with a cached
    prefix in scattered pages, decode-shaped first, as the runner would build it."""
    from engine.attention import BatchLayout

    gen = torch.Generator().manual_seed(seed)
    query_lens = [q for _, q in seqs]
    context_lens = [c + q for c, q in seqs]
    num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(seqs))
    if any(q == 1 for q in query_lens[num_decodes:]):
        raise ValueError("decode-shaped sequences (query_len 1) must come first")
    pages_needed = [-(-c // page_size) for c in context_lens]
    num_pages = sum(pages_needed) + spare_pages
    perm = torch.randperm(num_pages, generator=gen).tolist()  # scattered, never page-ordered
    block_tables, start = [], 0
    for n in pages_needed:
        block_tables.append(perm[start : start + n])
        start += n
    slots = []
    for (cached, q_len), table in zip(seqs, block_tables):
        pos = torch.arange(cached, cached + q_len)
        pages = torch.tensor(table, dtype=torch.long)[pos // page_size]
        slots.append(pages * page_size + pos % page_size)
    t = sum(query_lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    layout = BatchLayout(
        page_size=page_size, query_lens=query_lens, context_lens=context_lens, block_tables=block_tables,
        num_decodes=num_decodes, slot_mapping=torch.cat(slots).to(device),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device),
        device=device,
    )
    return PagedBatch(
        layout, randn(t, num_q_heads, head_dim), randn(t, num_kv_heads, head_dim), randn(t, num_kv_heads, head_dim),
        randn(num_pages, 2, page_size, num_kv_heads, head_dim),
    )


# ---- in-process serving ----------------------------------------------------------------------
ENGINE = dict(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=256)


class Loop:
    """An asyncio loop on its own thread, for a router's server."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def in_process(worker, worker_id: str, role: str, pool: str | None = None):
    """A worker hosted by an AsyncWorker in this process, and the router's handle on it; the
    worker's engine is page-leak checked after each test (tests/conftest.py)."""
    from engine.async_worker import AsyncWorker
    from router.handles import InProcess, WorkerHandle
    from tests.conftest import register_engine

    register_engine(worker.core)
    return WorkerHandle(InProcess(AsyncWorker(worker, worker_id)), worker_id, pool or role, role)


def close(*handles) -> None:
    """Stop the workers behind in-process handles."""
    for h in handles:
        h.remote.host.close()


def local_pair(model, num_pages: int, cfg=None, hub=None):
    """One prefill and one decode worker over a local KV hub, and their handles."""
    from decode_worker.worker import DecodeWorker
    from kv_transfer.config import TransferConfig
    from kv_transfer.local import LocalHub
    from prefill_worker.worker import PrefillWorker

    hub = hub or LocalHub()
    cfg = cfg or TransferConfig(deadline_s=20)
    prefill = PrefillWorker(model, transport="local", transfer_config=cfg, transport_kwargs={"hub": hub},
                            page_size=16, num_pages=num_pages, **ENGINE)
    decode = DecodeWorker(model, transport="local", transfer_config=cfg, transport_kwargs={"hub": hub},
                          page_size=16, num_pages=num_pages, **ENGINE)
    return prefill, decode, in_process(prefill, "prefill-0", "prefill"), in_process(decode, "decode-0", "decode")


def local_trio(model, num_pages: int = 64):
    """One prefill and two decode workers over one local KV hub: (prefill, decode0, decode1) and
    their handles (prefill-0, decode-0, decode-1)."""
    from decode_worker.worker import DecodeWorker
    from kv_transfer.config import TransferConfig
    from kv_transfer.local import LocalHub

    hub = LocalHub()
    prefill, decode0, ph, dh0 = local_pair(model, num_pages, hub=hub)
    decode1 = DecodeWorker(model, transport="local", transfer_config=TransferConfig(deadline_s=20),
                           transport_kwargs={"hub": hub}, page_size=16, num_pages=num_pages, **ENGINE)
    return (prefill, decode0, decode1), (ph, dh0, in_process(decode1, "decode-1", "decode"))


def hold_engine_thread(handle, seconds: float):
    """Keep a worker's engine thread busy for `seconds`, as one long step would; returns the
    call's future (done when the hold ends)."""
    return handle.remote.host.engine.submit(lambda: time.sleep(seconds))


# ---- clients ----------------------------------------------------------------------------------
def stub(server_or_cluster):
    """A stub for a router server (`.address`) or a Ray cluster (`.router_address`)."""
    address = getattr(server_or_cluster, "router_address", None) or server_or_cluster.address
    return pb_grpc.InferenceStub(grpc.insecure_channel(address))


def collect(stub_, req, timeout=120):
    """(token ids, text, final message) of one Generate stream."""
    chunks = list(stub_.Generate(req, timeout=timeout))
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1]


def all_pages_free(stub_) -> pb.ClusterStatusResponse | None:
    """ClusterStatus when every worker's pages are all free, else None (for wait_until)."""
    st = stub_.ClusterStatus(pb.ClusterStatusRequest())
    return st if all(w.free_pages == w.total_pages for w in st.workers) else None


def wait_free(stub_, timeout_s=20.0) -> pb.ClusterStatusResponse:
    return wait_until(lambda: all_pages_free(stub_), timeout_s, 0.05, "every worker's pages free")


def run_streams(cluster, prompts, sampling=None):
    """Concurrent greedy streams, one per prompt: [(ids, text, final message)]."""
    s = stub(cluster)
    sampling = sampling or S(**GREEDY)
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: collect(s, pb.GenerateRequest(prompt_token_ids=p, sampling=sampling)),
                             prompts))


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

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


# ---- Ray clusters -----------------------------------------------------------------------------
CLUSTER_ENGINE = dict(num_pages=256, max_model_len=256, max_num_batched_tokens=512, max_num_seqs=32, page_size=16)


def start_cluster(tiny_model, metrics: bool = False, http: bool = False, **kw):
    """A real local Ray cluster of the tiny llama model (`ClusterConfig.embedded` options), with
    the router's /metrics and its OpenAI-compatible HTTP API on free ports when asked."""
    from cluster.config import ClusterConfig
    from cluster.runtime import Cluster

    tiny_model("llama")  # built once in this process; actors find it in PDCLUSTER_CACHE
    cfg = ClusterConfig.embedded(model="tiny", port=0, engine=CLUSTER_ENGINE, **kw)
    if metrics:
        cfg.router.metrics_port = 0
    if http:
        cfg.router.http_port = 0
    cluster = Cluster(cfg)
    cluster.start()
    return cluster


def descendants(pid: int) -> set[int]:
    from cluster.ray_start import descendants as below

    return set(below(pid))


def our_ray_processes() -> list[str]:
    """The Ray processes (raylet, gcs, workers) this test process started and left running."""
    names = []
    for p in descendants(os.getpid()):
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "raylet" in cmd or "gcs_server" in cmd or "ray::" in cmd or "default_worker" in cmd:
            names.append(f"{p}: {cmd[:80]}")
    return names


class LoopKiller(BaseException):
    """Fault injection, named so: what only a bug or the interpreter could raise in an engine
    step, killing the worker's engine loop."""


def slow_steps(worker, step_s: float) -> None:
    """Fault injection, named so: every engine step of `worker` takes at least `step_s` longer
    (a slow decode, so that a stream is still running when a test acts on it)."""
    step = worker.step

    def slow_step():
        time.sleep(step_s)
        return step()

    worker.step = slow_step
