"""Writes vllm_cpu_caches.npz: paged caches filled by vLLM's own CPU kernel
(`cpu_attn_reshape_and_cache`, one per kernel family it picks: `amx`, `vec`), with the K and V it
was given, so `gather_paged`'s `vllm_cpu*` layouts are checked in CI against vLLM's packing
without vLLM installed. Needs the venv of scripts/vllm-e2e.sh:
    target/vllm-venv/bin/python clients/python/tests/make_vllm_cpu_fixture.py
"""
import os

import numpy as np
import torch
import vllm
from vllm import _custom_ops as ops

BLOCKS, HEADS, BLOCK, DIM, TOKENS = 5, 2, 32, 32, 70
TABLE = [3, 0, 4]  # the sequence's block table; blocks 1 and 2 stay zero


def main():
    g = torch.Generator().manual_seed(7)
    # bf16 values, kept as uint16 bit patterns (numpy has no bf16).
    key = torch.randn(TOKENS, HEADS, DIM, generator=g).to(torch.bfloat16)
    value = torch.randn(TOKENS, HEADS, DIM, generator=g).to(torch.bfloat16)
    slots = torch.tensor([TABLE[t // BLOCK] * BLOCK + t % BLOCK for t in range(TOKENS)])
    out = {"key": key.view(torch.int16).numpy(), "value": value.view(torch.int16).numpy(),
           "table": np.array(TABLE), "vllm_version": np.array(vllm.__version__)}
    for isa in ("amx", "vec"):
        cache = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM, dtype=torch.bfloat16)
        k_cache, v_cache = cache.view(BLOCKS, HEADS, 2 * BLOCK, DIM).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa)
        out[f"cache_{isa}"] = cache.view(torch.int16).numpy()
    path = os.path.join(os.path.dirname(__file__), "vllm_cpu_caches.npz")
    np.savez_compressed(path, **out)
    print(path, os.path.getsize(path), "bytes")


if __name__ == "__main__":
    main()
