"""A second push of a conversation's start reuses what the node's prefix cache holds: the
header's acknowledgement names the tokens, only the rest is sent, and decoding is unchanged."""
import asyncio

import pytest

from conftest import golden, serve  # noqa: E402
from decode_node_client import PushStream, aio, generate_all, push_kv, watch_kv_events  # noqa: E402

BLOCK = 4


@pytest.fixture(scope="module")
def caching_node():
    yield from serve("--prefix-cache-bytes", "64Mi", "--block-size", str(BLOCK))


def _rest_bytes(layers, start):
    return sum(k[start:].nbytes + v[start:].nbytes for k, v in layers)


def test_a_repeated_prompt_sends_only_what_the_node_lacks(caching_node):
    g, layers = golden()
    prompt, greedy = g["prompt"].tolist(), g["greedy"].tolist()
    first = push_kv(caching_node, "pc-1", layers, prompt, greedy[0], reuse_prefix=True, chunk_tokens=5)
    assert first.reused_tokens == 0 and first.bytes_received == _rest_bytes(layers, 0)
    tokens, _ = generate_all(caching_node, "pc-1", max_new_tokens=4, ignore_eos=True)
    assert [t.id for t in tokens] == greedy[1:5]

    whole = len(prompt) // BLOCK * BLOCK
    assert whole > 0, "the golden prompt must span a whole block"
    again = push_kv(caching_node, "pc-2", layers, prompt, greedy[0], reuse_prefix=True, chunk_tokens=5)
    assert again.committed and again.reused_tokens == whole
    assert again.bytes_received == _rest_bytes(layers, whole)
    tokens, _ = generate_all(caching_node, "pc-2", max_new_tokens=4, ignore_eos=True)
    assert [t.id for t in tokens] == greedy[1:5]

    # Without asking, everything is sent.
    plain = push_kv(caching_node, "pc-3", layers, prompt, greedy[0])
    assert plain.reused_tokens == 0 and plain.bytes_received == _rest_bytes(layers, 0)
    generate_all(caching_node, "pc-3", max_new_tokens=1, ignore_eos=True)


def test_the_asyncio_push_reuses_too(caching_node):
    g, layers = golden()
    prompt, greedy = g["prompt"].tolist(), g["greedy"].tolist()

    async def run():
        await aio.push_kv(caching_node, "pc-a1", layers, prompt, greedy[0], reuse_prefix=True)
        await aio.generate_all(caching_node, "pc-a1", max_new_tokens=2, ignore_eos=True)
        ack = await aio.push_kv(caching_node, "pc-a2", layers, prompt, greedy[0], reuse_prefix=True)
        tokens, _ = await aio.generate_all(caching_node, "pc-a2", max_new_tokens=2, ignore_eos=True)
        return ack, [t.id for t in tokens]

    ack, ids = asyncio.run(run())
    whole = len(prompt) // BLOCK * BLOCK
    assert ack.reused_tokens == whole and ack.bytes_received == _rest_bytes(layers, whole)
    assert ids == greedy[1:3]


def test_kv_events_stream_a_snapshot_then_what_is_stored(caching_node):
    g, layers = golden()
    prompt, greedy = g["prompt"].tolist(), g["greedy"].tolist()
    events = watch_kv_events(caching_node)
    first = next(events)
    assert first.snapshot
    known = {h for e in first.events for h in e.stored.block_hashes}
    push_kv(caching_node, "pc-ev", layers, prompt, greedy[0])
    generate_all(caching_node, "pc-ev", max_new_tokens=BLOCK + 1, ignore_eos=True)
    # The prompt's blocks may be cached already (earlier tests): new ones follow them.
    held = len(prompt) + BLOCK
    new = next(events)
    assert not new.snapshot and new.events[0].HasField("stored")
    stored = new.events[0].stored
    assert stored.block_size == BLOCK
    assert len(known) + len(stored.block_hashes) >= held // BLOCK
    events.close()


def test_push_streams_leave_out_what_the_node_reused(caching_node):
    g, layers = golden()
    prompt, greedy = g["prompt"].tolist(), g["greedy"].tolist()
    _, heads, dim = layers[0][0].shape
    whole = len(prompt) // BLOCK * BLOCK
    push_kv(caching_node, "pc-s0", layers, prompt, greedy[0])
    generate_all(caching_node, "pc-s0", max_new_tokens=1, ignore_eos=True)
    with PushStream(caching_node, "pc-s1", prompt, num_layers=len(layers), num_kv_heads=heads, head_dim=dim,
                    reuse_prefix=True, chunk_tokens=3) as s:
        assert s.reused_tokens == whole
        for i, (k, v) in enumerate(layers):
            s.push(i, k, v)  # the whole layer: the reused tokens are left out
        ack = s.commit(next_token_id=greedy[0])
    assert ack.reused_tokens == whole and ack.bytes_received == _rest_bytes(layers, whole)
    tokens, _ = generate_all(caching_node, "pc-s1", max_new_tokens=3, ignore_eos=True)
    assert [t.id for t in tokens] == greedy[1:4]

    async def run():
        async with aio.PushStream(caching_node, "pc-s2", prompt, num_layers=len(layers), num_kv_heads=heads,
                                  head_dim=dim, reuse_prefix=True) as a:
            assert a.reused_tokens == whole
            for i, (k, v) in enumerate(layers):
                await a.push(i, k, v)
            ack = await a.commit(next_token_id=greedy[0])
        tokens, _ = await aio.generate_all(caching_node, "pc-s2", max_new_tokens=3, ignore_eos=True)
        return ack, [t.id for t in tokens]

    ack, ids = asyncio.run(run())
    assert ack.bytes_received == _rest_bytes(layers, whole) and ids == greedy[1:4]
