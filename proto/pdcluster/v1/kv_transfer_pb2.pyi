from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "page_size", "head_start", "num_heads", "head_dim", "dtype", "tp_size", "tp_rank")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    page_size: int
    head_start: int
    num_heads: int
    head_dim: int
    dtype: str
    tp_size: int
    tp_rank: int
    def __init__(self, num_layers: _Optional[int] = ..., page_size: _Optional[int] = ..., head_start: _Optional[int] = ..., num_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ...) -> None: ...

class CompatInfo(_message.Message):
    __slots__ = ("model_id", "num_layers", "num_kv_heads", "head_dim", "dtype", "page_layout", "protocol_version", "hash")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_layout: str
    protocol_version: int
    hash: str
    def __init__(self, model_id: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., page_layout: _Optional[str] = ..., protocol_version: _Optional[int] = ..., hash: _Optional[str] = ...) -> None: ...

class DestinationDescriptor(_message.Message):
    __slots__ = ("request_id", "transport", "endpoint", "page_ids", "num_tokens", "layout", "compat")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transport: str
    endpoint: str
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    layout: KVLayout
    compat: CompatInfo
    def __init__(self, request_id: _Optional[str] = ..., transport: _Optional[str] = ..., endpoint: _Optional[str] = ..., page_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., compat: _Optional[_Union[CompatInfo, _Mapping]] = ...) -> None: ...

class NixlPoolInfo(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "layer_base_addr", "page_bytes", "num_pages", "device_id", "mem_type")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    LAYER_BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    layer_base_addr: _containers.RepeatedScalarFieldContainer[int]
    page_bytes: int
    num_pages: int
    device_id: int
    mem_type: str
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., layer_base_addr: _Optional[_Iterable[int]] = ..., page_bytes: _Optional[int] = ..., num_pages: _Optional[int] = ..., device_id: _Optional[int] = ..., mem_type: _Optional[str] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("protocol_version", "compat", "layout", "transport", "sender_id", "nixl")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    compat: CompatInfo
    layout: KVLayout
    transport: str
    sender_id: str
    nixl: NixlPoolInfo
    def __init__(self, protocol_version: _Optional[int] = ..., compat: _Optional[_Union[CompatInfo, _Mapping]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., transport: _Optional[str] = ..., sender_id: _Optional[str] = ..., nixl: _Optional[_Union[NixlPoolInfo, _Mapping]] = ...) -> None: ...

class HandshakeReply(_message.Message):
    __slots__ = ("accepted", "reason", "layout", "receiver_id", "nixl_agent_name", "nixl_conn_metadata")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    NIXL_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    NIXL_CONN_METADATA_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    layout: KVLayout
    receiver_id: str
    nixl_agent_name: str
    nixl_conn_metadata: bytes
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., receiver_id: _Optional[str] = ..., nixl_agent_name: _Optional[str] = ..., nixl_conn_metadata: _Optional[bytes] = ...) -> None: ...

class BeginTransfer(_message.Message):
    __slots__ = ("request_id", "sender_id", "src_page_ids", "dst_page_ids", "num_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    DST_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sender_id: str
    src_page_ids: _containers.RepeatedScalarFieldContainer[int]
    dst_page_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., sender_id: _Optional[str] = ..., src_page_ids: _Optional[_Iterable[int]] = ..., dst_page_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("ok", "reason", "items")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    items: int
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ..., items: _Optional[int] = ...) -> None: ...

class PageChunk(_message.Message):
    __slots__ = ("request_id", "sender_id", "layer", "token_start", "num_tokens", "dst_page_ids", "data", "whole_pages", "defer_ack")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DST_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    WHOLE_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEFER_ACK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sender_id: str
    layer: int
    token_start: int
    num_tokens: int
    dst_page_ids: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    whole_pages: bool
    defer_ack: bool
    def __init__(self, request_id: _Optional[str] = ..., sender_id: _Optional[str] = ..., layer: _Optional[int] = ..., token_start: _Optional[int] = ..., num_tokens: _Optional[int] = ..., dst_page_ids: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., whole_pages: _Optional[bool] = ..., defer_ack: _Optional[bool] = ...) -> None: ...

class FinalNotice(_message.Message):
    __slots__ = ("request_id", "sender_id", "first_token", "prompt_len")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sender_id: str
    first_token: int
    prompt_len: int
    def __init__(self, request_id: _Optional[str] = ..., sender_id: _Optional[str] = ..., first_token: _Optional[int] = ..., prompt_len: _Optional[int] = ...) -> None: ...

class NixlNotice(_message.Message):
    __slots__ = ("layer_ready", "final", "layer_read", "abort")
    LAYER_READY_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    LAYER_READ_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    layer_ready: LayerReady
    final: FinalNotice
    layer_read: LayerRead
    abort: Abort
    def __init__(self, layer_ready: _Optional[_Union[LayerReady, _Mapping]] = ..., final: _Optional[_Union[FinalNotice, _Mapping]] = ..., layer_read: _Optional[_Union[LayerRead, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ...) -> None: ...

class LayerReady(_message.Message):
    __slots__ = ("request_id", "sender_id", "layer")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sender_id: str
    layer: int
    def __init__(self, request_id: _Optional[str] = ..., sender_id: _Optional[str] = ..., layer: _Optional[int] = ...) -> None: ...

class LayerRead(_message.Message):
    __slots__ = ("request_id", "layer")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layer: int
    def __init__(self, request_id: _Optional[str] = ..., layer: _Optional[int] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class PushItem(_message.Message):
    __slots__ = ("chunk", "final")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    chunk: PageChunk
    final: FinalNotice
    def __init__(self, chunk: _Optional[_Union[PageChunk, _Mapping]] = ..., final: _Optional[_Union[FinalNotice, _Mapping]] = ...) -> None: ...
