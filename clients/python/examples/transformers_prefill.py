"""Prefill with HF transformers, push the KV to a decode node, stream the continuation.

    python examples/transformers_prefill.py --model MODEL_DIR --target 127.0.0.1:50051 --prompt "Hello"

The node must serve the same model (`decode-node serve --model MODEL_DIR`).
"""
import argparse
import uuid

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from decode_node_client import generate, push_kv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--prompt", default="The decode node")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    a = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    ids = tok(a.prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model(ids, use_cache=True)
    next_id = int(out.logits[0, -1].argmax())
    rid = f"py-{uuid.uuid4().hex[:12]}"
    push_kv(a.target, rid, out.past_key_values, ids[0].tolist(), next_id)
    print(tok.decode([next_id]), end="", flush=True)
    for t in generate(a.target, rid, max_new_tokens=a.max_new_tokens):
        print(t.text, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
