//! `--kv-dtype int8` and `fp8`: the node stores pushed KV as 8-bit integers or e4m3 floats with
//! a scale per token and head (pushes still send the model's float dtype), holds about twice the
//! tokens per byte of f16, and decodes close to the float pool.

mod common;
use common::*;

use decode_node_proto::v1 as pb;

/// Host bytes a pushed prompt of `n` tokens holds on a node started with `extra`.
async fn held_after_push(extra: &[&str], n: usize) -> (u64, pb::ModelInfo, Vec<u32>) {
    let s = Served::start(extra);
    let mut c = pb::decode_client::DecodeClient::new(s.channel().await);
    let info = c
        .get_model_info(pb::GetModelInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    let p = prompt(n, 21);
    push(&s, &prompt_kv("q", &p)).await.unwrap();
    let held = load(&s).await.host_kv_bytes_used;
    let (out, _) = generate(&s, gen_req("q", 16)).await.unwrap();
    (held, info, out)
}

/// A pool of `dtype` (int8 or fp8) against an f32 one: a quarter of the bytes plus the scales,
/// and a greedy continuation that stays mostly the same.
async fn an_8bit_pool_holds_a_quarter_of_f32_and_decodes_alike(dtype: &str) {
    let n = 128;
    let (f32_held, f32_info, want) = held_after_push(&["--attention", "full"], n).await;
    let (q_held, q_info, got) =
        held_after_push(&["--attention", "full", "--kv-dtype", dtype], n).await;
    // Pushes still send the model's dtype.
    assert_eq!(q_info.kv_dtype, f32_info.kv_dtype);
    // Per token and head: 2 x head_dim bytes and two f32 scales, against 2 x head_dim x 4.
    let d = f32_info.head_dim as u64;
    assert_eq!(
        q_held * (8 * d),
        f32_held * (2 * d + 8),
        "{dtype}: {q_held} vs {f32_held}"
    );
    // Quantization moves logits a little: the greedy continuation stays mostly the same.
    let same = want.iter().zip(&got).filter(|(a, b)| a == b).count();
    assert!(same * 4 >= want.len() * 3, "{dtype}: {want:?} vs {got:?}");
    assert_eq!(want[0], got[0], "{dtype}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_int8_pool_holds_a_prompt_in_a_quarter_of_f32_and_decodes_alike() {
    an_8bit_pool_holds_a_quarter_of_f32_and_decodes_alike("int8").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_fp8_pool_holds_a_prompt_in_a_quarter_of_f32_and_decodes_alike() {
    an_8bit_pool_holds_a_quarter_of_f32_and_decodes_alike("fp8").await;
}

#[test]
fn int8_and_fp8_are_refused_where_they_cannot_run() {
    // A model file cannot be made with 8-bit weights.
    for dtype in ["int8", "fp8"] {
        let out = bin()
            .args(["make-model", "--out", "/nonexistent-8bit", "--dtype", dtype])
            .output()
            .unwrap();
        assert!(!out.status.success());
        assert!(String::from_utf8_lossy(&out.stderr).contains("expected f32, f16 or bf16"));
    }
}
