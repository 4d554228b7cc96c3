from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "messages", "sampling", "decode_worker")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    sampling: SamplingParams
    decode_worker: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., decode_worker: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_s", "prefill_s", "transfer_s", "ttft_s", "e2e_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    prefill_s: float
    transfer_s: float
    ttft_s: float
    e2e_s: float
    def __init__(self, queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., e2e_s: _Optional[float] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("prefill_worker", "decode_worker", "local_prefill", "attempts", "migrations")
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    prefill_worker: str
    decode_worker: str
    local_prefill: bool
    attempts: int
    migrations: int
    def __init__(self, prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., local_prefill: _Optional[bool] = ..., attempts: _Optional[int] = ..., migrations: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "timings", "placement", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: Usage
    timings: Timings
    placement: Placement
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("model_id", "architecture", "vocab_size", "max_model_len", "eos_token_ids", "has_chat_template", "hash_page_size")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    HASH_PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_chat_template: bool
    hash_page_size: int
    def __init__(self, model_id: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., has_chat_template: _Optional[bool] = ..., hash_page_size: _Optional[int] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("grace_s",)
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    grace_s: float
    def __init__(self, grace_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("finished", "cancelled")
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    finished: int
    cancelled: int
    def __init__(self, finished: _Optional[int] = ..., cancelled: _Optional[int] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("pool", "replicas", "move", "to_pool")
    POOL_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MOVE_FIELD_NUMBER: _ClassVar[int]
    TO_POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    replicas: int
    move: int
    to_pool: str
    def __init__(self, pool: _Optional[str] = ..., replicas: _Optional[int] = ..., move: _Optional[int] = ..., to_pool: _Optional[str] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ("pool", "previous_target", "target", "current", "to_pool", "to_previous_target", "to_target")
    POOL_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_TARGET_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    TO_POOL_FIELD_NUMBER: _ClassVar[int]
    TO_PREVIOUS_TARGET_FIELD_NUMBER: _ClassVar[int]
    TO_TARGET_FIELD_NUMBER: _ClassVar[int]
    pool: str
    previous_target: int
    target: int
    current: int
    to_pool: str
    to_previous_target: int
    to_target: int
    def __init__(self, pool: _Optional[str] = ..., previous_target: _Optional[int] = ..., target: _Optional[int] = ..., current: _Optional[int] = ..., to_pool: _Optional[str] = ..., to_previous_target: _Optional[int] = ..., to_target: _Optional[int] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("name", "role", "target_replicas", "current_replicas", "max_replicas", "start_failures", "error")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TARGET_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    START_FAILURES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    target_replicas: int
    current_replicas: int
    max_replicas: int
    start_failures: int
    error: str
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., target_replicas: _Optional[int] = ..., current_replicas: _Optional[int] = ..., max_replicas: _Optional[int] = ..., start_failures: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "pool", "role", "healthy", "free_pages", "total_pages", "running_requests", "waiting_requests", "queued_tokens", "transferring_requests", "tokens_per_s", "prefix_cache_hit_rate", "requests_placed", "error", "pid", "node", "state", "restarts", "last_error", "tp_size", "rank_pids", "rank_nodes", "num_threads", "moving_to", "kv_index_state", "kv_index_blocks", "kv_index_reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERRING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PLACED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_PIDS_FIELD_NUMBER: _ClassVar[int]
    RANK_NODES_FIELD_NUMBER: _ClassVar[int]
    NUM_THREADS_FIELD_NUMBER: _ClassVar[int]
    MOVING_TO_FIELD_NUMBER: _ClassVar[int]
    KV_INDEX_STATE_FIELD_NUMBER: _ClassVar[int]
    KV_INDEX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_INDEX_REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    pool: str
    role: str
    healthy: bool
    free_pages: int
    total_pages: int
    running_requests: int
    waiting_requests: int
    queued_tokens: int
    transferring_requests: int
    tokens_per_s: float
    prefix_cache_hit_rate: float
    requests_placed: int
    error: str
    pid: int
    node: str
    state: str
    restarts: int
    last_error: str
    tp_size: int
    rank_pids: _containers.RepeatedScalarFieldContainer[int]
    rank_nodes: _containers.RepeatedScalarFieldContainer[str]
    num_threads: int
    moving_to: str
    kv_index_state: str
    kv_index_blocks: int
    kv_index_reason: str
    def __init__(self, worker_id: _Optional[str] = ..., pool: _Optional[str] = ..., role: _Optional[str] = ..., healthy: _Optional[bool] = ..., free_pages: _Optional[int] = ..., total_pages: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., transferring_requests: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., prefix_cache_hit_rate: _Optional[float] = ..., requests_placed: _Optional[int] = ..., error: _Optional[str] = ..., pid: _Optional[int] = ..., node: _Optional[str] = ..., state: _Optional[str] = ..., restarts: _Optional[int] = ..., last_error: _Optional[str] = ..., tp_size: _Optional[int] = ..., rank_pids: _Optional[_Iterable[int]] = ..., rank_nodes: _Optional[_Iterable[str]] = ..., num_threads: _Optional[int] = ..., moving_to: _Optional[str] = ..., kv_index_state: _Optional[str] = ..., kv_index_blocks: _Optional[int] = ..., kv_index_reason: _Optional[str] = ...) -> None: ...

class KVStoreStatus(_message.Message):
    __slots__ = ("store_id", "node", "healthy", "error", "pid", "total_pages", "free_pages", "hit_rate", "kv_index_state", "kv_index_blocks")
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    KV_INDEX_STATE_FIELD_NUMBER: _ClassVar[int]
    KV_INDEX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    store_id: str
    node: str
    healthy: bool
    error: str
    pid: int
    total_pages: int
    free_pages: int
    hit_rate: float
    kv_index_state: str
    kv_index_blocks: int
    def __init__(self, store_id: _Optional[str] = ..., node: _Optional[str] = ..., healthy: _Optional[bool] = ..., error: _Optional[str] = ..., pid: _Optional[int] = ..., total_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., hit_rate: _Optional[float] = ..., kv_index_state: _Optional[str] = ..., kv_index_blocks: _Optional[int] = ...) -> None: ...

class ClusterStatusResponse(_message.Message):
    __slots__ = ("workers", "policy", "inflight_requests", "queued_requests", "max_inflight", "max_queue", "requests_served", "requests_failed", "pools", "kv_index_exact", "kv_index_blocks", "kv_stores", "kv_fetched_tokens", "kv_offloaded_tokens")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    KV_INDEX_EXACT_FIELD_NUMBER: _ClassVar[int]
    KV_INDEX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_STORES_FIELD_NUMBER: _ClassVar[int]
    KV_FETCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    policy: str
    inflight_requests: int
    queued_requests: int
    max_inflight: int
    max_queue: int
    requests_served: int
    requests_failed: int
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    kv_index_exact: bool
    kv_index_blocks: int
    kv_stores: _containers.RepeatedCompositeFieldContainer[KVStoreStatus]
    kv_fetched_tokens: int
    kv_offloaded_tokens: int
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., policy: _Optional[str] = ..., inflight_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., max_inflight: _Optional[int] = ..., max_queue: _Optional[int] = ..., requests_served: _Optional[int] = ..., requests_failed: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ..., kv_index_exact: _Optional[bool] = ..., kv_index_blocks: _Optional[int] = ..., kv_stores: _Optional[_Iterable[_Union[KVStoreStatus, _Mapping]]] = ..., kv_fetched_tokens: _Optional[int] = ..., kv_offloaded_tokens: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("prompt", "messages")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "rendered")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RENDERED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    rendered: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., rendered: _Optional[str] = ...) -> None: ...
