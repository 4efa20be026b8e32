from decode_node.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchKvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvents(_message.Message):
    __slots__ = ("snapshot", "events")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    snapshot: bool
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    def __init__(self, snapshot: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("stored", "removed")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    stored: KvBlocksStored
    removed: KvBlocksRemoved
    def __init__(self, stored: _Optional[_Union[KvBlocksStored, _Mapping]] = ..., removed: _Optional[_Union[KvBlocksRemoved, _Mapping]] = ...) -> None: ...

class KvBlocksStored(_message.Message):
    __slots__ = ("parent_hash", "block_hashes", "block_size")
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    parent_hash: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    def __init__(self, parent_hash: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ...) -> None: ...

class KvBlocksRemoved(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class PushKvRequest(_message.Message):
    __slots__ = ("header", "chunk", "commit")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    header: KvHeader
    chunk: KvChunk
    commit: KvCommit
    def __init__(self, header: _Optional[_Union[KvHeader, _Mapping]] = ..., chunk: _Optional[_Union[KvChunk, _Mapping]] = ..., commit: _Optional[_Union[KvCommit, _Mapping]] = ...) -> None: ...

class KvHeader(_message.Message):
    __slots__ = ("request_id", "model_id", "num_layers", "num_kv_heads", "head_dim", "dtype", "num_tokens", "prompt_token_ids", "next_token_id", "num_streams", "reuse_prefix")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_STREAMS_FIELD_NUMBER: _ClassVar[int]
    REUSE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: _common_pb2.DType
    num_tokens: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    next_token_id: int
    num_streams: int
    reuse_prefix: bool
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., num_tokens: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., next_token_id: _Optional[int] = ..., num_streams: _Optional[int] = ..., reuse_prefix: _Optional[bool] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("layer", "token_start", "token_count", "key", "value", "crc32c", "head_start", "head_count")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_COUNT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    token_start: int
    token_count: int
    key: bytes
    value: bytes
    crc32c: int
    head_start: int
    head_count: int
    def __init__(self, layer: _Optional[int] = ..., token_start: _Optional[int] = ..., token_count: _Optional[int] = ..., key: _Optional[bytes] = ..., value: _Optional[bytes] = ..., crc32c: _Optional[int] = ..., head_start: _Optional[int] = ..., head_count: _Optional[int] = ...) -> None: ...

class KvCommit(_message.Message):
    __slots__ = ("next_token_id",)
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    next_token_id: int
    def __init__(self, next_token_id: _Optional[int] = ...) -> None: ...

class PushKvResponse(_message.Message):
    __slots__ = ("request_id", "bytes_received", "chunks_received", "committed", "lease", "reused_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    bytes_received: int
    chunks_received: int
    committed: bool
    lease: str
    reused_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., bytes_received: _Optional[int] = ..., chunks_received: _Optional[int] = ..., committed: _Optional[bool] = ..., lease: _Optional[str] = ..., reused_tokens: _Optional[int] = ...) -> None: ...

class DropKvRequest(_message.Message):
    __slots__ = ("request_id", "lease")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease: str
    def __init__(self, request_id: _Optional[str] = ..., lease: _Optional[str] = ...) -> None: ...

class DropKvResponse(_message.Message):
    __slots__ = ("dropped", "bytes_freed")
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    dropped: bool
    bytes_freed: int
    def __init__(self, dropped: _Optional[bool] = ..., bytes_freed: _Optional[int] = ...) -> None: ...
