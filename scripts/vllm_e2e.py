"""A real vLLM (CPU build) prefills and decode-node decodes: the end-to-end check of
`decode_node_client.vllm_connector` that CI cannot run (vLLM pulls ~4 GB of torch).

For each prompt, vLLM runs it with max_tokens=1 and the connector pushing its KV layer by layer
(chunked prefill included: `--max-batched-tokens` below the longest prompt), then the node decodes
greedily from that KV; the same vLLM decodes the prompt itself with no push. The two greedy
continuations are compared token by token. Run by scripts/vllm-e2e.sh, which sets everything up.
"""
import argparse
import json
import os
import statistics
import sys
import time


def prompts(tokenizer, long_tokens: int):
    chat = [
        "What is the capital of France? Answer in one sentence.",
        "Write a haiku about the sea.",
        "List three prime numbers greater than 100.",
    ]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                           add_generation_prompt=True) for c in chat]
    # A long prompt: a passkey in filler, so the answer depends on attending far back.
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    needle = "The pass key is 71432. Remember it. 71432 is the pass key. "
    body = filler * 4 + needle
    while len(tokenizer(body + filler).input_ids) < long_tokens:
        body += filler
    texts.append(tokenizer.apply_chat_template(
        [{"role": "user", "content": body + "What is the pass key?"}], tokenize=False, add_generation_prompt=True))
    return texts


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, help="HF model directory (the node serves the same weights)")
    ap.add_argument("--target", required=True, help="the node's gRPC address, host:port")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--long-tokens", type=int, default=1500, help="length of the long (passkey) prompt")
    ap.add_argument("--max-batched-tokens", type=int, default=512,
                    help="vLLM's per-step token budget: below the long prompt, so its prefill is chunked")
    ap.add_argument("--tp", type=int, default=1, help="vLLM tensor-parallel size")
    ap.add_argument("--timing-repeats", type=int, default=3,
                    help="prefills timed with and without a push per prompt, alternated (medians)")
    ap.add_argument("--json", help="write the per-prompt results here")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from decode_node_client import drop_kv, generate_all, get_load

    ktc = KVTransferConfig(kv_connector="DecodeNodeConnector",
                           kv_connector_module_path="decode_node_client.vllm_connector",
                           kv_role="kv_producer", kv_connector_extra_config={"target": args.target})
    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=8192, enforce_eager=True,
              max_num_batched_tokens=args.max_batched_tokens, tensor_parallel_size=args.tp,
              enable_prefix_caching=False, kv_transfer_config=ktc)
    texts = prompts(llm.get_tokenizer(), args.long_tokens)
    rows, ok, pending = [], True, []
    for i, text in enumerate(texts):
        rid = f"vllm-e2e-{os.getpid()}-{i}"
        push = SamplingParams(max_tokens=1, temperature=0,
                              extra_args={"kv_transfer_params": {"decode_node_request_id": rid}})
        t0 = time.time()
        out = llm.generate([text], push, use_tqdm=False)[0]
        prefill_s = time.time() - t0
        first = list(out.outputs[0].token_ids)
        t0 = time.time()
        toks, finish = generate_all(args.target, rid, max_new_tokens=args.new_tokens - 1, ignore_eos=True,
                                    kv_timeout_ms=10_000)
        decode_s = time.time() - t0
        node = first + [t.id for t in toks]
        # The connector's cost: the same prefill with and without a push, alternated (a shared
        # VM's speed drifts), medians of `--timing-repeats`.
        with_push, alone = [prefill_s], []
        for r in range(args.timing_repeats):
            t0 = time.time()
            llm.generate([text], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
            alone.append(time.time() - t0)
            if r + 1 < args.timing_repeats:
                extra = f"{rid}-t{r}"
                t0 = time.time()
                llm.generate([text], SamplingParams(max_tokens=1, temperature=0, extra_args={
                    "kv_transfer_params": {"decode_node_request_id": extra}}), use_tqdm=False)
                with_push.append(time.time() - t0)
                # Its commit goes out with vLLM's next step; dropped below, once that has run.
                pending.append(extra)
        prefill_s, alone_s = statistics.median(with_push), statistics.median(alone)
        mine = llm.generate([text], SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True,
                                                   logprobs=5), use_tqdm=False)[0].outputs[0]
        own = list(mine.token_ids)
        for extra in pending:  # their commits went out with the steps since: free them now
            drop_kv(args.target, extra)
        pending.clear()
        same = next((j for j, (a, b) in enumerate(zip(node, own)) if a != b), min(len(node), len(own)))
        # How much more likely vLLM found its own token than the node's where they first part
        # (a near-tie is arithmetic; a wide margin is information lost). None: not in vLLM's top 5.
        margin = None
        if same < min(len(node), len(own)):
            lp = mine.logprobs[same]
            if node[same] in lp:
                margin = round(lp[own[same]].logprob - lp[node[same]].logprob, 4)
        tok = llm.get_tokenizer()
        row = {"prompt": i, "prompt_tokens": len(out.prompt_token_ids), "tokens_equal_before_first_difference": same,
               "of": len(own), "vllm_margin_at_difference_nats": margin,
               "prefill_push_s": round(prefill_s, 3), "prefill_alone_s": round(alone_s, 3),
               "node_decode_s": round(decode_s, 3),
               "node_text": tok.decode(node), "vllm_text": tok.decode(own)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        # Greedy decodes in two engines' arithmetic (vLLM's bf16, the node's f32 over bf16 KV) may
        # part at a near-tie; the first tokens must agree, or the KV did not arrive as vLLM had it.
        ok &= same >= min(8, len(own))
    # Every push was generated from or dropped: the node's pool is back to empty.
    held = get_load(args.target).host_kv_bytes_used
    print(f"node host KV in use at the end: {held} bytes", flush=True)
    ok &= held == 0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("PASS" if ok else "FAIL", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
