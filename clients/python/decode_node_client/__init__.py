"""Python client of decode-node: push a prefill's KV cache, then stream the generation.

    from decode_node_client import push_kv, generate
    push_kv("127.0.0.1:50051", "req-1", outputs.past_key_values, prompt_ids, next_token_id)
    for tok in generate("127.0.0.1:50051", "req-1", max_new_tokens=32):
        print(tok.text, end="", flush=True)

`decode_node_client.aio` has the same calls for asyncio (grpc.aio channels).

Every call takes a target address or a channel; `channel(target, ca_cert=...)` makes a TLS one
(mutual TLS with `client_cert`/`client_key`), and `token=` sends a bearer token.

`past_key_values` may be HF transformers' cache (a `DynamicCache`, or per-layer `(k, v)` with
shape [1, kv_heads, tokens, head_dim]) or vLLM-style per-layer `(k, v)` of shape
[tokens, kv_heads, head_dim]; numpy arrays or torch tensors. Every chunk carries a CRC-32C of
its key bytes followed by its value bytes, as the protocol requires.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Iterable, Iterator, Optional, Sequence, Tuple

import crc32c
import grpc
import numpy as np

from decode_node.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc

__all__ = ["push_kv", "PushStream", "gather_paged", "generate", "generate_all", "model_info", "get_load", "watch_load", "watch_kv_events",
           "cancel", "drop_kv", "channel", "to_layers", "DecodeNodeError"]

_MAX_MESSAGE = 64 << 20


class DecodeNodeError(RuntimeError):
    """A call failed; `code` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code


_OPTIONS = [("grpc.max_send_message_length", _MAX_MESSAGE), ("grpc.max_receive_message_length", _MAX_MESSAGE)]


def _read(path: Optional[str]) -> Optional[bytes]:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def channel(target: str, *, ca_cert: Optional[str] = None, client_cert: Optional[str] = None,
            client_key: Optional[str] = None, domain: Optional[str] = None) -> grpc.Channel:
    """A channel to a node, for every call of this module (any `target` argument takes one).

    With `ca_cert` (a PEM file) the channel uses TLS, verifying the node against that CA; add
    `client_cert` and `client_key` for a node that requires client certificates (mutual TLS),
    and `domain` where the certificate's name differs from the host in `target`. Without
    `ca_cert`, plain text, as `decode-node serve` runs without `--tls-cert`.
    """
    creds, options = _channel_args(ca_cert, client_cert, client_key, domain)
    if creds is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, creds, options=options)


def _channel_args(ca_cert: Optional[str], client_cert: Optional[str], client_key: Optional[str],
                  domain: Optional[str]) -> Tuple[Optional[grpc.ChannelCredentials], list]:
    """TLS credentials (None: plain text) and channel options, checked."""
    if (client_cert is None) != (client_key is None):
        raise ValueError("client_cert and client_key go together")
    if ca_cert is None:
        if client_cert is not None or domain is not None:
            raise ValueError("client certificates and domain need ca_cert (TLS)")
        return None, list(_OPTIONS)
    creds = grpc.ssl_channel_credentials(root_certificates=_read(ca_cert), private_key=_read(client_key),
                                         certificate_chain=_read(client_cert))
    return creds, _OPTIONS + ([("grpc.ssl_target_name_override", domain)] if domain else [])


def _channel(target) -> grpc.Channel:
    if isinstance(target, grpc.Channel):
        return target
    return channel(target)


def _metadata(token: Optional[str]):
    return [("authorization", f"Bearer {token}")] if token else None


def model_info(target, token: Optional[str] = None) -> decode_pb2.ModelInfo:
    """The node's model id and the KV layout a push must match."""
    try:
        return decode_pb2_grpc.DecodeStub(_channel(target)).GetModelInfo(
            decode_pb2.GetModelInfoRequest(), metadata=_metadata(token))
    except grpc.RpcError as e:
        raise DecodeNodeError(e.code(), e.details()) from None


def get_load(target, token: Optional[str] = None) -> decode_pb2.LoadReport:
    """The node's load now (running and waiting requests, free memory)."""
    try:
        return decode_pb2_grpc.DecodeStub(_channel(target)).GetLoad(
            decode_pb2.GetLoadRequest(), metadata=_metadata(token))
    except grpc.RpcError as e:
        raise DecodeNodeError(e.code(), e.details()) from None


def cancel(target, request_id: str, lease: str = "", token: Optional[str] = None) -> bool:
    """Ends a waiting or running request (its stream ends CANCELLED) and frees its KV; True
    when the node knew the request."""
    try:
        return decode_pb2_grpc.DecodeStub(_channel(target)).Cancel(
            decode_pb2.CancelRequest(request_id=request_id, lease=lease), metadata=_metadata(token)).cancelled
    except grpc.RpcError as e:
        raise DecodeNodeError(e.code(), e.details()) from None


def drop_kv(target, request_id: str, lease: str = "", token: Optional[str] = None) -> kv_transfer_pb2.DropKvResponse:
    """Releases a pushed request's KV that will not be generated from (`dropped`, `bytes_freed`);
    NOT_FOUND where the node holds none for it."""
    try:
        return kv_transfer_pb2_grpc.KvTransferStub(_channel(target)).DropKv(
            kv_transfer_pb2.DropKvRequest(request_id=request_id, lease=lease), metadata=_metadata(token))
    except grpc.RpcError as e:
        raise DecodeNodeError(e.code(), e.details()) from None


def watch_load(target, interval_ms: int = 0, token: Optional[str] = None) -> Iterator[decode_pb2.LoadReport]:
    """Yields the node's load every `interval_ms` (0: 100; at most 100) until the caller stops."""
    try:
        yield from decode_pb2_grpc.DecodeStub(_channel(target)).WatchLoad(
            decode_pb2.WatchLoadRequest(interval_ms=interval_ms), metadata=_metadata(token))
    except grpc.RpcError as e:
        raise DecodeNodeError(e.code(), e.details()) from None


def watch_kv_events(target, token: Optional[str] = None) -> Iterator[kv_transfer_pb2.KvEvents]:
    """Yields what the node's prefix cache holds: a snapshot first (`snapshot` set), then
    batches of changes (blocks stored, blocks removed), until the caller stops. A router keeps
    the block hashes per node and sends a conversation where its history is held (the hash of
    a block is computable from tokens; see `WatchKvEvents` in kv_transfer.proto)."""
    try:
        yield from kv_transfer_pb2_grpc.KvTransferStub(_channel(target)).WatchKvEvents(
            kv_transfer_pb2.WatchKvEventsRequest(), metadata=_metadata(token))
    except grpc.RpcError as e:
        raise DecodeNodeError(e.code(), e.details()) from None


def _numpy(t) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t
    # torch tensors (bf16 has no numpy dtype: go through f32).
    return t.detach().to("cpu").float().numpy()


def _host(t):
    """A numpy array as it is, a torch tensor on the host in its own dtype (`_encode` sends bf16
    and f16 tensors' bits as they are where the node stores that dtype)."""
    return t if isinstance(t, np.ndarray) else t.detach().to("cpu")


def to_layers(past_key_values) -> list:
    """Per-layer (K, V) numpy arrays of shape [tokens, kv_heads, head_dim]."""
    if hasattr(past_key_values, "layers"):  # transformers >= 4.56 DynamicCache
        pairs = [(l.keys, l.values) for l in past_key_values.layers]
    elif hasattr(past_key_values, "key_cache"):
        pairs = list(zip(past_key_values.key_cache, past_key_values.value_cache))
    else:
        pairs = [(k, v) for k, v in past_key_values]
    out = []
    for k, v in pairs:
        k, v = _numpy(k), _numpy(v)
        if k.ndim == 4:  # HF: [batch=1, kv_heads, tokens, head_dim]
            if k.shape[0] != 1:
                raise ValueError("push one sequence at a time (batch dimension must be 1)")
            k, v = k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2)
        if k.ndim != 3 or k.shape != v.shape:
            raise ValueError(f"K/V must be [tokens, kv_heads, head_dim]; got {k.shape} and {v.shape}")
        out.append((k, v))
    return out


def _encode(a, dtype: int) -> bytes:
    if not isinstance(a, np.ndarray):  # torch, on the host
        import torch
        same = {common_pb2.DTYPE_BF16: torch.bfloat16, common_pb2.DTYPE_F16: torch.float16}.get(dtype)
        if a.dtype == same:  # the node's dtype already: its bits as they are (little-endian hosts)
            return a.contiguous().view(torch.int16).numpy().tobytes()
        a = a.float().numpy()
    a = np.ascontiguousarray(a, dtype=np.float32)
    if dtype == common_pb2.DTYPE_F32:
        return a.astype("<f4").tobytes()
    if dtype == common_pb2.DTYPE_F16:
        return a.astype("<f2").tobytes()
    bits = a.view(np.uint32).astype(np.uint64)  # bf16: round to nearest even
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    return bits.tobytes()


def _push_plan(layers: list, prompt_token_ids: Sequence[int], chunk_tokens: int) -> Tuple[int, int, int]:
    """(tokens, kv_heads, head_dim) of per-layer KV, checked against the prompt. Callers check
    before streaming: an error inside a request iterator only cancels the call."""
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be positive")
    if not layers:
        raise ValueError("no layers in past_key_values")
    tokens, heads, head_dim = layers[0][0].shape
    if len(prompt_token_ids) != tokens:
        raise ValueError(f"{len(prompt_token_ids)} prompt ids for {tokens} tokens of KV")
    return tokens, heads, head_dim


def _push_messages(request_id: str, layers: list, prompt_token_ids: Sequence[int], next_token_id: int,
                   model_id: str, dtype: int, chunk_tokens: int, reuse_prefix: bool = False,
                   start_at: Callable[[], int] = lambda: 0) -> Iterator[kv_transfer_pb2.PushKvRequest]:
    """A push's stream: header, every layer's chunks (with their CRC-32C), commit. The chunks
    begin at `start_at()`, asked once the header is taken: with `reuse_prefix`, the tokens the
    node said it already holds."""
    tokens, heads, head_dim = _push_plan(layers, prompt_token_ids, chunk_tokens)
    yield kv_transfer_pb2.PushKvRequest(header=kv_transfer_pb2.KvHeader(
        request_id=request_id, model_id=model_id, num_layers=len(layers), num_kv_heads=heads, head_dim=head_dim,
        dtype=dtype, num_tokens=tokens, prompt_token_ids=list(map(int, prompt_token_ids)),
        next_token_id=int(next_token_id), reuse_prefix=reuse_prefix))
    first = min(max(int(start_at()), 0), tokens)
    for layer, (k, v) in enumerate(layers):
        for start in range(first, tokens, chunk_tokens):
            end = min(tokens, start + chunk_tokens)
            kb, vb = _encode(k[start:end], dtype), _encode(v[start:end], dtype)
            yield kv_transfer_pb2.PushKvRequest(chunk=kv_transfer_pb2.KvChunk(
                layer=layer, token_start=start, token_count=end - start, key=kb, value=vb,
                crc32c=crc32c.crc32c(vb, crc32c.crc32c(kb))))
    yield kv_transfer_pb2.PushKvRequest(commit=kv_transfer_pb2.KvCommit())


def _committed(last: Optional[kv_transfer_pb2.PushKvResponse]) -> kv_transfer_pb2.PushKvResponse:
    if last is None or not last.committed:
        raise DecodeNodeError(grpc.StatusCode.UNKNOWN, "push ended without a commit acknowledgement")
    return last


def push_kv(target, request_id: str, past_key_values, prompt_token_ids: Sequence[int], next_token_id: int, *,
            model_id: Optional[str] = None, dtype: Optional[int] = None, chunk_tokens: int = 256,
            token: Optional[str] = None, timeout: Optional[float] = None,
            reuse_prefix: bool = False) -> kv_transfer_pb2.PushKvResponse:
    """Streams one prompt's KV to the node and returns the commit acknowledgement.

    `dtype` is a `common_pb2.DTYPE_*`; by default the node's own KV dtype (no conversion there).
    With `reuse_prefix`, the node keeps what it still holds of the prompt's start (an earlier
    turn of the conversation, from its prefix cache): the header goes alone, and only the
    tokens after the ones its acknowledgement names (`reused_tokens`) are sent.
    """
    layers = to_layers(past_key_values)
    _push_plan(layers, prompt_token_ids, chunk_tokens)
    if model_id is None or dtype is None:
        info = model_info(target, token)
        model_id = model_id or info.model_id
        dtype = info.kv_dtype if dtype is None else dtype
    acked = threading.Event()
    ended = threading.Event()
    reused = [0]

    def start_at() -> int:
        # Runs on gRPC's request thread: the chunks wait for the header's acknowledgement.
        while reuse_prefix and not acked.wait(0.05):
            if ended.is_set():
                return len(prompt_token_ids)
        return reused[0]

    messages = _push_messages(request_id, layers, prompt_token_ids, next_token_id, model_id, dtype, chunk_tokens,
                              reuse_prefix, start_at)
    stub = kv_transfer_pb2_grpc.KvTransferStub(_channel(target))
    last = None
    try:
        for ack in stub.PushKv(messages, metadata=_metadata(token), timeout=timeout):
            if not acked.is_set():
                reused[0] = ack.reused_tokens
                acked.set()
            last = ack
    except grpc.RpcError as e:
        raise DecodeNodeError(e.code(), e.details()) from None
    finally:
        ended.set()
    return _committed(last)


def _generate_request(request_id: str, *, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 0.0,
                      top_k: int = 0, seed: int = 0, stop_token_ids: Iterable[int] = (), ignore_eos: bool = False,
                      kv_timeout_ms: int = 0, lease: str = "", stop: Iterable[str] = (), min_tokens: int = 0,
                      top_logprobs: int = 0, repetition_penalty: float = 0.0, presence_penalty: float = 0.0,
                      frequency_penalty: float = 0.0) -> decode_pb2.GenerateRequest:
    return decode_pb2.GenerateRequest(
        request_id=request_id, max_new_tokens=max_new_tokens, stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos, kv_timeout_ms=kv_timeout_ms, lease=lease, stop=list(stop),
        min_tokens=min_tokens, top_logprobs=top_logprobs,
        sampling=decode_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                           repetition_penalty=repetition_penalty,
                                           presence_penalty=presence_penalty,
                                           frequency_penalty=frequency_penalty))


def _stream_header(request_id: str, prompt_token_ids: Sequence[int], num_layers: int, num_kv_heads: int,
                   head_dim: int, model_id: str, dtype: int, next_token_id: Optional[int],
                   num_streams: int, reuse_prefix: bool = False) -> kv_transfer_pb2.PushKvRequest:
    """The header of a push streamed piece by piece (`PushStream`)."""
    if num_streams <= 0:
        raise ValueError("num_streams must be positive")
    return kv_transfer_pb2.PushKvRequest(header=kv_transfer_pb2.KvHeader(
        request_id=request_id, model_id=model_id, num_layers=num_layers, num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=dtype, num_tokens=len(prompt_token_ids),
        prompt_token_ids=list(map(int, prompt_token_ids)),
        next_token_id=0 if next_token_id is None else int(next_token_id),
        num_streams=0 if num_streams == 1 else int(num_streams), reuse_prefix=reuse_prefix))


def _stream_parts(layer: int, k, v, token_start: int, head_start: int, shape: Tuple[int, int], layers: int,
                  tokens: int, chunk: int, held: int = 0) -> Iterator[tuple]:
    """`PushStream.push`'s arguments checked and cut into chunks: (layer, start, head_start, k, v),
    leaving out tokens below `held` (the node reused them from its prefix cache)."""
    k, v = _host(k), _host(v)
    heads, dim = shape
    if k.shape != v.shape or k.ndim != 3 or k.shape[2] != dim or k.shape[1] == 0:
        raise ValueError(f"K/V must be [tokens, heads, {dim}]; got {k.shape}, {v.shape}")
    if not 0 <= head_start <= heads - k.shape[1]:
        raise ValueError(f"heads {head_start}..{head_start + k.shape[1]} outside the model's {heads}")
    if not 0 <= layer < layers or token_start < 0 or token_start + k.shape[0] > tokens:
        raise ValueError(f"layer {layer}, tokens {token_start}..{token_start + k.shape[0]} outside "
                         f"{layers} layers of {tokens} tokens")
    for s in range(max(0, held - token_start), k.shape[0], chunk):
        yield layer, token_start + s, head_start, k[s:s + chunk], v[s:s + chunk]


def _stream_chunk(layer: int, start: int, head_start: int, k: np.ndarray, v: np.ndarray, *, heads: int,
                  dtype: int) -> kv_transfer_pb2.PushKvRequest:
    """One chunk of `_stream_parts`, encoded, with its CRC-32C (every head: no head range)."""
    kb, vb = _encode(k, dtype), _encode(v, dtype)
    whole = k.shape[1] == heads
    return kv_transfer_pb2.PushKvRequest(chunk=kv_transfer_pb2.KvChunk(
        layer=layer, token_start=start, token_count=k.shape[0], key=kb, value=vb,
        crc32c=crc32c.crc32c(vb, crc32c.crc32c(kb)), head_start=0 if whole else head_start,
        head_count=0 if whole else k.shape[1]))


class PushStream:
    """One prompt's KV pushed piece by piece as the producer computes it: each layer (or each
    chunked-prefill step of a layer) right after prefill finishes it, so the transfer overlaps
    the rest of the forward pass. `push` only queues (chunks are encoded and sent from gRPC's
    thread); `commit` waits for the node's acknowledgement. The first decode token may be given
    at `commit`, after sampling. Leaving a `with` block on an exception aborts the push, and the
    node frees what it held.

    Producers in separate processes (tensor-parallel ranks, each with its own KV heads) each
    open a `PushStream` of the same request with the same header and `num_streams=` their
    number, push their own part (`head_start=`), and commit; the node commits the KV when every
    stream has, and each `commit` returns then. If one stream fails, every stream's push fails.

        with PushStream(target, "r1", prompt_ids, num_layers=L, num_kv_heads=H, head_dim=D) as s:
            for layer in range(L):
                ...  # compute the layer
                s.push(layer, k, v)          # [tokens, kv_heads, head_dim]
            ack = s.commit(next_token_id=sampled)
    """

    def __init__(self, target, request_id: str, prompt_token_ids: Sequence[int], *, num_layers: int,
                 num_kv_heads: int, head_dim: int, next_token_id: Optional[int] = None,
                 model_id: Optional[str] = None, dtype: Optional[int] = None, chunk_tokens: int = 256,
                 token: Optional[str] = None, timeout: Optional[float] = None, num_streams: int = 1,
                 reuse_prefix: bool = False):
        if chunk_tokens <= 0:
            raise ValueError("chunk_tokens must be positive")
        if min(num_layers, num_kv_heads, head_dim) <= 0:
            raise ValueError("num_layers, num_kv_heads and head_dim must be positive")
        if model_id is None or dtype is None:
            info = model_info(target, token)
            model_id = model_id or info.model_id
            dtype = info.kv_dtype if dtype is None else dtype
        self._tokens = len(prompt_token_ids)
        self._shape = (num_kv_heads, head_dim)
        self._layers = num_layers
        self._dtype = dtype
        self._chunk = chunk_tokens
        self._queue: "queue.Queue" = queue.Queue()
        self._done = threading.Event()
        self._committing = False
        self._last: Optional[kv_transfer_pb2.PushKvResponse] = None
        self._error: Optional[DecodeNodeError] = None
        self._reuse = reuse_prefix
        self._acked = threading.Event()
        self._reused = 0
        self._queue.put(_stream_header(request_id, prompt_token_ids, num_layers, num_kv_heads, head_dim, model_id,
                                       dtype, next_token_id, num_streams, reuse_prefix))
        stub = kv_transfer_pb2_grpc.KvTransferStub(_channel(target))
        self._call = stub.PushKv(self._requests(), metadata=_metadata(token), timeout=timeout)
        threading.Thread(target=self._read, daemon=True).start()

    def _requests(self) -> Iterator[kv_transfer_pb2.PushKvRequest]:
        while not self._done.is_set():
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(item, tuple):
                yield _stream_chunk(*item, heads=self._shape[0], dtype=self._dtype)
            else:
                yield item
                if item.HasField("commit"):
                    return

    def _read(self) -> None:
        try:
            for ack in self._call:
                if not self._acked.is_set():
                    self._reused = ack.reused_tokens
                    self._acked.set()
                self._last = ack
        except grpc.RpcError as e:
            self._error = DecodeNodeError(e.code(), e.details())
        finally:
            self._done.set()
            self._acked.set()

    @property
    def reused_tokens(self) -> int:
        """Leading prompt tokens the node took from its prefix cache (with `reuse_prefix`; waits
        for the header's acknowledgement): `push` leaves them out, so a producer may skip them."""
        self._acked.wait()
        if self._error is not None:
            raise self._error
        return self._reused

    def _check(self) -> None:
        if self._error is not None:
            raise self._error
        if self._committing or self._done.is_set():
            raise RuntimeError("the push has ended")

    def push(self, layer: int, k, v, token_start: int = 0, head_start: int = 0) -> None:
        """Queues tokens [token_start, token_start + len(k)) of `layer`: K and V of shape
        [tokens, heads, head_dim] (numpy or torch, any float dtype), KV heads [head_start,
        head_start + heads) of the model's (a tensor-parallel rank pushes its own heads into
        the same request). Every (layer, token, head) is sent once before `commit`."""
        self._check()
        held = self.reused_tokens if self._reuse else 0
        for part in _stream_parts(layer, k, v, token_start, head_start, self._shape, self._layers, self._tokens,
                                  self._chunk, held):
            self._queue.put(part)

    def commit(self, next_token_id: Optional[int] = None, timeout: Optional[float] = None
               ) -> kv_transfer_pb2.PushKvResponse:
        """Ends the push and waits for the node's commit acknowledgement; `next_token_id`
        replaces the header's (the token prefill sampled)."""
        self._check()
        self._committing = True
        self._queue.put(kv_transfer_pb2.PushKvRequest(commit=kv_transfer_pb2.KvCommit(
            next_token_id=None if next_token_id is None else int(next_token_id))))
        if not self._done.wait(timeout):
            self._call.cancel()
            raise DecodeNodeError(grpc.StatusCode.DEADLINE_EXCEEDED, "no commit acknowledgement in time")
        if self._error is not None:
            raise self._error
        return _committed(self._last)

    def abort(self) -> None:
        """Ends the push without committing; the node frees what it held."""
        self._committing = True
        self._call.cancel()
        self._done.wait(10)

    def __enter__(self) -> "PushStream":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._committing:
            self.abort()


def gather_paged(kv_layer, block_ids: Sequence[int], token_start: int, token_end: int, *,
                 layout: str = "flash_attn", keep_dtype: bool = False) -> Tuple[np.ndarray, np.ndarray]:
    """K and V of tokens [token_start, token_end) of one sequence from one layer of a paged KV
    cache, as [tokens, kv_heads, head_dim] numpy arrays (for `PushStream.push`). `block_ids` is
    the sequence's block table. Layouts, by the cache's shape:
    `flash_attn` [2, num_blocks, block_size, kv_heads, head_dim] (vLLM's default before its
    per-layer caches became [B, H, N, C] views),
    `flash_attn_hnd` [2, num_blocks, kv_heads, block_size, head_dim],
    `flashinfer` [num_blocks, 2, block_size, kv_heads, head_dim],
    `vllm_bhnc` [num_blocks, kv_heads, block_size, 2 * head_dim], each token's row its K then its V
    (vLLM's [B, H, N, C] view as its FlashAttention and Triton backends split it),
    `vllm_cpu` and `vllm_cpu_amx` [num_blocks, kv_heads, block_size, 2 * head_dim] as vLLM's CPU
    backend fills it (vLLM 0.32, read off its `cpu_attn_reshape_and_cache`): per block and head,
    block_size * head_dim key values, then as many values. `vllm_cpu` (its `vec`/`vec16` kernels)
    stores K transposed ([head_dim, block_size]) and V as rows; `vllm_cpu_amx` packs both for AMX
    tiles: K as [block_size/16, head_dim/2, 16, 2], V as [head_dim/16, block_size/2, 16, 2].
    A torch cache is gathered on its device; only the sequence's tokens are copied to the host.
    `keep_dtype`: a torch cache's tokens come back as host tensors in the cache's dtype (what
    `PushStream.push` sends fastest: bf16 to a bf16 node is a copy), not as float32 numpy."""
    out = _host if keep_dtype else _numpy
    if layout == "flashinfer":
        k_all, v_all = kv_layer[:, 0], kv_layer[:, 1]
    elif layout in ("flash_attn", "flash_attn_hnd"):
        k_all, v_all = kv_layer[0], kv_layer[1]
    elif layout == "vllm_bhnc":
        dim = kv_layer.shape[3] // 2
        k_all, v_all = kv_layer[..., :dim], kv_layer[..., dim:]
    elif layout in ("vllm_cpu", "vllm_cpu_amx"):
        k, v = _gather_vllm_cpu(kv_layer, block_ids, token_start, token_end, amx=layout == "vllm_cpu_amx")
        return out(k), out(v)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    heads_first = layout in ("flash_attn_hnd", "vllm_bhnc")
    block_size = k_all.shape[2] if heads_first else k_all.shape[1]
    if not 0 <= token_start <= token_end <= len(block_ids) * block_size:
        raise ValueError(f"tokens {token_start}..{token_end} outside {len(block_ids)} blocks of {block_size}")
    t = np.arange(token_start, token_end)
    blocks, slots = np.asarray(block_ids, dtype=np.int64)[t // block_size], t % block_size
    if not isinstance(kv_layer, np.ndarray):  # torch: index on the cache's device
        import torch
        blocks = torch.as_tensor(blocks, device=kv_layer.device)
        slots = torch.as_tensor(slots, device=kv_layer.device)
    if heads_first:
        k, v = k_all[blocks, :, slots], v_all[blocks, :, slots]
    else:
        k, v = k_all[blocks, slots], v_all[blocks, slots]
    return out(k), out(v)


def _gather_vllm_cpu(kv_layer, block_ids: Sequence[int], token_start: int, token_end: int, *, amx: bool):
    """`gather_paged` for vLLM's CPU backend: the blocks holding the tokens are taken whole and
    unpacked by reshaping (no per-element index), then the span is cut out. [tokens, heads, dim]
    in the cache's type (numpy or torch)."""
    num_blocks, heads, size, content = kv_layer.shape
    dim = content // 2
    if amx and (size % 16 or dim % 16):
        raise ValueError(f"an AMX-packed cache needs block_size and head_dim multiples of 16, got {size}, {dim}")
    if not 0 <= token_start <= token_end <= len(block_ids) * size:
        raise ValueError(f"tokens {token_start}..{token_end} outside {len(block_ids)} blocks of {size}")
    first, last = token_start // size, max(token_end - 1, token_start) // size
    blocks = np.asarray(block_ids[first:last + 1], dtype=np.int64)
    is_np = isinstance(kv_layer, np.ndarray)
    if not is_np:  # torch: index on the cache's device (the backend's cache is contiguous: a view)
        import torch
        blocks = torch.as_tensor(blocks, device=kv_layer.device)
    halves = (num_blocks, heads, 2, size * dim)
    kv = kv_layer.reshape(halves) if is_np else kv_layer.view(halves)
    n = len(blocks)
    k, v = kv[blocks, :, 0], kv[blocks, :, 1]  # [n, heads, size * dim] each, packed
    perm = (lambda x, *axes: x.transpose(axes)) if is_np else (lambda x, *axes: x.permute(*axes))
    if amx:
        # K [size/16, dim/2, 16, 2] -> [size/16, 16, dim/2, 2]; V [dim/16, size/2, 16, 2] -> [size/2, 2, dim/16, 16].
        k = perm(k.reshape(n, heads, size // 16, dim // 2, 16, 2), 0, 2, 4, 1, 3, 5)
        v = perm(v.reshape(n, heads, dim // 16, size // 2, 16, 2), 0, 3, 5, 1, 2, 4)
    else:
        # K [dim, size] -> [size, dim]; V [size, dim] as it is.
        k = perm(k.reshape(n, heads, dim, size), 0, 3, 1, 2)
        v = perm(v.reshape(n, heads, size, dim), 0, 2, 1, 3)
    lo = token_start - first * size
    k = k.reshape(n * size, heads, dim)[lo:lo + token_end - token_start]
    v = v.reshape(n * size, heads, dim)[lo:lo + token_end - token_start]
    return k, v


def generate(target, request_id: str, *, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 0.0,
             top_k: int = 0, seed: int = 0, stop_token_ids: Iterable[int] = (), ignore_eos: bool = False,
             kv_timeout_ms: int = 0, lease: str = "", token: Optional[str] = None,
             stop: Iterable[str] = (), min_tokens: int = 0, top_logprobs: int = 0,
             repetition_penalty: float = 0.0, presence_penalty: float = 0.0,
             frequency_penalty: float = 0.0) -> Iterator[decode_pb2.Token]:
    """Yields tokens as they stream; the generator's return value is the `Finish` event.

    `lease` is the push's `PushKvResponse.lease`; a node run with --require-lease refuses without it.
    `stop` strings end the text before the first one; penalties and `min_tokens` follow vLLM.
    """
    req = _generate_request(request_id, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=seed, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                            kv_timeout_ms=kv_timeout_ms, lease=lease, stop=stop, min_tokens=min_tokens,
                            top_logprobs=top_logprobs, repetition_penalty=repetition_penalty,
                            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty)
    stub = decode_pb2_grpc.DecodeStub(_channel(target))
    try:
        for ev in stub.Generate(req, metadata=_metadata(token)):
            if ev.HasField("token"):
                yield ev.token
            elif ev.HasField("finish"):
                return ev.finish
    except grpc.RpcError as e:
        raise DecodeNodeError(e.code(), e.details()) from None
    raise DecodeNodeError(grpc.StatusCode.UNKNOWN, "stream ended without a Finish event")


def generate_all(target, request_id: str, **kw) -> Tuple[list, decode_pb2.Finish]:
    """Runs `generate` to its end: (tokens, finish)."""
    tokens = []
    gen = generate(target, request_id, **kw)
    while True:
        try:
            tokens.append(next(gen))
        except StopIteration as stop:
            return tokens, stop.value
