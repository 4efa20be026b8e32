#!/usr/bin/env python3
"""Golden references for a real model: HF transformers running SmolLM2-135M-Instruct from its
Q4_1 GGUF (dequantized by transformers' own GGUF reader, saved as bf16, computed in f32).

Dev-only (never run by CI): needs a venv with `torch transformers safetensors gguf accelerate`
and an HF directory made by `../shared/tools/gguf_to_hf.py` from the GGUF that
`scripts/fetch-smollm2.sh` fetches. Writes tests/golden/smollm2/golden.json:
  cases[i].text      the prompt text
  cases[i].ids       HF tokenizers ids (no special tokens added: SmolLM2 adds none)
  cases[i].top_ids   the 20 largest last-position logits' ids, largest first
  cases[i].top_logits their values (f32)
  cases[i].greedy    HF greedy continuation, 24 tokens
Usage: python tests/golden/make_smollm2_golden.py HF_DIR

The tokenizer transformers builds from a GGUF is a plain ByteLevel one: it drops the digit split
that the GGUF names (`tokenizer.ggml.pre = smollm`: each digit alone, then GPT-2's regex on each
piece, as SmolLM2's own tokenizer.json and llama.cpp do). So the pre-tokenizer is set back to
SmolLM2's before encoding; without it, whitespace that ends just before a digit tokenizes
differently ("\n\n1." gives two newline tokens instead of one).
"""
import json
import os
import sys

import torch
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# Real text: a short factual prompt, and a longer one from this repository's own fidelity text
# (so RoPE and attention run over a few hundred positions).
with open(os.path.join(ROOT, "decode-node/src/bench/fidelity_text.txt"), encoding="utf-8") as f:
    LONG = f.read()[:2400]
TEXTS = ["The capital of France is", "In 2024, 12345 people came.\n\n1. The first", LONG]
TOP = 20
NEW = 24


def main(hf_dir):
    tok = AutoTokenizer.from_pretrained(hf_dir)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    cases = []
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        x = torch.tensor([ids])
        with torch.no_grad():
            logits = model(x).logits[0, -1]
            top = torch.topk(logits, TOP)
            out = model.generate(x, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                 pad_token_id=tok.eos_token_id)
        cases.append(dict(text=text, ids=ids, top_ids=top.indices.tolist(),
                          top_logits=[float(v) for v in top.values],
                          greedy=out[0, len(ids):].tolist()))
        print(len(ids), "tokens; greedy:", repr(tok.decode(cases[-1]["greedy"])))
    os.makedirs(os.path.join(HERE, "smollm2"), exist_ok=True)
    with open(os.path.join(HERE, "smollm2", "golden.json"), "w") as f:
        json.dump(dict(model="SmolLM2-135M-Instruct.Q4_1.gguf", cases=cases), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
