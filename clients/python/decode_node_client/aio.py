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
    _push_plan, to_layers

__all__ = ["push_kv", "generate", "generate_all", "Generation", "model_info", "get_load", "watch_load", "cancel",
           "drop_kv", "channel"]


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
                  token: Optional[str] = None, timeout: Optional[float] = None) -> kv_transfer_pb2.PushKvResponse:
    """Streams one prompt's KV to the node and returns the commit acknowledgement (see
    `decode_node_client.push_kv`). Chunks are encoded as the stream takes them."""
    layers = to_layers(past_key_values)
    _push_plan(layers, prompt_token_ids, chunk_tokens)
    async with _open(target) as ch:
        if model_id is None or dtype is None:
            info = await model_info(ch, token)
            model_id = model_id or info.model_id
            dtype = info.kv_dtype if dtype is None else dtype
        messages = _push_messages(request_id, layers, prompt_token_ids, next_token_id, model_id, dtype,
                                  chunk_tokens)
        last = None
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
