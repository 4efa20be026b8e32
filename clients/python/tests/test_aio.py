"""The asyncio client against a real `decode-node serve` (no pytest plugin: each test runs its loop)."""
import asyncio
import time

import grpc
import pytest

from conftest import golden, load
from decode_node_client import DecodeNodeError, aio


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def pool_empty(target, seconds=10.0):
    deadline = time.time() + seconds
    while (await aio.get_load(target)).host_kv_bytes_used != 0 and time.time() < deadline:
        await asyncio.sleep(0.02)
    return (await aio.get_load(target)).host_kv_bytes_used == 0


def test_push_and_generate_concurrently_on_one_channel(node):
    g, layers = golden()
    prompt, greedy = g["prompt"].tolist(), g["greedy"].tolist()

    async def one(ch, rid):
        ack = await aio.push_kv(ch, rid, layers, prompt, greedy[0], chunk_tokens=5)
        assert ack.committed and ack.bytes_received == sum(k.nbytes + v.nbytes for k, v in layers)
        gen = aio.generate(ch, rid, max_new_tokens=len(greedy) - 1, ignore_eos=True)
        ids = [t.id async for t in gen]
        assert gen.finish is not None and gen.finish.generated_tokens == len(greedy) - 1
        with pytest.raises(RuntimeError):
            gen.__aiter__()
        return ids

    async def main():
        ch = aio.channel(node)
        try:
            got = await asyncio.gather(*(one(ch, f"aio-{i}") for i in range(3)))
            assert (await aio.model_info(ch)).num_layers == len(layers)
            assert await pool_empty(ch)
        finally:
            await ch.close()
        return got

    for ids in run(main()):
        assert ids == greedy[1:]


def test_generate_all_from_an_address_and_errors_carry_codes(node):
    g, layers = golden()
    prompt, greedy = g["prompt"].tolist(), g["greedy"].tolist()

    async def main():
        await aio.push_kv(node, "aio-all", layers, prompt, greedy[0])
        tokens, finish = await aio.generate_all(node, "aio-all", max_new_tokens=4, ignore_eos=True, top_logprobs=2)
        assert [t.id for t in tokens] == greedy[1:5] and finish.generated_tokens == 4
        assert all(len(t.top_logprobs) == 2 for t in tokens)
        with pytest.raises(DecodeNodeError) as e:
            await aio.generate_all(node, "aio-never-pushed", max_new_tokens=2, kv_timeout_ms=50)
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(DecodeNodeError) as e:
            await aio.push_kv(node, "aio-bad", layers, prompt, greedy[0], model_id="not-this-model")
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(ValueError):
            await aio.push_kv(node, "aio-bad", layers, prompt[:-1], greedy[0])
        with pytest.raises(TypeError):
            aio.generate(node, "aio-all", no_such_parameter=1)

    run(main())


def test_drop_cancel_and_a_stream_ended_early_free_the_kv(node):
    g, layers = golden()
    prompt, greedy = g["prompt"].tolist(), g["greedy"].tolist()

    async def main():
        await aio.push_kv(node, "aio-drop", layers, prompt, greedy[0])
        assert (await aio.get_load(node)).host_kv_bytes_used > 0
        dropped = await aio.drop_kv(node, "aio-drop")
        assert dropped.dropped and dropped.bytes_freed > 0
        with pytest.raises(DecodeNodeError) as e:
            await aio.drop_kv(node, "aio-drop")
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        assert not await aio.cancel(node, "aio-never-pushed")
        await aio.push_kv(node, "aio-cancel", layers, prompt, greedy[0])
        assert await aio.cancel(node, "aio-cancel")
        # A consumer that stops after two tokens of many: the node ends the request.
        await aio.push_kv(node, "aio-early", layers, prompt, greedy[0])
        gen = aio.generate(node, "aio-early", max_new_tokens=400, ignore_eos=True)
        it = gen.__aiter__()
        assert (await it.__anext__()).id == greedy[1]
        await it.__anext__()
        await it.aclose()
        assert gen.finish is None
        assert await pool_empty(node)

    run(main())
    assert load(node).host_kv_bytes_used == 0


def test_watch_load_streams_until_the_consumer_stops(node):
    async def main():
        reports = aio.watch_load(node, interval_ms=10)
        first = await reports.__anext__()
        assert first.host_kv_bytes_capacity > 0
        await reports.__anext__()
        await reports.aclose()
        with pytest.raises(DecodeNodeError) as e:
            await aio.watch_load(node, interval_ms=500).__anext__()
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT

    run(main())


def test_push_stream_layer_by_layer_tensor_parallel_ranks_and_aborts(node):
    g, layers = golden()
    prompt, greedy = g["prompt"].tolist(), g["greedy"].tolist()
    _, heads, dim = layers[0][0].shape
    shape = dict(num_layers=len(layers), num_kv_heads=heads, head_dim=dim)

    async def rank(ch, rid, h):
        # Rank h of `heads` pushes KV head h on its own stream of the push.
        async with aio.PushStream(ch, rid, prompt, num_streams=heads, chunk_tokens=3, **shape) as s:
            assert s.lease
            for layer, (k, v) in enumerate(layers):
                await s.push(layer, k[:, h:h + 1], v[:, h:h + 1], head_start=h)
            return await s.commit(next_token_id=greedy[0])

    async def main():
        ch = aio.channel(node)
        try:
            # One stream, layer by layer.
            async with aio.PushStream(ch, "aio-stream", prompt, chunk_tokens=4, **shape) as s:
                for layer, (k, v) in enumerate(layers):
                    await s.push(layer, k, v)
                ack = await s.commit(next_token_id=greedy[0])
            assert ack.committed and ack.lease == s.lease
            got, _ = await aio.generate_all(ch, "aio-stream", max_new_tokens=len(greedy) - 1, ignore_eos=True)
            assert [t.id for t in got] == greedy[1:]
            # Ranks on their own streams: every commit returns the push's commit.
            acks = await asyncio.gather(*(rank(ch, "aio-tp", h) for h in range(heads)))
            assert all(a.committed for a in acks) and len({a.lease for a in acks}) == 1
            got, _ = await aio.generate_all(ch, "aio-tp", max_new_tokens=len(greedy) - 1, ignore_eos=True)
            assert [t.id for t in got] == greedy[1:]
            # A refused header is refused on entry, before any chunk.
            with pytest.raises(DecodeNodeError) as e:
                async with aio.PushStream(ch, "aio-bad", prompt, model_id="other", **shape):
                    pass
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
            # An exception inside the block aborts the push: the node frees it.
            with pytest.raises(KeyError):
                async with aio.PushStream(ch, "aio-abort", prompt, **shape) as s:
                    await s.push(0, *layers[0])
                    raise KeyError("producer failed")
            assert await pool_empty(ch)
            # A push with a bad part is refused with the node's code.
            with pytest.raises(ValueError):
                async with aio.PushStream(ch, "aio-shape", prompt, **shape) as s:
                    await s.push(len(layers), *layers[0])
            assert await pool_empty(ch)
        finally:
            await ch.close()

    run(main())
