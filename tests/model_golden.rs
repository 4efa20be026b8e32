//! Conformance with HF transformers (golden files made by `tests/golden/make_golden.py`):
//! our prefill KV and first-step logits equal HF's (rel 1e-4, f32), and a node serving the
//! model with `--attention full`, fed HF's own KV, streams HF's exact greedy tokens.

mod common;
use common::*;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use decode_node::backend::CpuBackend;
use decode_node_proto::v1 as pb;
use kv_transfer::client::PromptKv;
use safetensors::SafeTensors;

const CASES: [&str; 5] = ["llama", "llama3-rope", "qwen2-tied", "qwen3", "mistral-mha"];

fn dir(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/golden")
        .join(case)
}

struct Golden {
    prompt: Vec<u32>,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    logits: Vec<f32>,
    greedy: Vec<u32>,
}

fn f32s(t: &safetensors::tensor::TensorView<'_>) -> Vec<f32> {
    t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn i64s(t: &safetensors::tensor::TensorView<'_>) -> Vec<u32> {
    t.data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect()
}

fn golden(case: &str) -> Golden {
    let bytes = std::fs::read(dir(case).join("golden.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut keys = Vec::new();
    let mut values = Vec::new();
    for i in 0.. {
        let (Ok(k), Ok(v)) = (st.tensor(&format!("k.{i}")), st.tensor(&format!("v.{i}"))) else {
            break;
        };
        keys.push(f32s(&k));
        values.push(f32s(&v));
    }
    Golden {
        prompt: i64s(&st.tensor("prompt").unwrap()),
        keys,
        values,
        logits: f32s(&st.tensor("logits").unwrap()),
        greedy: i64s(&st.tensor("greedy").unwrap()),
    }
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(1f32, |m, x| m.max(x.abs()));
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        worst <= 1e-4 * scale,
        "{what}: max |diff| {worst} > 1e-4 x {scale}"
    );
}

#[test]
fn prefill_kv_and_logits_equal_transformers() {
    for case in CASES {
        let g = golden(case);
        let m =
            decode_node::model::load(dir(case).to_str().unwrap(), Arc::new(CpuBackend)).unwrap();
        let out = m.model.prefill(&g.prompt).unwrap();
        assert_eq!(out.keys.len(), g.keys.len(), "{case}: layers");
        for (i, (k, v)) in out.keys.iter().zip(&out.values).enumerate() {
            assert_close(&format!("{case} K layer {i}"), k, &g.keys[i]);
            assert_close(&format!("{case} V layer {i}"), v, &g.values[i]);
        }
        assert_close(&format!("{case} logits"), &out.logits, &g.logits);
        assert_eq!(
            decode_node::model::sampling::argmax(&out.logits) as u32,
            g.greedy[0],
            "{case}: first token"
        );
    }
}

fn hf_push(info: &pb::ModelInfo, g: &Golden, id: &str) -> PromptKv {
    let enc = |v: &[f32]| Bytes::from(v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
    PromptKv {
        header: pb::KvHeader {
            request_id: id.into(),
            model_id: info.model_id.clone(),
            num_layers: info.num_layers,
            num_kv_heads: info.num_kv_heads,
            head_dim: info.head_dim,
            dtype: pb::DType::DtypeF32 as i32,
            num_tokens: g.prompt.len() as u32,
            prompt_token_ids: g.prompt.clone(),
            next_token_id: g.greedy[0],
            num_streams: 0,
            reuse_prefix: false,
        },
        layers: g
            .keys
            .iter()
            .zip(&g.values)
            .map(|(k, v)| (enc(k), enc(v)))
            .collect(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_fed_transformers_kv_streams_transformers_greedy_tokens() {
    for case in CASES {
        let g = golden(case);
        for mode in ["full", "scout"] {
            let s = Served::start(&[
                "--model",
                dir(case).to_str().unwrap(),
                "--attention",
                mode,
                "--block-size",
                "8",
            ]);
            let mut c = pb::decode_client::DecodeClient::new(s.channel().await);
            let info = c
                .get_model_info(pb::GetModelInfoRequest {})
                .await
                .unwrap()
                .into_inner();
            assert_eq!(
                info.kv_dtype,
                pb::DType::DtypeF32 as i32,
                "an f32 model keeps f32 KV"
            );
            push(&s, &hf_push(&info, &g, "hf")).await.unwrap();
            let n = g.greedy.len() as u32 - 1;
            let (ids, _) = generate(&s, gen_req("hf", n)).await.unwrap();
            assert_eq!(ids, g.greedy[1..], "{case} --attention {mode}");
        }
    }
}

#[test]
fn hf_tokenizer_streams_whole_characters() {
    let m = decode_node::model::load(dir("llama").to_str().unwrap(), Arc::new(CpuBackend)).unwrap();
    let tok = &m.tokenizer;
    assert!(matches!(tok, decode_node::model::Tokenizer::Hf(_)));
    for text in [
        "Grüße 東京 🚀 decode",
        "The prefill node pushes KV. café — naïve",
    ] {
        let ids = tok.encode(text).unwrap();
        // Seeded with the first token, as the node seeds with the prompt's tail.
        let mut st = tok.text_state(&ids[..1]);
        let pieces: Vec<String> = ids[1..].iter().map(|i| st.step(tok, *i)).collect();
        let first = {
            let mut s0 = tok.text_state(&[]);
            s0.step(tok, ids[0])
        };
        let joined = first + &pieces.concat();
        assert_eq!(joined, text);
        assert!(pieces.iter().all(|p| !p.contains('\u{fffd}')), "{pieces:?}");
    }
}
