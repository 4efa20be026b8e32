"""The vLLM connector driven as vLLM drives it (scheduler and worker sides in their own objects,
metadata pickled between them), over a paged numpy cache, against a real node; no vLLM needed."""
import pickle
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace as NS

import numpy as np
import pytest

from conftest import golden, load, serve
from decode_node_client import generate_all
from decode_node_client import vllm_connector
from decode_node_client.vllm_connector import PUSH_ID, PUSH_REUSE, PUSH_TARGET, DecodeNodeConnector, KVConnectorRole

BLOCK = 4


def config(target, tp=1, pp=1, kv_heads=None, **extra):
    return NS(kv_transfer_config=NS(kv_connector_extra_config={"target": target, **extra}),
              parallel_config=NS(tensor_parallel_size=tp, pipeline_parallel_size=pp),
              model_config=NS(get_total_num_kv_heads=lambda: kv_heads) if kv_heads else None)


def scheduler_output(new=(), cached=(), scheduled=None):
    """`new`: (req_id, block_ids, num_computed); `cached`: (req_id, new_block_ids, num_computed)."""
    return NS(
        scheduled_new_reqs=[NS(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=NS(req_ids=[r for r, _, _ in cached], resumed_req_ids=set(),
                                 new_block_ids=[(b,) if b else None for _, b, _ in cached],
                                 num_computed_tokens=[c for _, _, c in cached]),
        num_scheduled_tokens=scheduled or {})


def step(sched, worker, out, caches, names, loads_after_forward=False):
    """One engine step: metadata to the worker (pickled, as between processes), then the forward.
    vLLM 0.32 starts a step's asynchronous loads after its forward (`loads_after_forward`)."""
    meta = pickle.loads(pickle.dumps(sched.build_connector_meta(out)))
    worker.bind_connector_metadata(meta)
    if not loads_after_forward:
        worker.start_load_kv(None)
    for name in names:
        worker.save_kv_layer(name, caches[name], None)
    if loads_after_forward:
        worker.start_load_kv(None)
    worker.wait_for_save()
    worker.clear_connector_metadata()


def put(cache, layout, block, slot, k, v):
    """Writes one token's K and V ([heads, head_dim]) into a paged cache of `layout`."""
    if layout == "flash_attn":
        cache[0, block, slot], cache[1, block, slot] = k, v
    elif layout == "vllm_bhnc":
        dim = k.shape[-1]
        cache[block, :, slot, :dim], cache[block, :, slot, dim:] = k, v
    else:  # vLLM's CPU backend, AMX-packed (pinned to vLLM's own kernel by test_paged.py)
        _, heads, size, content = cache.shape
        dim = content // 2
        halves = cache.reshape(cache.shape[0], heads, 2, size * dim)
        d = np.arange(dim)  # the indexed result is [head_dim, heads]
        halves[block, :, 0, (slot // 16) * 16 * dim + (d // 2) * 32 + (slot % 16) * 2 + d % 2] = k.T
        halves[block, :, 1, (d // 16) * size * 16 + (slot // 2) * 32 + (d % 16) * 2 + slot % 2] = v.T


def paged(layers, seed=3, layout="flash_attn", block=BLOCK):
    """The golden KV in a paged numpy cache (noise elsewhere) at a shuffled block table."""
    tokens, heads, dim = layers[0][0].shape
    nblocks = -(-tokens // block)
    rng = np.random.default_rng(seed)
    table = [int(b) for b in rng.permutation(nblocks + 4)[:nblocks]]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(len(layers))]
    shape = (2, nblocks + 4, block, heads, dim) if layout == "flash_attn" else (nblocks + 4, heads, block, 2 * dim)
    caches = {}
    for name, (k, v) in zip(names, layers):
        cache = rng.standard_normal(shape).astype(np.float32)
        for t in range(tokens):
            put(cache, layout, table[t // block], t % block, k[t], v[t])
        caches[name] = cache
    return table, names, caches


@pytest.mark.parametrize("layout,loads_after_forward", [
    ("flash_attn", False),  # vLLM before 0.32: 5-d caches, loads started before the forward
    ("vllm_bhnc", True),  # vLLM 0.32 on a GPU: [B, H, N, C] views, loads after the forward
    ("amx", True),  # vLLM 0.32 on a CPU with AMX: its kernel's packing, found from the layer
])
def test_a_chunked_prefill_reaches_the_node_and_decodes_the_golden_greedy(node, layout, loads_after_forward):
    g, layers = golden()
    prompt, greedy = g["prompt"].tolist(), g["greedy"].tolist()
    tokens = layers[0][0].shape[0]
    block = 16 if layout == "amx" else BLOCK  # AMX packs 16-token tiles
    table, names, caches = paged(layers, layout="vllm_cpu_amx" if layout == "amx" else layout, block=block)
    cfg = config(node)
    if layout == "amx":  # what `auto` picks on vLLM's CPU platform; the layers carry their kernel
        cfg = config(node, layout="vllm_cpu_by_isa")
        cfg.compilation_config = NS(static_forward_context={n: NS(isa="amx") for n in names})
    sched = DecodeNodeConnector(cfg, KVConnectorRole.SCHEDULER)
    worker = DecodeNodeConnector(cfg, KVConnectorRole.WORKER)
    worker.register_kv_caches(caches)
    req = NS(request_id=f"vllm-1-{layout}", prompt_token_ids=prompt, kv_transfer_params={PUSH_ID: f"dn-1-{layout}"},
             output_token_ids=[])
    other = NS(request_id="vllm-2", prompt_token_ids=prompt[:5], kv_transfer_params=None, output_token_ids=[])
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, None, 0)
    sched.update_state_after_alloc(other, None, 0)
    # Chunked prefill: the first step computes `cut` tokens with the blocks allocated so far.
    cut = block + 1
    first_blocks = -(-cut // block)
    step(sched, worker, scheduler_output(new=[(f"vllm-1-{layout}", table[:first_blocks], 0), ("vllm-2", [0], 0)],
                                         scheduled={f"vllm-1-{layout}": cut, "vllm-2": 5}), caches, names,
         loads_after_forward)
    step(sched, worker, scheduler_output(cached=[(f"vllm-1-{layout}", table[first_blocks:], cut)],
                                         scheduled={f"vllm-1-{layout}": tokens - cut}), caches, names,
         loads_after_forward)
    # The prefill sampled its token; the request finishes and the next step commits.
    req.output_token_ids = [greedy[0]]
    done, params = sched.request_finished(req, table)
    assert not done and params == {PUSH_ID: f"dn-1-{layout}", PUSH_TARGET: node}
    assert sched.request_finished(other, [0]) == (False, None)
    assert sched.has_pending_push_work()
    step(sched, worker, scheduler_output(), caches, names, loads_after_forward)
    assert not sched.has_pending_push_work()
    got, finish = generate_all(node, f"dn-1-{layout}", max_new_tokens=len(greedy) - 1, ignore_eos=True)
    assert [t.id for t in got] == greedy[1:] and finish.generated_tokens == len(greedy) - 1
    worker.shutdown()


def test_an_unfinished_prefill_is_aborted_and_frees_the_node(node):
    g, layers = golden()
    prompt = g["prompt"].tolist()
    tokens, heads, dim = layers[0][0].shape
    names = [f"l{i}" for i in range(len(layers))]
    caches = {n: np.zeros((2, 64, BLOCK, heads, dim), np.float32) for n in names}
    sched = DecodeNodeConnector(config(node), KVConnectorRole.SCHEDULER)
    worker = DecodeNodeConnector(config(node), KVConnectorRole.WORKER)
    worker.register_kv_caches(caches)
    req = NS(request_id="vllm-3", prompt_token_ids=prompt, kv_transfer_params={PUSH_ID: "dn-3"},
             output_token_ids=[])
    sched.update_state_after_alloc(req, None, 0)
    step(sched, worker, scheduler_output(new=[("vllm-3", [1, 2], 0)], scheduled={"vllm-3": 2 * BLOCK}),
         caches, names)
    deadline = time.time() + 10  # the header reaches the node from gRPC's thread
    while load(node).host_kv_bytes_used == 0 and time.time() < deadline:
        time.sleep(0.01)
    assert load(node).host_kv_bytes_used > 0
    sched.request_finished(req, [1, 2])  # aborted by the engine before the prompt was done
    step(sched, worker, scheduler_output(), caches, names)
    deadline = time.time() + 10
    while load(node).host_kv_bytes_used != 0 and time.time() < deadline:
        time.sleep(0.02)
    assert load(node).host_kv_bytes_used == 0
    with pytest.raises(ValueError):
        DecodeNodeConnector(config(node, pp=2), KVConnectorRole.WORKER)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_ranks_each_push_their_heads_into_one_request(node, monkeypatch, tp):
    """Each TP worker holds its own KV heads (with 4 ranks and 2 heads, two ranks per head) and
    pushes them on its own stream of the request's push; the node commits once every pushing
    rank has, and decodes the golden greedy."""
    g, layers = golden()
    prompt, greedy = g["prompt"].tolist(), g["greedy"].tolist()
    tokens, heads, dim = layers[0][0].shape
    nblocks = -(-tokens // BLOCK)
    table = list(range(1, nblocks + 1))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(len(layers))]
    local = max(heads // tp, 1)
    workers, caches = [], []
    for rank in range(tp):
        h0 = rank * heads // tp
        rank_caches = {}
        for name, (k, v) in zip(names, layers):
            cache = np.zeros((2, nblocks + 1, BLOCK, local, dim), np.float32)
            for t in range(tokens):
                cache[0, table[t // BLOCK], t % BLOCK] = k[t, h0:h0 + local]
                cache[1, table[t // BLOCK], t % BLOCK] = v[t, h0:h0 + local]
            rank_caches[name] = cache
        w = DecodeNodeConnector(config(node, tp=tp, kv_heads=heads), KVConnectorRole.WORKER)
        monkeypatch.setattr(vllm_connector, "_tp_rank", lambda r=rank: r)
        w.register_kv_caches(rank_caches)
        workers.append(w)
        caches.append(rank_caches)
    sched = DecodeNodeConnector(config(node, tp=tp), KVConnectorRole.SCHEDULER)
    req = NS(request_id="vllm-tp", prompt_token_ids=prompt, kv_transfer_params={PUSH_ID: f"dn-tp{tp}"},
             output_token_ids=[])
    sched.update_state_after_alloc(req, None, 0)

    def all_ranks(out):
        # The same metadata to every rank, which run at once (a rank's commit returns only
        # when every rank has committed).
        meta = pickle.dumps(sched.build_connector_meta(out))
        with ThreadPoolExecutor(tp) as pool:
            for f in [pool.submit(rank_step, w, meta, c) for w, c in zip(workers, caches)]:
                f.result()

    def rank_step(worker, meta, rank_caches):
        worker.bind_connector_metadata(pickle.loads(meta))
        worker.start_load_kv(None)
        for name in names:
            worker.save_kv_layer(name, rank_caches[name], None)
        worker.clear_connector_metadata()

    all_ranks(scheduler_output(new=[("vllm-tp", table, 0)], scheduled={"vllm-tp": tokens}))
    req.output_token_ids = [greedy[0]]
    sched.request_finished(req, table)
    all_ranks(scheduler_output())
    got, _ = generate_all(node, f"dn-tp{tp}", max_new_tokens=len(greedy) - 1, ignore_eos=True)
    assert [t.id for t in got] == greedy[1:]
    for w in workers:
        w.shutdown()


@pytest.fixture(scope="module")
def caching_node():
    yield from serve("--prefix-cache-bytes", "64Mi", "--block-size", str(BLOCK))


def test_a_repeated_prompt_gathers_and_sends_only_what_the_node_lacks(caching_node, monkeypatch):
    """With `reuse_prefix`, the second request of the same prompt gathers from the paged cache
    only the tokens after the blocks the node kept from the first, and still decodes the golden
    greedy; a request that opts out sends everything."""
    g, layers = golden()
    prompt, greedy = g["prompt"].tolist(), g["greedy"].tolist()
    tokens = len(prompt)
    whole = tokens // BLOCK * BLOCK
    assert whole > 0, "the golden prompt must span a whole block"
    table, names, caches = paged(layers)
    gathered = []
    real_gather = vllm_connector.gather_paged

    def spy(kv, blocks, start, end, **kw):
        gathered.append((start, end))
        return real_gather(kv, blocks, start, end, **kw)

    monkeypatch.setattr(vllm_connector, "gather_paged", spy)
    sched = DecodeNodeConnector(config(caching_node, reuse_prefix="true"), KVConnectorRole.SCHEDULER)
    worker = DecodeNodeConnector(config(caching_node, reuse_prefix="true"), KVConnectorRole.WORKER)
    worker.register_kv_caches(caches)

    def request(n, params):
        gathered.clear()
        req = NS(request_id=f"vllm-r{n}", prompt_token_ids=prompt, kv_transfer_params=params,
                 output_token_ids=[])
        sched.update_state_after_alloc(req, None, 0)
        step(sched, worker, scheduler_output(new=[(req.request_id, table, 0)], scheduled={req.request_id: tokens}),
             caches, names)
        req.output_token_ids = [greedy[0]]
        sched.request_finished(req, table)
        step(sched, worker, scheduler_output(), caches, names)
        got, _ = generate_all(caching_node, params[PUSH_ID], max_new_tokens=3, ignore_eos=True)
        assert [t.id for t in got] == greedy[1:4]
        return set(gathered)

    assert request(1, {PUSH_ID: "dn-r1"}) == {(0, tokens)}
    assert request(2, {PUSH_ID: "dn-r2"}) == ({(whole, tokens)} if whole < tokens else set())
    assert request(3, {PUSH_ID: "dn-r3", PUSH_REUSE: False}) == {(0, tokens)}
    with pytest.raises(ValueError):
        DecodeNodeConnector(config(caching_node, reuse_prefix="maybe"), KVConnectorRole.WORKER)
    worker.shutdown()


def test_the_layout_is_told_from_the_cache_and_the_platform():
    detect = vllm_connector._detect_layout
    assert detect((2, 64, 16, 8, 128)) == "flash_attn"
    assert detect((64, 2, 16, 8, 128)) == "flashinfer"
    assert detect((2, 2, 16, 8, 128)) == "flash_attn"  # ambiguous: vLLM's default
    assert detect((64, 8, 16, 256)) == "vllm_bhnc"  # no vLLM here, so not its CPU platform
    with pytest.raises(ValueError, match="no known paged KV layout"):
        detect((64, 16, 256))
    layers = NS(compilation_config=NS(static_forward_context={"a": NS(isa="amx"), "b": NS(isa="vec16"),
                                                              "c": NS(isa="neon"), "d": NS()}))
    assert vllm_connector._cpu_layout(layers, "a") == "vllm_cpu_amx"
    assert vllm_connector._cpu_layout(layers, "b") == "vllm_cpu"
    for name in ("c", "d", "missing"):
        with pytest.raises(ValueError, match="does not read"):
            vllm_connector._cpu_layout(layers, name)
    worker = DecodeNodeConnector(config("127.0.0.1:1", layout="flashinfer"), KVConnectorRole.WORKER)
    with pytest.raises(ValueError, match="does not fit"):
        worker.register_kv_caches({"l0": np.zeros((64, 8, 16, 256), np.float32)})


def test_a_kernel_packing_the_connector_cannot_read_fails_the_push_not_the_engine(node):
    """On a vLLM CPU kernel whose packing is unknown (say, ARM's `neon`), the push ends with a
    warning and the node frees it; the engine's forward goes on."""
    g, layers = golden()
    prompt = g["prompt"].tolist()
    tokens, heads, dim = layers[0][0].shape
    names = [f"n{i}" for i in range(len(layers))]
    caches = {n: np.zeros((8, heads, 16, 2 * dim), np.float32) for n in names}
    cfg = config(node, layout="vllm_cpu_by_isa")
    cfg.compilation_config = NS(static_forward_context={n: NS(isa="neon") for n in names})
    sched = DecodeNodeConnector(cfg, KVConnectorRole.SCHEDULER)
    worker = DecodeNodeConnector(cfg, KVConnectorRole.WORKER)
    worker.register_kv_caches(caches)
    req = NS(request_id="vllm-neon", prompt_token_ids=prompt, kv_transfer_params={PUSH_ID: "dn-neon"},
             output_token_ids=[])
    sched.update_state_after_alloc(req, None, 0)
    step(sched, worker, scheduler_output(new=[("vllm-neon", [1, 2], 0)], scheduled={"vllm-neon": tokens}),
         caches, names, loads_after_forward=True)
    assert worker._streams == {} and worker._failed == {"vllm-neon"}
    req.output_token_ids = [1]
    sched.request_finished(req, [1, 2])
    step(sched, worker, scheduler_output(), caches, names, loads_after_forward=True)
    assert worker._failed == set()
    deadline = time.time() + 10
    while load(node).host_kv_bytes_used != 0 and time.time() < deadline:
        time.sleep(0.02)
    assert load(node).host_kv_bytes_used == 0
