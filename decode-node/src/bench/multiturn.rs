//! `bench multiturn`: a chat workload over several turns, pushed with and without prefix
//! reuse. Each turn's prompt is the whole conversation so far (earlier prompts, the node's
//! replies) plus a new user message; the prefill is computed in process and is the same in
//! both runs, so what differs is what the push sends and how soon the first token comes: the
//! time from the push's start to the first token (the decode side's TTFT).

use std::time::Instant;

use anyhow::Context;
use decode_node_proto::v1 as pb;
use kv_transfer::client::{PushOptions, push_kv};
use serde_json::json;

use super::quantile;
use crate::cli::MultiturnBench;
use crate::client;
use crate::model::random::SplitMix;
use crate::node::Node;
use crate::service::InProcess;

/// One run's figures.
#[derive(Debug, Default)]
struct Run {
    bytes_pushed: u64,
    bytes_full: u64,
    reused_tokens: u64,
    prompt_tokens: u64,
    ttft: Vec<f64>,
}

/// The conversation: `turns` turns of `conversations` conversations, round robin.
async fn run(args: &MultiturnBench, node: &Node, reuse: bool) -> anyhow::Result<Run> {
    let mut sa = InProcess::loopback_args(args.common.model.clone(), args.host_kv_bytes, 256 << 20);
    sa.prefix_cache_bytes = if reuse { args.host_kv_bytes } else { 0 };
    sa.max_batch = args.conversations.max(1);
    let server = InProcess::start(sa)
        .await
        .context("the bench node did not start")?;
    let target = server.target();
    let vocab = node.model.model.cfg.vocab_size.max(2) as u64;
    let mut rng = SplitMix(17);
    let mut words =
        |n: u32| -> Vec<u32> { (0..n).map(|_| (rng.next_u64() % vocab) as u32).collect() };
    let mut history: Vec<Vec<u32>> = (0..args.conversations)
        .map(|_| words(args.first_tokens.max(1)))
        .collect();
    let dtype = node.wire_dtype();
    let opts = PushOptions {
        chunk_tokens: 256,
        retries: 0,
        auth_token: None,
    };
    let mut out = Run::default();
    for turn in 0..args.turns {
        for (c, conv) in history.iter_mut().enumerate() {
            let id = format!("c{c}-t{turn}-{reuse}");
            let model = node.model.clone();
            let (ids, idc) = (conv.clone(), id.clone());
            let mut kv =
                tokio::task::spawn_blocking(move || client::prefill_kv(&model, &ids, &idc, dtype))
                    .await??;
            kv.header.reuse_prefix = reuse;
            let full: u64 = kv
                .layers
                .iter()
                .map(|(k, v)| (k.len() + v.len()) as u64)
                .sum();
            let ch = client::connect(&target).await?;
            let t0 = Instant::now();
            let ack = push_kv(ch.clone(), &kv, &opts, |_| {})
                .await
                .map_err(|s| anyhow::anyhow!("push: {s}"))?;
            let mut dc = client::decode_client(ch, None);
            let mut stream = dc
                .generate(pb::GenerateRequest {
                    request_id: id,
                    sampling: Some(pb::SamplingParams::default()),
                    max_new_tokens: args.reply_tokens.max(1),
                    ignore_eos: true,
                    kv_timeout_ms: 60_000,
                    ..Default::default()
                })
                .await?
                .into_inner();
            let mut reply = vec![kv.header.next_token_id];
            let mut first = None;
            while let Some(m) = stream.message().await? {
                if let Some(pb::generate_response::Event::Token(t)) = m.event {
                    first.get_or_insert_with(|| t0.elapsed().as_secs_f64());
                    reply.push(t.id);
                }
            }
            out.ttft
                .push(first.unwrap_or_else(|| t0.elapsed().as_secs_f64()));
            out.bytes_pushed += ack.bytes_received;
            out.bytes_full += full;
            out.reused_tokens += u64::from(ack.reused_tokens);
            out.prompt_tokens += conv.len() as u64;
            conv.extend_from_slice(&reply);
            conv.extend(words(args.user_tokens.max(1)));
        }
    }
    server.stop().await?;
    out.ttft.sort_by(f64::total_cmp);
    Ok(out)
}

/// The bench: both runs, then their ratios.
pub(super) async fn multiturn(args: &MultiturnBench) -> anyhow::Result<serde_json::Value> {
    let node = Node::build(&args.common.model)?;
    let mut rows = Vec::new();
    let mut figures = Vec::new();
    for reuse in [false, true] {
        let r = run(args, &node, reuse).await?;
        let (p50, p90) = (quantile(&r.ttft, 0.5), quantile(&r.ttft, 0.9));
        let mean = r.ttft.iter().sum::<f64>() / r.ttft.len().max(1) as f64;
        if !args.common.json {
            eprintln!(
                "multiturn reuse={reuse:<5}  pushed {:>8.2} MiB of {:>8.2} MiB  reused tokens {:>6} of {:>6}  TTFT p50 {:>7.1} ms  p90 {:>7.1} ms  mean {:>7.1} ms",
                r.bytes_pushed as f64 / (1 << 20) as f64,
                r.bytes_full as f64 / (1 << 20) as f64,
                r.reused_tokens,
                r.prompt_tokens,
                p50 * 1e3,
                p90 * 1e3,
                mean * 1e3
            );
        }
        rows.push(json!({
            "reuse": reuse,
            "bytes_pushed": r.bytes_pushed,
            "bytes_full": r.bytes_full,
            "reused_tokens": r.reused_tokens,
            "prompt_tokens": r.prompt_tokens,
            "ttft_p50_s": p50,
            "ttft_p90_s": p90,
            "ttft_mean_s": mean,
        }));
        figures.push((r.bytes_pushed, p50));
    }
    let (without, with) = (figures[0], figures[1]);
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    let bytes_ratio = ratio(with.0 as f64, without.0 as f64);
    let ttft_ratio = ratio(with.1, without.1);
    if !args.common.json {
        eprintln!(
            "multiturn with reuse: {bytes_ratio:.3} of the bytes pushed, p50 TTFT {ttft_ratio:.3} of without"
        );
    }
    Ok(json!({
        "bench": "multiturn",
        "model_id": node.layout.model_id,
        "conversations": args.conversations,
        "turns": args.turns,
        "first_tokens": args.first_tokens,
        "user_tokens": args.user_tokens,
        "reply_tokens": args.reply_tokens,
        "runs": rows,
        "bytes_ratio": bytes_ratio,
        "ttft_p50_ratio": ttft_ratio,
    }))
}
