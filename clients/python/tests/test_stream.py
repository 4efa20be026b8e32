"""Layer-streaming pushes from a paged cache (as a prefill engine holds KV) against a real node."""
import time

import grpc
import numpy as np
import pytest

from conftest import golden, load
from decode_node_client import DecodeNodeError, PushStream, gather_paged, generate_all

BLOCK = 4


def paged(layers, layout, seed):
    """The golden KV in a paged cache of `layout` with a shuffled block table, per layer."""
    tokens, heads, dim = layers[0][0].shape
    nblocks = -(-tokens // BLOCK)
    rng = np.random.default_rng(seed)
    table = list(rng.permutation(nblocks + 3)[:nblocks])  # spare blocks stay garbage
    caches = []
    for k, v in layers:
        if layout == "flashinfer":
            cache = rng.standard_normal((nblocks + 3, 2, BLOCK, heads, dim)).astype(np.float32)
        elif layout == "flash_attn_hnd":
            cache = rng.standard_normal((2, nblocks + 3, heads, BLOCK, dim)).astype(np.float32)
        else:
            cache = rng.standard_normal((2, nblocks + 3, BLOCK, heads, dim)).astype(np.float32)
        for t in range(tokens):
            b, s = table[t // BLOCK], t % BLOCK
            for which, x in ((0, k[t]), (1, v[t])):
                if layout == "flashinfer":
                    cache[b, which, s] = x
                elif layout == "flash_attn_hnd":
                    cache[which, b, :, s] = x
                else:
                    cache[which, b, s] = x
        caches.append(cache)
    return caches, table


@pytest.mark.parametrize("layout", ["flash_attn", "flash_attn_hnd", "flashinfer"])
def test_chunked_prefill_streamed_layer_by_layer_decodes_like_a_whole_push(node, layout):
    g, layers = golden()
    prompt, greedy = g["prompt"].tolist(), g["greedy"].tolist()
    tokens, heads, dim = layers[0][0].shape
    caches, table = paged(layers, layout, seed=len(layout))
    for (k, v), cache in zip(layers, caches):
        gk, gv = gather_paged(cache, table, 0, tokens, layout=layout)
        assert np.array_equal(gk, k) and np.array_equal(gv, v)
    rid = f"stream-{layout}"
    with PushStream(node, rid, prompt, num_layers=len(layers), num_kv_heads=heads, head_dim=dim,
                    chunk_tokens=3) as s:
        # Two chunked-prefill steps, each streaming every layer as it is computed.
        cut = tokens // 2 + 1
        for lo, hi in ((0, cut), (cut, tokens)):
            for layer, cache in enumerate(caches):
                s.push(layer, *gather_paged(cache, table, lo, hi, layout=layout), token_start=lo)
        ack = s.commit(next_token_id=greedy[0])  # sampled after the last layer
    assert ack.committed and ack.bytes_received == sum(k.nbytes + v.nbytes for k, v in layers)
    got, finish = generate_all(node, rid, max_new_tokens=len(greedy) - 1, ignore_eos=True)
    assert [t.id for t in got] == greedy[1:] and finish.generated_tokens == len(greedy) - 1


def test_tensor_parallel_ranks_push_their_own_heads_into_one_request(node):
    g, layers = golden()
    prompt, greedy = g["prompt"].tolist(), g["greedy"].tolist()
    tokens, heads, dim = layers[0][0].shape
    assert heads >= 2, "the golden model needs two KV heads to split"
    ranks = [(0, heads // 2), (heads // 2, heads)]
    with PushStream(node, "stream-tp", prompt, num_layers=len(layers), num_kv_heads=heads, head_dim=dim) as s:
        for layer, (k, v) in enumerate(layers):
            for lo, hi in reversed(ranks):
                s.push(layer, k[:, lo:hi], v[:, lo:hi], head_start=lo)
        with pytest.raises(ValueError):
            s.push(0, k[:, :1], v[:, :1], head_start=heads)
        ack = s.commit(next_token_id=greedy[0])
    assert ack.bytes_received == sum(k.nbytes + v.nbytes for k, v in layers)
    got, _ = generate_all(node, "stream-tp", max_new_tokens=len(greedy) - 1, ignore_eos=True)
    assert [t.id for t in got] == greedy[1:]


def test_an_aborted_or_refused_stream_frees_the_pool(node):
    g, layers = golden()
    prompt, greedy = g["prompt"].tolist(), g["greedy"].tolist()
    tokens, heads, dim = layers[0][0].shape
    with pytest.raises(ZeroDivisionError):
        with PushStream(node, "stream-abort", prompt, num_layers=len(layers), num_kv_heads=heads,
                        head_dim=dim) as s:
            s.push(0, *layers[0])
            1 / 0  # the producer fails mid-forward
    with pytest.raises(RuntimeError):
        s.push(1, *layers[1])
    deadline = time.time() + 10
    while load(node).host_kv_bytes_used != 0 and time.time() < deadline:
        time.sleep(0.02)
    assert load(node).host_kv_bytes_used == 0
    # The node refuses the header: the error carries its code at the next call.
    s = PushStream(node, "stream-bad", prompt, num_layers=len(layers), num_kv_heads=heads, head_dim=dim,
                   model_id="not-this-model")
    with pytest.raises(DecodeNodeError) as e:
        for _ in range(100):
            s.push(0, *layers[0])
            time.sleep(0.02)
        s.commit(greedy[0])
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    # Bad shapes and ranges never reach the node.
    s = PushStream(node, "stream-shape", prompt, num_layers=len(layers), num_kv_heads=heads, head_dim=dim)
    with pytest.raises(ValueError):
        s.push(0, layers[0][0][:, :, :1], layers[0][1][:, :, :1])
    with pytest.raises(ValueError):
        s.push(len(layers), *layers[0])
    with pytest.raises(ValueError):
        s.push(0, *layers[0], token_start=1)
    # A commit with tokens missing is refused by the node.
    s.push(0, *layers[0])
    with pytest.raises(DecodeNodeError) as e:
        s.commit(greedy[0])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ValueError):
        gather_paged(np.zeros((2, 2, BLOCK, heads, dim)), [0, 1], 0, 2 * BLOCK + 1)


def test_ranks_in_separate_streams_assemble_one_push_or_fail_together(node):
    """Two producers (tensor-parallel ranks in separate processes) push their own KV heads on
    their own streams of one push; each commit returns once both have committed. When one rank
    aborts, the other's push fails too and the node holds nothing."""
    import threading
    g, layers = golden()
    prompt, greedy = g["prompt"].tolist(), g["greedy"].tolist()
    _, heads, dim = layers[0][0].shape
    assert heads == 2

    def rank(rid, h, acks, fail=False):
        s = PushStream(node, rid, prompt, num_layers=len(layers), num_kv_heads=heads, head_dim=dim,
                       num_streams=2)
        for layer, (k, v) in enumerate(layers):
            s.push(layer, k[:, h:h + 1], v[:, h:h + 1], head_start=h)
        if fail:
            time.sleep(0.2)
            s.abort()
            return
        try:
            acks[h] = s.commit(next_token_id=greedy[0], timeout=20)
        except DecodeNodeError as e:
            acks[h] = e

    acks = {}
    threads = [threading.Thread(target=rank, args=("tp-ok", h, acks)) for h in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert acks[0].committed and acks[1].committed and acks[0].lease == acks[1].lease
    got, _ = generate_all(node, "tp-ok", max_new_tokens=len(greedy) - 1, ignore_eos=True)
    assert [t.id for t in got] == greedy[1:]

    acks = {}
    threads = [threading.Thread(target=rank, args=("tp-fail", h, acks, h == 1)) for h in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert isinstance(acks[0], DecodeNodeError) and acks[0].code == grpc.StatusCode.ABORTED, acks[0]
    deadline = time.time() + 10
    while load(node).host_kv_bytes_used != 0 and time.time() < deadline:
        time.sleep(0.02)
    assert load(node).host_kv_bytes_used == 0
