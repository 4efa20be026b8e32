#!/usr/bin/env python3
"""Makes the golden files the model tests compare against: HF transformers is the reference.

Dev-only (never run by CI): needs `pip install torch transformers safetensors numpy`.
For each case it builds a tiny random model with transformers itself, saves it in HF format
(config.json + model.safetensors), runs a prompt and records, in golden.safetensors:
  prompt   [T]            int64 prompt ids
  k.{i}    [T, Hkv, D]    layer i's past_key_values K (after RoPE), f32
  v.{i}    [T, Hkv, D]    layer i's V
  logits   [V]            logits of the last prompt position
  greedy   [N]            HF greedy continuation (its first token is the prefill's next token)
Run from the repository root: `python tests/golden/make_golden.py`.
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

HERE = os.path.dirname(os.path.abspath(__file__))
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2)

CASES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(rope_theta=10000.0, tie_word_embeddings=False)),
    "llama3-rope": (LlamaConfig, LlamaForCausalLM, dict(
        rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64))),
    "qwen2-tied": (Qwen2Config, Qwen2ForCausalLM, dict(rope_theta=1000000.0, tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(rope_theta=1000000.0, tie_word_embeddings=False, head_dim=32)),
    "mistral-mha": (MistralConfig, MistralForCausalLM, dict(rope_theta=10000.0, tie_word_embeddings=False,
                                                            num_key_value_heads=4, sliding_window=None)),
}
PROMPT_LEN = 23
NEW_TOKENS = 16


def make_tokenizer(path):
    """A tiny byte-level BPE, so the streaming detokenizer is tested on multi-byte text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["The decode node streams tokens while the prefill node pushes KV. "
            "Grüße, naïve café — 東京 🚀."] * 50
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    tok.save(path)


def kv_of(cache, layer):
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def main():
    torch.manual_seed(0)
    for idx, (name, (cfg_cls, model_cls, extra)) in enumerate(CASES.items()):
        cfg = cfg_cls(**{**COMMON, **extra})
        torch.manual_seed(1000 + idx)
        model = model_cls(cfg).to(torch.float32).eval()
        # Larger weights than HF's 0.02 init, so logits are well separated and greedy is stable.
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 1.0 / p.shape[1] ** 0.5 * 2.0)
                else:
                    p.uniform_(0.8, 1.2)
            if getattr(cfg, "tie_word_embeddings", False):
                model.tie_weights()
        out_dir = os.path.join(HERE, name)
        model.save_pretrained(out_dir, safe_serialization=True)
        g = torch.Generator().manual_seed(7)
        prompt = torch.randint(3, cfg.vocab_size, (1, PROMPT_LEN), generator=g)
        with torch.no_grad():
            out = model(prompt, use_cache=True)
            gen = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        tensors = {"prompt": prompt[0].to(torch.int64), "logits": out.logits[0, -1].contiguous(),
                   "greedy": gen[0, PROMPT_LEN:].to(torch.int64).contiguous()}
        for i in range(cfg.num_hidden_layers):
            k, v = kv_of(out.past_key_values, i)
            tensors[f"k.{i}"] = k[0].transpose(0, 1).contiguous()
            tensors[f"v.{i}"] = v[0].transpose(0, 1).contiguous()
        save_file(tensors, os.path.join(out_dir, "golden.safetensors"))
        gen_cfg = os.path.join(out_dir, "generation_config.json")
        if os.path.exists(gen_cfg):
            os.remove(gen_cfg)
        logits = out.logits[0, -1]
        top2 = torch.topk(logits, 2).values
        print(f"{name}: greedy {tensors['greedy'].tolist()} top-2 margin {float(top2[0] - top2[1]):.3f}",
              file=sys.stderr)
        with open(os.path.join(out_dir, "config.json")) as f:
            json.load(f)
        if name == "llama":
            make_tokenizer(os.path.join(out_dir, "tokenizer.json"))


if __name__ == "__main__":
    main()
