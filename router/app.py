"""Put a router together from a model and worker handles (used by the Ray router actor and
by in-process tests alike)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from router.dispatch import Dispatcher
from router.frontend import Frontend, FrontendLimits
from router.handles import WorkerHandle
from router.kv_index import KVIndex
from router.http_server import HttpLimits
from router.policy import make_policy
from router.security import Access, Tls
from router.server import RouterServer
from router.service import InferenceService


def build_router(model: str | Path, prefills: Sequence[WorkerHandle], decodes: Sequence[WorkerHandle], *,
                 host: str = "127.0.0.1", port: int = 0, policy: str = "prefix-aware", hash_page_size: int = 16,
                 max_model_len: int | None = None, max_inflight: int = 64, max_queue: int = 256,
                 max_prefill_attempts: int = 2, migration_limit: int = 2, migration_wait_s: float = 60.0,
                 limits: FrontendLimits | None = None, warm_up: bool = False,
                 http_port: int | None = None, access: Access | None = None, tls: Tls | None = None,
                 worker_timeout_s: float = 10.0, spares: Sequence[str] = (),
                 http_limits: HttpLimits | None = None, fetch_min_pages: int = 0,
                 stores: Sequence[WorkerHandle] = ()) -> RouterServer:
    """`http_limits`: the HTTP door's (router.http_server.HttpLimits; its max_body_bytes None:
    derived from the largest gRPC request, `FrontendLimits.request_bytes(max_model_len)`).
    `fetch_min_pages`: a prefill worker fetches a prompt's cached leading pages from the worker
    that holds at least this many more of them (0: never; router.dispatch.Dispatcher).
    `stores`: the nodes' KV stores (router/kv_tier.py)."""
    from engine.config import ModelConfig

    frontend = Frontend.from_model(model, hash_page_size=hash_page_size, max_model_len=max_model_len, limits=limits)
    cfg = ModelConfig.from_pretrained(frontend.model_dir)
    kv_index = KVIndex(hash_page_size)  # fed by the dispatcher's refresh; placement reads it (prefix-aware)
    dispatcher = Dispatcher(prefills, decodes, make_policy(policy, hash_page_size, kv_index),
                            max_prefill_attempts=max_prefill_attempts, migration_limit=migration_limit,
                            migration_wait_s=migration_wait_s, worker_timeout_s=worker_timeout_s, spares=spares,
                            kv_index=kv_index, fetch_min_pages=fetch_min_pages, stores=stores)
    eos = list(cfg.eos_token_ids) or ([frontend.tokenizer.eos_token_id] if frontend.tokenizer.eos_token_id is not None else [])
    service = InferenceService(frontend, dispatcher, model_id=frontend.model_dir.name, architecture=cfg.architecture,
                               eos_token_ids=eos, max_inflight=max_inflight, max_queue=max_queue)
    return RouterServer(service, host, port, warm_up=warm_up, http_port=http_port, access=access, tls=tls,
                        max_message_bytes=frontend.limits.request_bytes(frontend.max_model_len),
                        http_limits=http_limits)
