"""`EngineCore`: one engine's parts put together: config, paged KV (block pool), scheduler,
model runner, tokenizer; request validation and the step loop. `LLM` (llm.py) adds the
batch `generate` API; the prefill and decode workers compose an EngineCore and drive its
scheduler and runner with their own hooks (transfer per layer, KV arriving from elsewhere).
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.config import ModelConfig, parse_dtype
from engine.kv_cache_manager import KVCacheManager, pages_for
from engine.model_runner import ModelRunner, page_bytes
from engine.outputs import RequestOutput
from engine.request import Request
from engine.sampler import make_generator
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

log = logging.getLogger(__name__)


def _cpu_has_half_matmul() -> bool:
    """Whether this CPU multiplies bfloat16/float16 natively (AVX512-BF16 or AMX tiles)."""
    cpu = getattr(torch, "cpu", None)
    checks = [getattr(cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(c() for c in checks if c is not None) or not any(checks)


DEFAULT_KV_CACHE_BYTES = 512 * 1024**2

Prompt = str | Sequence[int]


def resolve_model(model: str | Path) -> Path:
    """A checkpoint folder as given, or a built-in model named 'PRESET' or 'ARCH-PRESET'."""
    path = Path(model)
    if (path / "config.json").is_file():
        return path
    from engine.builtin import ARCHS, PRESETS, ensure_builtin

    name = str(model)
    arch, _, preset = name.rpartition("-") if "-" in name else ("llama", "", name)
    if arch in ARCHS and preset in PRESETS:  # a built-in name wins over a folder that is no checkpoint
        return ensure_builtin(arch=arch, preset=preset)
    if path.is_dir():
        return path  # the loader says what is missing
    raise ValueError(
        f"model {name!r} is neither a checkpoint folder nor a built-in name "
        f"(PRESET or ARCH-PRESET with ARCH in {list(ARCHS)}, PRESET in {list(PRESETS)})"
    )


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
    ) -> None:
        self.model_dir = resolve_model(model)
        self.config = cfg = ModelConfig.from_pretrained(self.model_dir)
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
            num_pages = max(1, min(budget // page_bytes(cfg, page_size, self.dtype), wanted))
        _check_positive(num_pages=num_pages)
        self.page_size = page_size
        self.kv = KVCacheManager(num_pages, page_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, max_num_batched_tokens, max_num_seqs)
        self.runner = ModelRunner(
            self.model_dir, cfg, dtype=self.dtype, device=self.device, page_size=page_size,
            num_pages=num_pages, max_model_len=self.max_model_len, attention_backend=attention_backend,
        )
        self.tokenizer = _load_tokenizer(self.model_dir)
        self.detokenize = detokenize and self.tokenizer is not None
        self.eos_token_ids = tuple(cfg.eos_token_ids) or (
            (self.tokenizer.eos_token_id,) if self.tokenizer is not None and self.tokenizer.eos_token_id is not None else ()
        )
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()

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

    def make_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> Request:
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
        if rid in self._requests:
            raise ValueError(f"request_id {rid!r} is already running")
        detok = None
        if self.detokenize:
            from engine.detokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(self.tokenizer, ids, stop=list(params.stop))
        return Request(
            request_id=rid, prompt_token_ids=ids, params=params, max_total_tokens=max_total,
            eos_token_ids=self.eos_token_ids,
            generator=None if params.greedy else make_generator(params.seed, self.device),
            detokenizer=detok,
        )

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        req = self.make_request(prompt, params or SamplingParams(), request_id)
        self._requests[req.request_id] = req
        self.scheduler.add(req)
        return req.request_id

    def abort_request(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            self.scheduler.abort(req)

    # ---- execution ------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample; returns the requests whose output changed."""
        batch = self.scheduler.schedule()
        if batch.empty:
            return []
        sampled = self.runner.execute(batch)
        return self.finish_step(batch, sampled)

    def finish_step(self, batch, sampled) -> list[RequestOutput]:
        outputs = []
        for req in self.scheduler.update(batch, sampled):
            outputs.append(req.take_output())
            if req.status.finished:
                self._requests.pop(req.request_id, None)
        return outputs

    # ---- introspection --------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return self.kv.num_free_pages

    @property
    def num_pages(self) -> int:
        return self.kv.num_pages

    @property
    def num_computed_prompt_tokens(self) -> int:
        return self.scheduler.num_computed_prompt_tokens


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _load_tokenizer(model_dir: Path):
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
