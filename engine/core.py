"""`EngineCore`: one engine's parts put together: config, paged KV (block pool), scheduler,
model runner, tokenizer, and optionally a KV connector; request validation and the step.

Every worker runs this same step, in this order:
  1. the connector's events: KV received (the request joins at the next free slot), KV failed
     (the owner's `on_kv_failure` policy: recompute here or fail), a held request released
  2. schedule (engine/scheduler.py), which also starts the sends of prompts finishing this step
  3. run the model; `KVConnector.save_layer` is called as each layer's K/V is written
  4. sample; the first token of each send goes after its KV (`finish_save`)
  5. outputs: every request whose output changed, ended ones (aborted, failed) included
A step that raises (a model or sampler error) ends only the requests of its batch, each with
finish_reason "error" naming the exception; the next step runs as usual.

`LLM` (llm.py) adds the batch `generate` API; the prefill and decode workers configure an
EngineCore (its connector, their policies) and call only its methods.

With `tensor_parallel_size=N > 1` this engine is the leader (rank 0) of a tensor-parallel group
(engine/parallel.py): it starts N-1 follower processes on this host (engine/tp_worker.py), each
with its shard of the model and the KV cache of its KV heads, and hands them every step's
batch; scheduling, sampling and detokenizing stay here. A lost follower fails the step that
finds it (its requests end with finish_reason "error" naming the rank) and every step after:
`tensor_parallel_error` says why; the engine must be replaced. `close()` stops the followers.
With a KV connector, every rank sends or receives its own KV heads: the leader's connector
(kv_transfer/tp_connector.py) has each follower build its rank's end and drives it.

Prefix fetch (engine/prefix_fetch.py): `add_fetching` queues a request whose leading pages come
from a peer's prefix cache, `export_prefix` sends this engine's cached pages to such a peer;
both need a connector that sends and receives, at tensor_parallel_size 1.
"""
from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from engine.checkpoint import builtin_name, find_model
from engine.config import ModelConfig, dtype_name
from engine.kv_cache_manager import KVCacheManager, pages_for
from engine.kv_connector import KVConnector, KVEventKind
from engine.kv_events import KVEventBatch, KVEventLog
from engine.load import WorkerLoad
from engine.model_runner import ModelRunner, page_bytes
from engine.outputs import RequestOutput, Resume
from engine.parallel import DEFAULT_TIMEOUT_S, TRANSPORTS, TPGroup, TPShard
from engine.prefix_fetch import FetchPlan, PrefixTransfers
from engine.request import Request
from engine.sampler import request_seed
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

log = logging.getLogger(__name__)


def _cpu_has_half_matmul() -> bool:
    """Whether this CPU multiplies bfloat16/float16 natively (AVX512-BF16 or AMX tiles)."""
    cpu = getattr(torch, "cpu", None)
    checks = [getattr(cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(c() for c in checks if c is not None) or not any(checks)


DEFAULT_KV_CACHE_BYTES = 512 * 1024**2
LOAD_WINDOW_S = 5.0  # the load report's tokens_per_s covers this many seconds

# What the owner of an engine with a connector decides when a request's remote KV fails: True
# to compute the prompt here instead, False to end the request with finish_reason "error".
KVFailurePolicy = Callable[[Request, str], bool]

Prompt = str | Sequence[int]


def parse_dtype(value: str | torch.dtype | None, default: torch.dtype) -> torch.dtype:
    if value is None:
        return default
    if isinstance(value, torch.dtype):
        value = str(value)
    return getattr(torch, dtype_name(value))


def resolve_model(model: str | Path) -> Path:
    """A checkpoint folder as given, or a built-in model by name, written on first use."""
    named = builtin_name(model)
    if named is not None:
        from engine.builtin import ensure_builtin

        return ensure_builtin(arch=named[0], preset=named[1])
    return find_model(model)


class EngineCore:
    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str | torch.dtype | None = None,
        page_size: int = 16,
        attention_backend: str = "auto",
        device: str | torch.device | None = None,
        num_pages: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 64,
        enable_prefix_caching: bool = True,
        detokenize: bool = True,
        kv_connector: KVConnector | None = None,
        on_kv_failure: KVFailurePolicy | None = None,
        tensor_parallel_size: int = 1,
        tp_timeout_s: float = DEFAULT_TIMEOUT_S,
        vocab_parallel_lm_head: bool = False,
        tp_host: str = "127.0.0.1",
        tp_launcher: Callable | None = None,
        tp_transport: str = "gloo",
    ) -> None:
        self.model_dir = resolve_model(model)
        self.config = cfg = ModelConfig.from_pretrained(self.model_dir)
        TPShard.of(cfg, 0, tensor_parallel_size, vocab_parallel_lm_head)  # raises if N does not fit the model
        if tp_transport not in TRANSPORTS:
            raise ValueError(f"tp_transport must be one of {list(TRANSPORTS)}, got {tp_transport!r}")
        if tensor_parallel_size > 1 and kv_connector is not None and not kv_connector.tensor_parallel:
            raise ValueError(f"tensor_parallel_size > 1 needs a KV connector that moves every rank's KV heads "
                             f"(kv_transfer.tp_connector.TPConnector); {type(kv_connector).__name__} moves only the "
                             f"leader's")
        self.tensor_parallel_size = tensor_parallel_size
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = parse_dtype(dtype, torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        if self.device.type == "cpu" and self.dtype != torch.float32 and not _cpu_has_half_matmul():
            log.warning("%s on this CPU (%s; no AVX512-BF16 or AMX) runs matmuls in a slow fallback, here "
                        "often 100x slower than float32: use dtype=float32", str(self.dtype).removeprefix("torch."),
                        torch.backends.cpu.get_cpu_capability())
        _check_positive(page_size=page_size, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        if not 1 < self.max_model_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [2, {cfg.max_position_embeddings}], got {self.max_model_len}")
        if num_pages is None:
            budget = kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES
            wanted = pages_for(self.max_model_len, page_size) * max_num_seqs
            # the budget is per rank: each holds the KV of its own KV heads
            num_pages = max(1, min(budget // page_bytes(cfg, page_size, self.dtype, tensor_parallel_size), wanted))
        _check_positive(num_pages=num_pages)
        self.page_size = page_size
        self.kv = KVCacheManager(num_pages, page_size, enable_prefix_caching)
        self.connector = kv_connector
        self.on_kv_failure = on_kv_failure
        self.scheduler = Scheduler(self.kv, max_num_batched_tokens, max_num_seqs, kv_connector)
        self.prefix = PrefixTransfers(self.kv, self.scheduler)
        self._tp: TPGroup | None = None
        self._tp_followers = None
        runner_kw = dict(dtype=self.dtype, device=self.device, page_size=page_size, num_pages=num_pages,
                         max_model_len=self.max_model_len, attention_backend=attention_backend)
        if tensor_parallel_size > 1:
            self.runner = self._start_tensor_parallel(tensor_parallel_size, tp_timeout_s, vocab_parallel_lm_head,
                                                      tp_host, tp_launcher, tp_transport, runner_kw)
        else:
            self.runner = ModelRunner(self.model_dir, cfg, **runner_kw)
        if kv_connector is not None:
            if self._tp is not None:
                kv_connector.join_group(self._tp, self.runner.shard, cfg.num_kv_heads)
            kv_connector.register_kv_caches(self.runner.kv_caches)
        self.tokenizer = _load_tokenizer(self.model_dir)
        self.detokenize = detokenize and self.tokenizer is not None
        self.eos_token_ids = tuple(cfg.eos_token_ids) or (
            (self.tokenizer.eos_token_id,) if self.tokenizer is not None and self.tokenizer.eos_token_id is not None else ()
        )
        self._wakeup: Callable[[], None] | None = None  # the owner's loop, told of connector news
        self._requests: dict[str, Request] = {}
        self._ended: list[Request] = []  # ended outside a step (aborted): their output is due
        self._generated: deque[tuple[float, int]] = deque()  # (step time, tokens generated)
        self._ids = itertools.count()
        self._cache_events: KVEventLog | None = None  # made by the first kv_events call

    def _start_tensor_parallel(self, world: int, timeout_s: float, vocab_parallel: bool, host: str,
                               launcher: Callable | None, transport: str, runner_kw: dict) -> ModelRunner:
        """Start followers 1..world-1, load the leader's shard meanwhile, join the group.

        The group's store listens on `host` (a free port). `launcher(spec, world, init_method,
        devices, num_threads)` starts the followers and returns their handle (`check()` raises
        TPGroupError for a lost one, `stop(timeout_s)`, `pids`); the default, `LocalFollowers`,
        runs them as subprocesses here. A Ray deployment passes one that starts a TPFollower per
        placement-group bundle, with `host` this node's address."""
        from engine.attention import resolve_backend_name
        from engine.tp_worker import LocalFollowers, ShardSpec, connect_store, wait_ready

        devices = ["cpu"] * world
        if self.device.type == "cuda":
            first = self.device.index if self.device.index is not None else torch.cuda.current_device()
            if torch.cuda.device_count() < first + world:
                raise ValueError(f"tensor_parallel_size={world} needs {world} CUDA devices from cuda:{first}; "
                                 f"this host has {torch.cuda.device_count()}")
            devices = [f"cuda:{first + r}" for r in range(world)]
            self.device = torch.device(devices[0])
            runner_kw["device"] = self.device
            torch.cuda.set_device(self.device)
        spec = ShardSpec(
            model_dir=str(self.model_dir), dtype=str(self.dtype).removeprefix("torch."),
            page_size=runner_kw["page_size"], num_pages=runner_kw["num_pages"],
            max_model_len=runner_kw["max_model_len"],
            attention_backend=resolve_backend_name(runner_kw["attention_backend"], self.device), timeout_s=timeout_s,
            vocab_parallel=vocab_parallel, transport=transport,
        )
        store = connect_store(f"tcp://{host}:0", is_master=True, timeout_s=timeout_s)  # binds a free port
        if self.connector is not None:
            spec.kv_connector = self.connector.follower_config(store)
        init_method = f"tcp://{host}:{store.port}"
        followers = (launcher or LocalFollowers)(spec, world, init_method, devices,
                                                 max(1, torch.get_num_threads() // world))
        group = TPGroup(store, 0, world, self.device, host=host, timeout_s=timeout_s, liveness=followers.check,
                        transport=transport)
        # stops the followers when this engine is closed, collected, or at interpreter exit
        self._tp_finalizer = weakref.finalize(self, _stop_tensor_parallel, group, followers, store)
        self._tp, self._tp_followers = group, followers
        try:
            runner = ModelRunner(self.model_dir, self.config, tp=group, vocab_parallel=vocab_parallel, **runner_kw)
            wait_ready(store, world, followers.check)
            group.connect()
        except BaseException:
            self._tp_finalizer()
            raise
        return runner

    @property
    def tensor_parallel_pids(self) -> list[int]:
        """The follower processes of this engine's tensor-parallel group (none at TP=1)."""
        return self._tp_followers.pids if self._tp_followers is not None else []

    @property
    def tensor_parallel_error(self) -> str | None:
        """Why this engine's tensor-parallel group cannot run steps any more (None: it can)."""
        if self._tp is None:
            return None
        try:
            self._tp.check()
        except RuntimeError as exc:
            return str(exc)
        return None

    # ---- request intake -------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must be a non-empty string or list of token ids, got ''")
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: pass prompt_token_ids")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt_token_ids must be non-empty")
        vocab = self.config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt_token_ids must be integers in [0, {vocab}), got {t!r}")
        return ids

    def make_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                     kv_destinations: Sequence = (), resume: Resume | None = None) -> Request:
        """A validated request, not queued yet (`add` or `add_remote` queues it). With
        `kv_destinations`, the prompt's KV goes there once computed (the connector's kind). With
        `resume`, it continues a stream another worker started (engine.request.Resume); check
        `status.finished` before queueing it."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        ids = self.tokenize(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; it must be shorter than max_model_len={self.max_model_len} "
                "to leave room for at least one generated token"
            )
        for t in params.stop_token_ids:
            if not 0 <= t < self.config.vocab_size:
                raise ValueError(f"stop_token_ids must be in [0, {self.config.vocab_size}), got {t}")
        max_total = min(len(ids) + params.max_tokens, self.max_model_len)
        if pages_for(max_total, self.page_size) > self.kv.num_pages:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) needs "
                f"{pages_for(max_total, self.page_size)} KV pages; the cache holds {self.kv.num_pages}"
            )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        self._check_new(rid)
        detok = None
        if self.detokenize:
            from engine.detokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(self.tokenizer, ids, stop=list(params.stop))
        req = Request(
            request_id=rid, prompt_token_ids=ids, params=params, max_total_tokens=max_total,
            eos_token_ids=self.eos_token_ids,
            seed=request_seed(params.seed),
            detokenizer=detok, kv_destinations=tuple(kv_destinations),
        )
        if resume is not None:
            if kv_destinations:
                raise ValueError("a resumed request decodes here: it takes no kv_destinations")
            for t in resume.output_token_ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.config.vocab_size:
                    raise ValueError(f"Resume.output_token_ids must be integers in [0, {self.config.vocab_size}), "
                                     f"got {t!r}")
            req.resume(resume)
        if req.kv_destinations:
            if self.connector is None:
                raise ValueError("kv_destinations need an engine with a KV connector; this one has none")
            self.connector.check(req)
        return req

    def add(self, req: Request) -> None:
        """Queue a request from `make_request` to be computed here. One that is finished already
        (a resumed request whose replay ended it) only reports its final output, at the next step."""
        self._check_new(req.request_id)
        if req.status.finished:
            self._ended.append(req)
            return
        self._requests[req.request_id] = req
        self.scheduler.add(req)

    def add_remote(self, req: Request) -> object | None:
        """Allocate pages for a request's prompt and wait for its KV from another worker.
        Returns where the sender writes (the connector's descriptor), or None (nothing kept)
        when the pages are not free."""
        if self.connector is None:
            raise ValueError("a request whose KV comes from elsewhere needs an engine with a KV connector")
        self._check_new(req.request_id)
        if not self.kv.allocate(req, req.num_tokens):  # the prompt, and a resumed request's output
            return None
        try:
            where = self.connector.prepare_receive(req)
        except BaseException:
            self.kv.free(req)
            raise
        self._requests[req.request_id] = req
        self.scheduler.add_remote(req)
        return where

    def add_fetching(self, req: Request, num_pages: int) -> FetchPlan | None:
        """Queue a request whose first `num_pages` pages a peer's prefix cache holds: pages are
        allocated for them and the plan says where the peer writes them (its `export_prefix`);
        once they arrive only the rest of the prompt is prefilled here, and if the fetch fails,
        all of it. None: nothing to fetch (this engine's own cache holds those pages, or pages
        are short), the request is queued as by `add`. Raises ValueError (nothing kept) when this
        engine cannot fetch or `num_pages` does not fit the prompt."""
        self._check_prefix_fetch()
        self._check_new(req.request_id)
        plan = None if req.status.finished else self.prefix.fetch(self.connector, req, num_pages)
        if plan is None:
            self.add(req)
        else:
            self._requests[req.request_id] = req
        return plan

    def abandon_fetch(self, request_id: str) -> bool:
        """Give up the prefix fetch of a request (its holder answered that it sends nothing, or
        cannot be reached): it computes its whole prompt here. False if it is not fetching."""
        return self.connector is not None and self.prefix.abandon(self.connector, request_id)

    def export_prefix(self, request_id: str, token_ids: Sequence[int], start_token: int, num_tokens: int,
                      destinations: Sequence) -> tuple[int, str | None]:
        """Send the KV of tokens [start_token, start_token + num_tokens) of `token_ids` from this
        engine's prefix cache into `destinations` (a requester's `add_fetching` plan), no forward
        pass; the pages stay pinned until the send ends. Returns (tokens sent, error): fewer
        tokens than asked (whole pages, possibly 0) when the cache no longer holds them all."""
        self._check_prefix_fetch()
        return self.prefix.export(self.connector, request_id, self.tokenize(token_ids), start_token, num_tokens,
                                  list(destinations))

    def _check_prefix_fetch(self) -> None:
        if self._tp is not None:
            raise ValueError(f"prefix fetch is not supported at tensor_parallel_size > 1 yet (this engine: "
                             f"{self.tensor_parallel_size})")
        if self.connector is None or not self.connector.prefix_fetch:
            raise ValueError("prefix fetch needs a KV connector that both sends and receives; this engine has "
                             + ("none" if self.connector is None else type(self.connector).__name__ + " without"))

    def _check_new(self, request_id: str) -> None:
        if request_id in self._requests or request_id in self.scheduler.held:
            raise ValueError(f"request_id {request_id!r} is already running")

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        req = self.make_request(prompt, params or SamplingParams(), request_id)
        self.add(req)
        return req.request_id

    def abort(self, request_id: str) -> bool:
        """End a request in any state; its final output (finish_reason "abort") comes with the
        next step. Its pages are free at once, or when the connector is done with them. A
        finished request whose pages are still held for its transfer has that transfer ended
        (no output: it had its final one). False if the engine does not know the request."""
        req = self._requests.pop(request_id, None)
        self.prefix.forget(request_id)
        if req is None:
            held = self.scheduler.held.get(request_id)
            if held is None:
                return False
            self.connector.cancel(held)  # finished, its transfer still running: end that
            return True
        self.scheduler.abort(req)
        self._ended.append(req)
        return True

    abort_request = abort

    def cached_prefix_tokens(self, req: Request) -> int:
        """Prompt tokens of `req` the prefix cache holds now."""
        return len(self.kv.find_cached_prefix(req)) * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.page_size)

    # ---- execution ------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def has_work(self) -> bool:
        """Whether `step` would do something now. Requests waiting for KV or held pages are not
        work: the connector's wake-up announces their events."""
        return bool(self.scheduler.has_unfinished or self._ended
                    or (self.connector is not None and self.connector.has_events))

    @property
    def has_requests(self) -> bool:
        """Any request open in any state, held pages included."""
        return bool(self._requests or self.scheduler.held or self._ended or self.prefix.exports)

    def set_wakeup(self, fn: Callable[[], None]) -> None:
        """Call `fn` (from any thread) when the connector has news for the next step."""
        self._wakeup = fn
        if self.connector is not None:
            self.connector.set_wakeup(fn)

    def set_kv_connector(self, connector: KVConnector | None, on_kv_failure: KVFailurePolicy | None = None, *,
                         max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None,
                         detokenize: bool | None = None) -> None:
        """Give this engine another job without reloading it (a worker's role switch): a new KV
        connector (or none) over the same KV cache, its failure policy, and the step's limits.
        The weights, the cache and the prefix cache's pages stay. Only an idle engine switches
        (raises RuntimeError while any request or held page is open); a tensor-parallel engine's
        followers built their connectors at start-up, so it cannot (ValueError). The new
        connector is registered before the old one closes: a connector that cannot start leaves
        the engine as it was."""
        if self._tp is not None:
            raise ValueError("a tensor-parallel engine cannot change its KV connector: its followers built theirs "
                             "at start-up")
        if self.has_requests:
            raise RuntimeError(f"the engine still has {len(self._requests) + len(self.scheduler.held)} open "
                               f"request(s): drain it before changing its KV connector")
        _check_positive(**{k: v for k, v in (("max_num_batched_tokens", max_num_batched_tokens),
                                             ("max_num_seqs", max_num_seqs)) if v is not None})
        if connector is not None:
            connector.register_kv_caches(self.runner.kv_caches)
            if self._wakeup is not None:
                connector.set_wakeup(self._wakeup)
        old, self.connector = self.connector, connector
        self.on_kv_failure = on_kv_failure
        sched = self.scheduler
        sched.connector = connector
        sched.max_num_batched_tokens = max_num_batched_tokens or sched.max_num_batched_tokens
        sched.max_num_seqs = max_num_seqs or sched.max_num_seqs
        if detokenize is not None:
            self.detokenize = detokenize and self.tokenizer is not None
        if old is not None:
            old.close()

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample; returns the requests whose output changed."""
        if self.connector is not None:
            self._apply_kv_events()
        sched = self.scheduler
        batch = sched.schedule()
        ended, self._ended = self._ended + batch.failed, []
        # A joined request's output (its first token, sampled elsewhere) goes out apart from the
        # token it decodes in this same step.
        outputs = self._outputs(ended + batch.joined)
        if batch.empty:
            return outputs
        on_layer = self.connector.save_layer if batch.saving else None
        try:
            sampled = self.runner.execute(batch, on_layer=on_layer)
        except Exception as exc:  # fail this batch's requests, not the worker (nor the next batch)
            return outputs + self._outputs(self._fail_batch(batch, exc))
        failed = []
        for req in batch.saving:
            error = self.connector.finish_save(req, sampled[req][0]) if req in sampled else None
            if error is not None:
                sched.finish(req, error)
                failed.append(req)
        changed = sched.update(batch, sampled)
        self._generated.append((time.monotonic(), len(changed)))  # one token each, sampled here
        return outputs + self._outputs(failed + changed)

    def _fail_batch(self, batch, exc: Exception) -> list[Request]:
        """A step raised: every request it ran ends with finish_reason "error" naming the
        exception (their pages come back; a send it started is cancelled); the engine goes on."""
        error = f"engine step failed: {type(exc).__name__}: {exc}"[:500]
        log.exception("engine step of %d requests failed; they end with an error", len(batch.requests))
        for req in batch.requests:
            self.scheduler.finish(req, error)
            if req in batch.saving:
                self.connector.cancel(req)
        return list(batch.requests)

    def _outputs(self, reqs: list[Request]) -> list[RequestOutput]:
        outputs = []
        for req in reqs:
            outputs.append(req.take_output())
            if req.status.finished and self._requests.get(req.request_id) is req:
                del self._requests[req.request_id]
        return outputs

    def _apply_kv_events(self) -> None:
        sched = self.scheduler
        for ev in self.connector.take_events():
            req = ev.request
            if sched.release(req) or self.prefix.on_event(ev):
                continue
            if ev.kind == KVEventKind.RECEIVED:
                sched.kv_received(req, ev.first_token)
            elif ev.kind == KVEventKind.FAILED and sched.kv_failed(req):
                error = ev.error or "KV transfer failed"
                if self.on_kv_failure is not None and self.on_kv_failure(req, error):
                    sched.recompute(req)
                else:
                    req.fail(error)
                    self._ended.append(req)

    # ---- introspection --------------------------------------------------------------------
    def load(self) -> WorkerLoad:
        sched, pool = self.scheduler, self.kv.pool
        now = time.monotonic()
        while self._generated and self._generated[0][0] < now - LOAD_WINDOW_S:
            self._generated.popleft()
        span = min(LOAD_WINDOW_S, now - self._generated[0][0]) if self._generated else 0.0
        return WorkerLoad(
            running_requests=len(sched.running),
            waiting_requests=len(sched.waiting) + len(sched.waiting_kv) + len(sched.ready),
            queued_tokens=sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting),
            running_tokens=sum(r.num_tokens - r.num_computed_tokens for r in sched.running),
            transferring_requests=len(sched.held) + len(sched.waiting_kv) + len(self.prefix.exports),
            free_pages=self.kv.num_free_pages,
            total_pages=self.kv.num_pages,
            tokens_per_s=sum(n for _, n in self._generated) / span if span > 0 else 0.0,
            prefix_cache_hit_rate=pool.hits / pool.queries if pool.queries else 0.0,
            prefix_cache_queries=pool.queries,
            num_preemptions=sched.num_preemptions,
            waiting_for_kv=len(sched.waiting_kv) + len(sched.ready),
        )

    def kv_events(self, epoch: str, since: int) -> KVEventBatch:
        """What the prefix cache gained and lost after `since` of `epoch` (engine/kv_events.py),
        or a snapshot of every block hash it holds: the first call (the log starts then, so an
        engine nobody asks pays nothing), another epoch (this engine is new), events dropped."""
        if self._cache_events is None:
            pool = self.kv.pool
            self._cache_events = pool.events = KVEventLog(self.page_size, pool.cached_hashes)
        return self._cache_events.since(epoch, since)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (pages in use keep their KV; none is found by hash any more).
        Returns how many block hashes were dropped."""
        n = self.kv.pool.num_cached_pages
        self.kv.pool.reset_prefix_cache()
        return n

    @property
    def num_free_pages(self) -> int:
        return self.kv.num_free_pages

    @property
    def num_pages(self) -> int:
        return self.kv.num_pages

    @property
    def num_computed_prompt_tokens(self) -> int:
        return self.scheduler.num_computed_prompt_tokens

    def close(self) -> None:
        """Abort every open request and close the connector (its pages come back first)."""
        for rid in list(self._requests):
            self.abort(rid)
        if self.connector is not None:
            self.connector.close()
            self._apply_kv_events()
        self._ended.clear()
        if self._tp is not None:
            self._tp_finalizer()


def _stop_tensor_parallel(group: TPGroup, followers, store) -> None:
    group.stop_followers()
    followers.stop()
    group.mark_broken("the engine is closed")
    group.close()
    group.store = None  # the store (its listener and server thread) goes with the last reference: not
    del store           # left listening while a closed engine object lives on


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _load_tokenizer(model_dir: Path):
    if (model_dir / "tokenizer.json").is_file():  # a fast tokenizer: no transformers import (seconds of start-up)
        return _FastTokenizer(model_dir)
    if not any((model_dir / f).is_file() for f in ("tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


class _FastTokenizer:
    """What the engine asks of a tokenizer (`encode` without special tokens, `eos_token_id`, the
    Rust `backend_tokenizer` its detokenizer decodes with), from a checkpoint's tokenizer.json
    read with `tokenizers` itself: transformers' fast tokenizer wraps the same object, and
    importing transformers is most of a worker's start-up after torch."""

    def __init__(self, model_dir: Path) -> None:
        import json

        from tokenizers import Tokenizer

        self.backend_tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        specials: dict = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            path = model_dir / name
            if path.is_file():
                specials.update(json.loads(path.read_text(encoding="utf-8")))
        eos = specials.get("eos_token")
        if isinstance(eos, dict):  # an AddedToken's fields
            eos = eos.get("content")
        self.eos_token_id = self.backend_tokenizer.token_to_id(eos) if isinstance(eos, str) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False, **_: object) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
