"""asyncio API of the decode-node client: the calls of `decode_node_client` on grpc.aio.

    from decode_node_client import aio
    await aio.push_kv("127.0.0.1:50051", "req-1", outputs.past_key_values, prompt_ids, next_token_id)
    gen = aio.generate("127.0.0.1:50051", "req-1", max_new_tokens=32)
    async for tok in gen:
        print(tok.text, end="", flush=True)
    print(gen.finish.reason)

Every call takes a target address or a `grpc.aio.Channel` (from `aio.channel(...)`, the same TLS
options as the blocking API). A channel made from an address lives for one call and is closed
after it; pass a channel to reuse its connection across calls.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Optional, Sequence, Tuple

import grpc
from grpc import aio as grpc_aio

from decode_node.v1 import decode_pb2, decode_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc

from . import DecodeNodeError, _channel_args, _committed, _generate_request, _metadata, _push_messages, \
    _push_plan, _stream_chunk, _stream_header, _stream_parts, to_layers

__all__ = ["push_kv", "PushStream", "generate", "generate_all", "Generation", "model_info", "get_load",
           "watch_load", "cancel", "drop_kv", "channel"]


def channel(target: str, *, ca_cert: Optional[str] = None, client_cert: Optional[str] = None,
            client_key: Optional[str] = None, domain: Optional[str] = None) -> grpc_aio.Channel:
    """An asyncio channel to a node; the options of `decode_node_client.channel`."""
    creds, options = _channel_args(ca_cert, client_cert, client_key, domain)
    if creds is None:
        return grpc_aio.insecure_channel(target, options=options)
    return grpc_aio.secure_channel(target, creds, options=options)


@contextlib.asynccontextmanager
async def _open(target):
    """The caller's channel as is, or one for this call from an address (closed after it)."""
    if isinstance(target, grpc_aio.Channel):
        yield target
        return
    ch = channel(target)
    try:
        yield ch
    finally:
        await ch.close()


@contextlib.asynccontextmanager
async def _codes():
    """gRPC failures as `DecodeNodeError` with their status code."""
    try:
        yield
    except grpc_aio.AioRpcError as e:
        raise DecodeNodeError(e.code(), e.details()) from None


async def model_info(target, token: Optional[str] = None) -> decode_pb2.ModelInfo:
    """The node's model id and the KV layout a push must match."""
    async with _open(target) as ch, _codes():
        return await decode_pb2_grpc.DecodeStub(ch).GetModelInfo(decode_pb2.GetModelInfoRequest(),
                                                                 metadata=_metadata(token))


async def get_load(target, token: Optional[str] = None) -> decode_pb2.LoadReport:
    """The node's load now (running and waiting requests, free memory)."""
    async with _open(target) as ch, _codes():
        return await decode_pb2_grpc.DecodeStub(ch).GetLoad(decode_pb2.GetLoadRequest(), metadata=_metadata(token))


async def cancel(target, request_id: str, lease: str = "", token: Optional[str] = None) -> bool:
    """Ends a waiting or running request and frees its KV; True when the node knew the request."""
    async with _open(target) as ch, _codes():
        r = await decode_pb2_grpc.DecodeStub(ch).Cancel(decode_pb2.CancelRequest(request_id=request_id, lease=lease),
                                                        metadata=_metadata(token))
        return r.cancelled


async def drop_kv(target, request_id: str, lease: str = "",
                  token: Optional[str] = None) -> kv_transfer_pb2.DropKvResponse:
    """Releases a pushed request's KV that will not be generated from; NOT_FOUND where none."""
    async with _open(target) as ch, _codes():
        return await kv_transfer_pb2_grpc.KvTransferStub(ch).DropKv(
            kv_transfer_pb2.DropKvRequest(request_id=request_id, lease=lease), metadata=_metadata(token))


async def watch_load(target, interval_ms: int = 0,
                     token: Optional[str] = None) -> AsyncIterator[decode_pb2.LoadReport]:
    """Yields the node's load every `interval_ms` (0: 100; at most 100) until the caller stops."""
    async with _open(target) as ch, _codes():
        call = decode_pb2_grpc.DecodeStub(ch).WatchLoad(decode_pb2.WatchLoadRequest(interval_ms=interval_ms),
                                                         metadata=_metadata(token))
        try:
            async for report in call:
                yield report
        finally:
            call.cancel()


async def push_kv(target, request_id: str, past_key_values, prompt_token_ids: Sequence[int], next_token_id: int,
                  *, model_id: Optional[str] = None, dtype: Optional[int] = None, chunk_tokens: int = 256,
                  token: Optional[str] = None, timeout: Optional[float] = None,
                  reuse_prefix: bool = False) -> kv_transfer_pb2.PushKvResponse:
    """Streams one prompt's KV to the node and returns the commit acknowledgement (see
    `decode_node_client.push_kv`, `reuse_prefix` included). Chunks are encoded as the stream
    takes them."""
    layers = to_layers(past_key_values)
    _push_plan(layers, prompt_token_ids, chunk_tokens)
    async with _open(target) as ch:
        if model_id is None or dtype is None:
            info = await model_info(ch, token)
            model_id = model_id or info.model_id
            dtype = info.kv_dtype if dtype is None else dtype
        last = None
        # The chunks start where the header's acknowledgement says (read before they are).
        messages = _push_messages(request_id, layers, prompt_token_ids, next_token_id, model_id, dtype,
                                  chunk_tokens, reuse_prefix, lambda: last.reused_tokens if reuse_prefix else 0)
        async with _codes():
            call = kv_transfer_pb2_grpc.KvTransferStub(ch).PushKv(metadata=_metadata(token), timeout=timeout)
            # The header first, then its ack: a node that refuses the push (model, layout, memory)
            # says so before any chunk is written. A write that races the end of the call makes
            # grpc.aio report INTERNAL instead of the node's status (grpc/grpc#36066).
            await call.write(next(messages))
            last = await call.read()
            if last is grpc_aio.EOF:
                raise DecodeNodeError(grpc.StatusCode.UNKNOWN, "push ended without acknowledging its header")
            try:
                for m in messages:
                    await call.write(m)
                await call.done_writing()
            except asyncio.InvalidStateError:
                pass  # the call ended; reading it raises its status
            while (ack := await call.read()) is not grpc_aio.EOF:
                last = ack
    return _committed(last)


class PushStream:
    """One prompt's KV pushed piece by piece as the producer computes it, on asyncio (see
    `decode_node_client.PushStream`): `push` writes each chunk as the stream takes it, `commit`
    returns the node's acknowledgement, and leaving an `async with` block on an exception (or
    without a commit) aborts the push, which frees what the node held.

        async with aio.PushStream(target, "r1", prompt_ids, num_layers=L, num_kv_heads=H,
                                  head_dim=D) as s:
            for layer in range(L):
                await s.push(layer, k, v)
            ack = await s.commit(next_token_id=sampled)

    Entering the block sends the header and waits for its acknowledgement (`s.lease` then holds
    the push's lease), so a node that refuses the push says so before any chunk is encoded.
    """

    def __init__(self, target, request_id: str, prompt_token_ids: Sequence[int], *, num_layers: int,
                 num_kv_heads: int, head_dim: int, next_token_id: Optional[int] = None,
                 model_id: Optional[str] = None, dtype: Optional[int] = None, chunk_tokens: int = 256,
                 token: Optional[str] = None, timeout: Optional[float] = None, num_streams: int = 1,
                 reuse_prefix: bool = False):
        if chunk_tokens <= 0 or num_streams <= 0:
            raise ValueError("chunk_tokens and num_streams must be positive")
        if min(num_layers, num_kv_heads, head_dim) <= 0:
            raise ValueError("num_layers, num_kv_heads and head_dim must be positive")
        self._target, self._request_id, self._prompt = target, request_id, list(prompt_token_ids)
        self._layers, self._shape, self._chunk = num_layers, (num_kv_heads, head_dim), chunk_tokens
        self._next, self._model_id, self._dtype = next_token_id, model_id, dtype
        self._token, self._timeout, self._streams = token, timeout, num_streams
        self._ch = None
        self._own = False
        self._call = None
        self._ended = False
        self._reuse = reuse_prefix
        self.lease = ""
        # Leading prompt tokens the node took from its prefix cache (with `reuse_prefix`), known
        # once the block is entered: `push` leaves them out.
        self.reused_tokens = 0

    async def __aenter__(self) -> "PushStream":
        if isinstance(self._target, grpc_aio.Channel):
            self._ch = self._target
        else:
            self._ch, self._own = channel(self._target), True
        try:
            if self._model_id is None or self._dtype is None:
                info = await model_info(self._ch, self._token)
                self._model_id = self._model_id or info.model_id
                self._dtype = info.kv_dtype if self._dtype is None else self._dtype
            async with _codes():
                self._call = kv_transfer_pb2_grpc.KvTransferStub(self._ch).PushKv(
                    metadata=_metadata(self._token), timeout=self._timeout)
                # The header's ack before any chunk (see `push_kv`: grpc/grpc#36066).
                await self._call.write(_stream_header(
                    self._request_id, self._prompt, self._layers, self._shape[0], self._shape[1], self._model_id,
                    self._dtype, self._next, self._streams, self._reuse))
                ack = await self._call.read()
            if ack is grpc_aio.EOF:
                raise DecodeNodeError(grpc.StatusCode.UNKNOWN, "push ended without acknowledging its header")
            self.lease = ack.lease
            self.reused_tokens = ack.reused_tokens
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if not self._ended:
            await self.abort()
        await self._close()

    async def _close(self) -> None:
        if self._own and self._ch is not None:
            await self._ch.close()
            self._ch = None

    def _check(self) -> None:
        if self._call is None:
            raise RuntimeError("use the PushStream in `async with` first")
        if self._ended:
            raise RuntimeError("the push has ended")

    async def _failed(self) -> DecodeNodeError:
        """The call's status once a write found it ended."""
        self._ended = True
        try:
            while await self._call.read() is not grpc_aio.EOF:
                pass
        except grpc_aio.AioRpcError as e:
            return DecodeNodeError(e.code(), e.details())
        return DecodeNodeError(grpc.StatusCode.UNKNOWN, "push ended early")

    async def push(self, layer: int, k, v, token_start: int = 0, head_start: int = 0) -> None:
        """Writes tokens [token_start, token_start + len(k)) of `layer`, KV heads
        [head_start, head_start + heads): as `decode_node_client.PushStream.push`."""
        self._check()
        for part in _stream_parts(layer, k, v, token_start, head_start, self._shape, self._layers,
                                  len(self._prompt), self._chunk, self.reused_tokens):
            try:
                await self._call.write(_stream_chunk(*part, heads=self._shape[0], dtype=self._dtype))
            except (asyncio.InvalidStateError, grpc_aio.AioRpcError):
                raise await self._failed() from None

    async def commit(self, next_token_id: Optional[int] = None) -> kv_transfer_pb2.PushKvResponse:
        """Ends the push and returns the node's commit acknowledgement (with several streams,
        once every stream has committed); `next_token_id` replaces the header's."""
        self._check()
        self._ended = True
        last = None
        async with _codes():
            try:
                await self._call.write(kv_transfer_pb2.PushKvRequest(commit=kv_transfer_pb2.KvCommit(
                    next_token_id=None if next_token_id is None else int(next_token_id))))
                await self._call.done_writing()
            except asyncio.InvalidStateError:
                pass  # the call ended; reading it raises its status
            while (ack := await self._call.read()) is not grpc_aio.EOF:
                last = ack
        return _committed(last)

    async def abort(self) -> None:
        """Ends the push without committing; the node frees what it held."""
        self._ended = True
        if self._call is not None:
            self._call.cancel()


class Generation:
    """A generation's tokens as an async iterator (once); `finish` is the `Finish` event after
    the last token. `cancel()` ends the stream (the node stops the request and frees its KV)."""

    def __init__(self, target, request: decode_pb2.GenerateRequest, token: Optional[str]):
        self._target, self._request, self._token = target, request, token
        self._call = None
        self._started = False
        self.finish: Optional[decode_pb2.Finish] = None

    def __aiter__(self) -> AsyncIterator[decode_pb2.Token]:
        if self._started:
            raise RuntimeError("a Generation is iterated once")
        self._started = True
        return self._tokens()

    async def _tokens(self) -> AsyncIterator[decode_pb2.Token]:
        async with _open(self._target) as ch, _codes():
            self._call = decode_pb2_grpc.DecodeStub(ch).Generate(self._request, metadata=_metadata(self._token))
            try:
                async for ev in self._call:
                    if ev.HasField("token"):
                        yield ev.token
                    elif ev.HasField("finish"):
                        self.finish = ev.finish
                        return
            finally:
                if self.finish is None:
                    self._call.cancel()
        raise DecodeNodeError(grpc.StatusCode.UNKNOWN, "stream ended without a Finish event")

    def cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()


def generate(target, request_id: str, *, token: Optional[str] = None, **params) -> Generation:
    """The tokens of a generation as they stream (`async for`); the parameters of
    `decode_node_client.generate`. Nothing is sent until the iteration starts."""
    return Generation(target, _generate_request(request_id, **params), token)


async def generate_all(target, request_id: str, **kw) -> Tuple[list, decode_pb2.Finish]:
    """Runs `generate` to its end: (tokens, finish)."""
    gen = generate(target, request_id, **kw)
    tokens = [t async for t in gen]
    if gen.finish is None:  # the iteration raises first; kept for type checkers
        raise DecodeNodeError(grpc.StatusCode.UNKNOWN, "stream ended without a Finish event")
    return tokens, gen.finish
