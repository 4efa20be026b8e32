"""`gather_paged` against paged caches that the engines' own kernels filled."""
import os

import numpy as np
import pytest

from decode_node_client import gather_paged

FIXTURE = os.path.join(os.path.dirname(__file__), "vllm_cpu_caches.npz")


def bf16(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (int16) as float32."""
    return (bits.astype(np.uint16).astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("isa,layout", [("amx", "vllm_cpu_amx"), ("vec", "vllm_cpu")])
def test_vllm_cpu_layouts_read_what_vllms_own_kernel_wrote(isa, layout):
    """The fixture holds caches filled by vLLM's `cpu_attn_reshape_and_cache` (see
    make_vllm_cpu_fixture.py): every span of the sequence comes back as vLLM was given it."""
    f = np.load(FIXTURE)
    key, value, table = bf16(f["key"]), bf16(f["value"]), f["table"].tolist()
    cache = bf16(f[f"cache_{isa}"])
    for lo, hi in ((0, len(key)), (5, 37), (31, 33), (40, 40)):
        k, v = gather_paged(cache, table, lo, hi, layout=layout)
        assert np.array_equal(k, key[lo:hi]) and np.array_equal(v, value[lo:hi]), (lo, hi)
    # The other packing reads something else: the test tells the two apart.
    other = "vllm_cpu" if layout == "vllm_cpu_amx" else "vllm_cpu_amx"
    k, _ = gather_paged(cache, table, 0, len(key), layout=other)
    assert not np.array_equal(k, key)
    with pytest.raises(ValueError):
        gather_paged(cache, table, 0, len(table) * cache.shape[2] + 1, layout=layout)


def test_vllm_bhnc_splits_each_tokens_row_into_its_key_and_value():
    """vLLM 0.32's [B, H, N, C] view as its FlashAttention backend reads it:
    `kv_cache.transpose(1, 2).split(head_size, dim=-1)`."""
    rng = np.random.default_rng(1)
    blocks, heads, size, dim = 4, 2, 8, 16
    cache = rng.standard_normal((blocks, heads, size, 2 * dim)).astype(np.float32)
    table = [2, 0, 3]
    k_ref = cache.transpose(0, 2, 1, 3)[..., :dim]  # [B, N, H, D], as the backend splits it
    v_ref = cache.transpose(0, 2, 1, 3)[..., dim:]
    k, v = gather_paged(cache, table, 3, 20, layout="vllm_bhnc")
    t = np.arange(3, 20)
    b, s = np.array(table)[t // size], t % size
    assert np.array_equal(k, k_ref[b, s]) and np.array_equal(v, v_ref[b, s])
    # A non-contiguous view (a physical order other than [B, H, N, C]) reads the same.
    phys = np.ascontiguousarray(cache.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    k2, v2 = gather_paged(phys, table, 3, 20, layout="vllm_bhnc")
    assert np.array_equal(k2, k) and np.array_equal(v2, v)


def test_a_torch_cache_keeps_its_dtype_and_is_sent_bit_for_bit():
    """`keep_dtype` hands a torch cache's tokens over in bf16, and `_encode` sends a bf16 tensor
    to a bf16 node as its bits: the same bytes as the float32 path's rounding (exact: bf16 values
    survive f32). Runs where torch is installed (scripts/vllm-e2e.sh's venv); CI has none."""
    torch = pytest.importorskip("torch")
    from decode_node_client import _encode, common_pb2
    f = np.load(FIXTURE)
    cache = torch.from_numpy(f["cache_amx"]).view(torch.bfloat16)
    table = f["table"].tolist()
    k, v = gather_paged(cache, table, 3, 50, layout="vllm_cpu_amx", keep_dtype=True)
    assert k.dtype == torch.bfloat16 and tuple(k.shape) == (47, 2, 32)
    kf, vf = gather_paged(cache, table, 3, 50, layout="vllm_cpu_amx")
    assert np.array_equal(k.float().numpy(), kf) and np.array_equal(v.float().numpy(), vf)
    for dtype, tdtype in ((common_pb2.DTYPE_BF16, torch.bfloat16), (common_pb2.DTYPE_F16, torch.float16)):
        t = k.to(tdtype)
        assert _encode(t, dtype) == _encode(t.float().numpy(), dtype)
    assert _encode(k, common_pb2.DTYPE_F32) == _encode(kf, common_pb2.DTYPE_F32)
