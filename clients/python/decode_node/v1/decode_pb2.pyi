from decode_node.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT_FULL: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_CONTEXT_FULL: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "sampling", "max_new_tokens", "stop_token_ids", "ignore_eos", "kv_timeout_ms", "lease", "min_tokens", "stop", "top_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    KV_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    kv_timeout_ms: int
    lease: str
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    top_logprobs: int
    def __init__(self, request_id: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., kv_timeout_ms: _Optional[int] = ..., lease: _Optional[str] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token", "finish")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    token: Token
    finish: Finish
    def __init__(self, token: _Optional[_Union[Token, _Mapping]] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("index", "id", "text", "logprob", "top_logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: int
    text: str
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, index: _Optional[int] = ..., id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("id", "text", "logprob")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    logprob: float
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class RequestStats(_message.Message):
    __slots__ = ("queue_seconds", "first_token_seconds", "total_seconds", "cpu_attention_ratio", "recalled_blocks", "prediction_hit_ratio", "prompt_tokens", "device_wait_seconds", "recalled_bytes", "recalled_blocks_used", "device_idle_seconds")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CPU_ATTENTION_RATIO_FIELD_NUMBER: _ClassVar[int]
    RECALLED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_HIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECALLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECALLED_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    first_token_seconds: float
    total_seconds: float
    cpu_attention_ratio: float
    recalled_blocks: int
    prediction_hit_ratio: float
    prompt_tokens: int
    device_wait_seconds: float
    recalled_bytes: int
    recalled_blocks_used: int
    device_idle_seconds: float
    def __init__(self, queue_seconds: _Optional[float] = ..., first_token_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ..., cpu_attention_ratio: _Optional[float] = ..., recalled_blocks: _Optional[int] = ..., prediction_hit_ratio: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., device_wait_seconds: _Optional[float] = ..., recalled_bytes: _Optional[int] = ..., recalled_blocks_used: _Optional[int] = ..., device_idle_seconds: _Optional[float] = ...) -> None: ...

class Finish(_message.Message):
    __slots__ = ("reason", "generated_tokens", "stats")
    REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    generated_tokens: int
    stats: RequestStats
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., generated_tokens: _Optional[int] = ..., stats: _Optional[_Union[RequestStats, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id", "lease")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease: str
    def __init__(self, request_id: _Optional[str] = ..., lease: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchLoadRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("running", "waiting", "host_kv_bytes_used", "host_kv_bytes_capacity", "device_kv_bytes_used", "device_kv_bytes_capacity", "tokens_per_second", "draining", "committed_unclaimed", "device_kv_bytes_lent")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_BYTES_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KV_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KV_BYTES_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_UNCLAIMED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KV_BYTES_LENT_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    host_kv_bytes_used: int
    host_kv_bytes_capacity: int
    device_kv_bytes_used: int
    device_kv_bytes_capacity: int
    tokens_per_second: float
    draining: bool
    committed_unclaimed: int
    device_kv_bytes_lent: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., host_kv_bytes_used: _Optional[int] = ..., host_kv_bytes_capacity: _Optional[int] = ..., device_kv_bytes_used: _Optional[int] = ..., device_kv_bytes_capacity: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., draining: _Optional[bool] = ..., committed_unclaimed: _Optional[int] = ..., device_kv_bytes_lent: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "num_layers", "num_kv_heads", "head_dim", "kv_dtype", "block_size", "vocab_size", "eos_token_ids", "max_context", "architecture", "num_attention_heads")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: _common_pb2.DType
    block_size: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_context: int
    architecture: str
    num_attention_heads: int
    def __init__(self, model_id: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., kv_dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., block_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_context: _Optional[int] = ..., architecture: _Optional[str] = ..., num_attention_heads: _Optional[int] = ...) -> None: ...
